#!/usr/bin/env bash
# The team MLflow tracking server: PostgreSQL backend store, artifacts proxied by the
# server to S3 (clients need no S3 credentials), MLflow's basic-auth app (users,
# per-experiment permissions), /health for health checks.
#
# Configuration comes from the environment (see mlflow.env.example):
#   MLFLOW_BACKEND_STORE_URI        postgresql+psycopg2://mlflow:PASSWORD@DBHOST:5432/mlflow
#   MLFLOW_AUTH_DATABASE_URI        postgresql+psycopg2://mlflow:PASSWORD@DBHOST:5432/mlflow_auth
#   MLFLOW_ARTIFACTS_DESTINATION    s3://BUCKET/mlflow
#   MLFLOW_FLASK_SERVER_SECRET_KEY  long random string (the auth app's CSRF key; the same on every replica)
#   MLFLOW_AUTH_ADMIN_PASSWORD      the admin's password on the first start (then change it)
# optional:
#   MLFLOW_AUTH_ADMIN_USERNAME (admin)  MLFLOW_AUTH_DEFAULT_PERMISSION (READ)
#   MLFLOW_AUTH_CACHE_TTL_SECONDS (0: every request checks the password hash; N > 0 caches
#     a verified login N seconds per worker, much faster for jobs that log many artifacts,
#     but a changed or deleted password keeps working up to N seconds on other workers)
#   MLFLOW_HOST (127.0.0.1)  MLFLOW_PORT (5000)  MLFLOW_WORKERS (4)  MLFLOW_ALLOWED_HOSTS
#   MLFLOW_S3_ENDPOINT_URL (an S3-compatible store)  AWS_* (credentials, when there is no instance role)
#
# The explicit +psycopg2 driver: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3.
set -euo pipefail

: "${MLFLOW_BACKEND_STORE_URI:?set MLFLOW_BACKEND_STORE_URI, e.g. postgresql+psycopg2://mlflow:PASSWORD@HOST:5432/mlflow}"
: "${MLFLOW_AUTH_DATABASE_URI:?set MLFLOW_AUTH_DATABASE_URI, e.g. postgresql+psycopg2://mlflow:PASSWORD@HOST:5432/mlflow_auth}"
: "${MLFLOW_ARTIFACTS_DESTINATION:?set MLFLOW_ARTIFACTS_DESTINATION, e.g. s3://BUCKET/mlflow}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set MLFLOW_FLASK_SERVER_SECRET_KEY to a long random string}"

# The auth app reads its settings from an INI file. It holds a database password: it
# goes to a folder only this user can read. configparser treats % specially, and
# URL-encoded passwords contain it.
umask 077
conf_dir="$(mktemp -d "${TMPDIR:-/tmp}/mlflow-auth.XXXXXX")"
cat > "$conf_dir/basic_auth.ini" <<INI
[mlflow]
default_permission = ${MLFLOW_AUTH_DEFAULT_PERMISSION:-READ}
database_uri = ${MLFLOW_AUTH_DATABASE_URI//%/%%}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_SECONDS:-0}
INI
export MLFLOW_AUTH_CONFIG_PATH="$conf_dir/basic_auth.ini"

args=(
  --app-name basic-auth
  --backend-store-uri "$MLFLOW_BACKEND_STORE_URI"
  --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"
  --serve-artifacts
  --host "${MLFLOW_HOST:-127.0.0.1}"
  --port "${MLFLOW_PORT:-5000}"
  --workers "${MLFLOW_WORKERS:-4}"
)
if [ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]; then
  args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi
exec "${MLFLOW_BIN:-mlflow}" server "${args[@]}"
