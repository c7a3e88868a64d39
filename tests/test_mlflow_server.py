"""The team MLflow server of infra/mlflow, for real: `serve.sh` on a private PostgreSQL
cluster (Debian's PostgreSQL, started here in a temp folder on a free loopback port)
and the local S3-compatible endpoint, with MLflow's basic-auth app. A tiny Ray Train
run logs to it; its metrics and artifacts are read back through the MLflow client,
and found in PostgreSQL and in the bucket.

PostgreSQL comes from `.ci/install-postgresql.sh`. Without it these tests skip, unless
SPLITVIT_REQUIRE_POSTGRES=1 (CI) makes that a failure.
"""

from __future__ import annotations

import glob
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from splitvit.cluster import stack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "infra" / "mlflow" / "serve.sh"
HEALTHCHECK = ROOT / "infra" / "mlflow" / "healthcheck.py"


def _missing(reason: str) -> None:
    if os.environ.get("SPLITVIT_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{reason} (SPLITVIT_REQUIRE_POSTGRES=1)")
    pytest.skip(f"{reason}; run .ci/install-postgresql.sh")


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        _missing("Debian's PostgreSQL is not installed")
    return Path(found[-1]).parent


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the postgres user then."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL cluster on 127.0.0.1:<free port>; its `mlflow` role owns the
    databases `mlflow` (tracking) and `mlflow_auth` (users). Yields a dict of settings."""
    try:
        import psycopg2
    except ImportError:
        _missing("psycopg2 is not installed (pip install -e '.[test]')")
    bin_dir = _pg_bin()
    folder = Path(tempfile.mkdtemp(prefix="svpg-"))
    superuser_password, mlflow_password = secrets.token_hex(12), secrets.token_hex(12)
    pwfile = folder / "pw"
    pwfile.write_text(superuser_password + "\n")
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    data, port = folder / "data", stack.free_port()
    log = folder / "postgres.log"
    subprocess.run(
        _as_postgres(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--no-instructions",
            ]
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={folder} -c fsync=off"
    subprocess.run(
        _as_postgres(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start"]
        ),
        check=True,
        capture_output=True,
        timeout=90,
    )
    try:
        conn = psycopg2.connect(
            host="127.0.0.1", port=port, user="postgres", password=superuser_password, dbname="postgres"
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE ROLE mlflow LOGIN PASSWORD %s", (mlflow_password,))
            cur.execute("CREATE DATABASE mlflow OWNER mlflow")
            cur.execute("CREATE DATABASE mlflow_auth OWNER mlflow")
        conn.close()
        yield {
            "port": port,
            "password": mlflow_password,
            "uri": f"postgresql+psycopg2://mlflow:{mlflow_password}@127.0.0.1:{port}",
        }
    finally:
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def team_server(postgres, s3_endpoint):
    """infra/mlflow/serve.sh on PostgreSQL and the local S3 endpoint, on a free loopback port."""
    import boto3

    bucket = f"mlflow-{secrets.token_hex(6)}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    port = stack.free_port()
    admin_password = secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # this venv's mlflow
            "MLFLOW_BACKEND_STORE_URI": f"{postgres['uri']}/mlflow",
            "MLFLOW_AUTH_DATABASE_URI": f"{postgres['uri']}/mlflow_auth",
            "MLFLOW_ARTIFACTS_DESTINATION": f"s3://{bucket}/mlflow",
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
            "MLFLOW_HOST": "127.0.0.1",
            "MLFLOW_PORT": str(port),
            "MLFLOW_WORKERS": "1",
            "MLFLOW_AUTH_CACHE_TTL_SECONDS": "60",  # as compose.yaml and k8s/mlflow.yaml run it
            "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
    )
    log_path = Path(tempfile.mkdtemp(prefix="svmlflow-")) / "server.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(SERVE)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def dead() -> str | None:
        return None if proc.poll() is None else f"exit {proc.returncode}:\n{stack.tail(log_path)}"

    try:
        stack.wait_until(
            lambda: stack._http_check(f"{url}/health", None, "OK"),
            timeout_s=240,
            what=f"the team MLflow server ({url})",
            alive=dead,
        )
        yield {
            "url": url,
            "admin": ("admin", admin_password),
            "bucket": bucket,
            "endpoint": s3_endpoint,
            "postgres": postgres,
            "log": log_path,
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # serve.sh exec'd mlflow; its workers share the session
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(log_path.parent, ignore_errors=True)


def test_serve_sh_refuses_to_start_without_its_settings(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(["bash", str(SERVE)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "MLFLOW_BACKEND_STORE_URI" in result.stderr


def test_team_server_requires_a_login_and_answers_its_health_check(team_server):
    url = team_server["url"]
    assert stack.http_get(f"{url}/health") == (200, "OK")
    code, _ = stack.http_get(f"{url}/api/2.0/mlflow/experiments/search?max_results=1")
    assert code == 401
    import base64

    user, password = team_server["admin"]
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    # a logged-in request hashes the password (CPU-bound): on a busy machine it takes seconds
    code, body = stack.http_get(
        f"{url}/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Authorization": f"Basic {token}"},
        timeout=60,
    )
    assert code == 200 and "experiments" in body
    code, _ = stack.http_get(
        f"{url}/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Authorization": "Basic " + base64.b64encode(b"admin:wrong").decode()},
        timeout=60,
    )
    assert code == 401
    # the health check the compose file and the image use
    ok = subprocess.run([sys.executable, str(HEALTHCHECK), f"{url}/health"], timeout=30)
    assert ok.returncode == 0
    down = subprocess.run(
        [sys.executable, str(HEALTHCHECK), f"http://127.0.0.1:{stack.free_port()}/health"],
        capture_output=True,
        timeout=30,
    )
    assert down.returncode == 1


def test_training_run_is_recorded_in_postgres_and_s3(team_server, ray_local, tmp_path, monkeypatch):
    import boto3
    import psycopg2
    from mlflow import MlflowClient

    from splitvit.config import ExperimentConfig
    from splitvit.train.ray_trainer import run_training

    user, password = team_server["admin"]
    host = team_server["url"].split("://", 1)[1]
    # Credentials in the URI: the Ray workers of the shared test instance cannot be given
    # MLFLOW_TRACKING_USERNAME/PASSWORD after they started (a job's runtime env would).
    tracking_uri = f"http://{user}:{password}@{host}"
    config = ExperimentConfig.from_dict(
        {
            "recipe": "none",  # two levels: the recipes' level context needs three
            "model": {
                "name": "vit_tiny_patch16_224",
                "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
                "image_size": 16,
                "levels": 2,
                "num_classes": 4,
                "policy": {"kind": "learned", "depth": 1},
            },
            "data": {
                "name": "synthetic",
                "options": {"train_samples": 64, "val_samples": 32, "object_size": 4},
                "batch_size": 16,
            },
            "train": {"epochs": 2, "lr": 0.002, "policy": {"warmup_epochs": 1}},
            "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
            "storage": {"path": str(tmp_path / "runs"), "name": "team-server"},
            "tracking": {"experiment": "team-server", "split_map_images": 2, "tracking_uri": tracking_uri},
        }
    )
    result = run_training(config)
    assert result.status == "completed" and result.mlflow_run_id
    assert password not in (result.tracking_uri or "")

    # read back through the MLflow client, logged in the documented way
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    client = MlflowClient(tracking_uri=team_server["url"])
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert {"accuracy", "tokens_per_image", "token_ratio", "final_accuracy"} <= set(run.data.metrics)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "tokens_per_image")] == [0, 1]
    assert run.data.params["model.levels"] == "2"
    assert not any(password in v for v in [*run.data.params.values(), *run.data.tags.values()]), (
        "no password in the store"
    )
    split_maps = [a.path for a in client.list_artifacts(run.info.run_id, "split_maps")]
    assert split_maps and all(p.endswith(".png") for p in split_maps)
    png = Path(client.download_artifacts(run.info.run_id, split_maps[-1], str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the backend store is PostgreSQL ...
    pg = team_server["postgres"]
    conn = psycopg2.connect(host="127.0.0.1", port=pg["port"], user="mlflow", password=pg["password"], dbname="mlflow")
    with conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_uuid = %s", (run.info.run_id,))
        assert cur.fetchone() == ("FINISHED",)
        cur.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'accuracy'", (run.info.run_id,))
        assert cur.fetchone()[0] == 2
    conn.close()
    # ... and the artifacts (run files and the logged model) are objects in the bucket
    s3 = boto3.client("s3", endpoint_url=team_server["endpoint"], region_name="us-east-1")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=team_server["bucket"])
        for o in page.get("Contents", [])
    ]
    assert any(k.endswith(f"{run.info.run_id}/artifacts/config.json") for k in keys), keys[:20]
    assert any(f"{run.info.run_id}/artifacts/split_maps/" in k for k in keys)
    model_id = result.mlflow_model_uri.split("/")[-1]
    assert any(f"/models/{model_id}/artifacts/" in k for k in keys)
