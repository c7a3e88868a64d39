-- The basic-auth app keeps its users in a database of its own (run once by the
-- postgres image on an empty data volume; POSTGRES_USER=mlflow owns both).
CREATE DATABASE mlflow_auth OWNER mlflow;
