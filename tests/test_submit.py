"""`splitvit submit` and the local stack (`splitvit stack up/down`).

The first half needs no cluster: argument handling, the runtime environment, address
resolution, a bad address. The second half brings up a real local stack (a Ray head
with its own temp folder and free ports, so it never meets the session's shared Ray
instance, and an MLflow server), submits a tiny training job and a failing one, and
stops the stack.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from splitvit.cli import main  # noqa: E402
from splitvit.cluster import stack  # noqa: E402
from splitvit.cluster.submit import (  # noqa: E402
    EXCLUDES,
    ClusterUnreachable,
    build_entrypoint,
    build_runtime_env,
    resolve_target,
    split_submit_options,
    with_stack_storage,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "jobs/configs/smoke.yaml"
# smoke.yaml shrunk to seconds: 16x16 images, two levels (the library's plain settings), one block,
# two epochs, one worker
TINY = [
    "recipe=none",
    "model.timm_kwargs.embed_dim=16",
    "model.timm_kwargs.depth=1",
    "model.timm_kwargs.num_heads=1",
    "model.image_size=16",
    "model.levels=2",
    "model.policy.depth=1",
    "data.options.train_samples=64",
    "data.options.val_samples=32",
    "data.options.object_size=4",
    "data.batch_size=16",
    "train.epochs=2",
    "tracking.split_map_images=2",
    "scaling.num_workers=1",
    # the logged model's upload is covered against the team server (test_mlflow_server.py)
    "tracking.log_model=false",
]


@pytest.fixture
def no_cluster_env(monkeypatch, tmp_path):
    """No address from the environment, and an empty stack folder."""
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "no-stack"))
    return tmp_path / "no-stack"


# ---------------------------------------------------------------------- no cluster
def test_submit_options_after_the_job_arguments_are_submits():
    options, rest = split_submit_options(
        [
            SMOKE,
            "train.epochs=1",
            "--address",
            "http://h:8265",
            "--env",
            "A=1",
            "--env=B",
            "--json",
            "out.json",
            "--no-wait",
            "--",
            "--address",
            "for-the-job",
        ]
    )
    assert options == {"address": "http://h:8265", "env": ["A=1", "B"], "no_wait": True}
    assert rest == [SMOKE, "train.epochs=1", "--json", "out.json", "--address", "for-the-job"]
    with pytest.raises(ValueError, match="--address needs a value"):
        split_submit_options(["cfg.yaml", "--address"])


def test_entrypoint_quotes_arguments_and_needs_the_script(tmp_path):
    assert (
        build_entrypoint("train", [SMOKE, "storage.name=a b"], ROOT)
        == f"python jobs/train.py {SMOKE} 'storage.name=a b'"
    )
    assert build_entrypoint("eval", ["s3://b/ck", "--thresholds", "0.4,0.6"], ROOT).startswith(
        "python jobs/evaluate.py "
    )
    assert build_entrypoint("sweep", ["search_spaces/smoke.yaml"], ROOT).startswith("python jobs/sweep.py ")
    with pytest.raises(FileNotFoundError, match="jobs/train.py not found"):
        build_entrypoint("train", [SMOKE], tmp_path)
    with pytest.raises(ValueError, match="unknown job"):
        build_entrypoint("bench", [], ROOT)


def test_runtime_env_ships_the_checkout_and_the_package(tmp_path):
    """Ray accepts it, and the working dir Ray would upload has the jobs and configs but
    not the virtualenv, runs, checkpoints or .git."""
    from ray._private.runtime_env.packaging import create_package
    from ray.runtime_env import RuntimeEnv

    env = build_runtime_env(ROOT, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, ["einops"])
    RuntimeEnv(**env)
    assert env["working_dir"] == str(ROOT)
    assert env["py_modules"] == [str(ROOT / "platform" / "splitvit")]
    assert env["env_vars"] == {"MLFLOW_TRACKING_URI": "http://mlflow:5000"} and env["pip"] == ["einops"]
    runs = ROOT / "runs"  # ignored by git; a checkpoint there must not travel
    created = not runs.exists()
    runs.mkdir(exist_ok=True)
    marker = runs / f"checkpoint-{os.getpid()}.pt"
    marker.write_bytes(b"x")
    try:
        zip_path = tmp_path / "pkg.zip"
        # include_gitignore=False: the excludes alone must keep these out
        create_package(str(ROOT), zip_path, include_gitignore=False, excludes=env["excludes"])
        import zipfile

        names = zipfile.ZipFile(zip_path).namelist()
    finally:
        marker.unlink()
        if created:
            runs.rmdir()
    assert "jobs/train.py" in names and SMOKE in names and "platform/splitvit/__init__.py" in names
    for banned in (".venv/", ".git/", "runs/"):
        assert not any(n.startswith(banned) for n in names), banned
    assert not any(n.endswith(".pt") for n in names)
    assert "/.venv" in EXCLUDES
    with pytest.raises(FileNotFoundError, match="not a splitvit checkout"):
        build_runtime_env(tmp_path)


def test_relative_storage_goes_to_the_stacks_runs_folder(tmp_path):
    runs = str(tmp_path / "runs")
    # smoke.yaml says `storage.path: runs`: the override goes before the job's options
    assert with_stack_storage("train", [SMOKE, "train.epochs=1", "--json", "x.json"], runs, ROOT) == [
        SMOKE,
        "train.epochs=1",
        f"storage.path={runs}",
        "--json",
        "x.json",
    ]
    assert with_stack_storage("train", [SMOKE, "storage.path=s3://b/p"], runs, ROOT) == [SMOKE, "storage.path=s3://b/p"]
    assert with_stack_storage("eval", ["ck"], runs, ROOT) == ["ck"]
    assert with_stack_storage("train", [SMOKE], None, ROOT) == [SMOKE]
    absolute = tmp_path / "abs.yaml"
    absolute.write_text("storage: {path: /data/runs}\n")
    assert with_stack_storage("train", [str(absolute)], runs, ROOT) == [str(absolute)]
    # a sweep's storage comes from its space's base config (a path relative to the space)
    assert with_stack_storage("sweep", ["search_spaces/smoke.yaml", "--name", "s"], runs, ROOT) == [
        "search_spaces/smoke.yaml",
        "--name",
        "s",
        "--set",
        f"storage.path={runs}",
    ]
    space = tmp_path / "space.yaml"
    space.write_text(f"base: {ROOT / SMOKE}\nparameters: {{}}\n")
    assert with_stack_storage("sweep", [str(space)], runs, ROOT) == [str(space), "--set", f"storage.path={runs}"]
    space.write_text("base: abs.yaml\nparameters: {}\n")
    assert with_stack_storage("sweep", [str(space)], runs, ROOT) == [str(space)]


def test_address_comes_from_the_flag_the_environment_or_the_stack(monkeypatch, no_cluster_env):
    with pytest.raises(ClusterUnreachable, match="no Ray cluster to submit to"):
        resolve_target(None)
    folder = no_cluster_env
    folder.mkdir()
    (folder / stack.TOKEN_FILE).write_text("t0ken")
    state = stack.StackState(
        stack_id="x",
        host="127.0.0.1",
        dashboard_url="http://127.0.0.1:18265",
        gcs_address="127.0.0.1:16379",
        mlflow_url="http://127.0.0.1:15000",
        agent_port=1,
        ray_temp_dir=str(folder / "ray"),
        auth_token_path=str(folder / stack.TOKEN_FILE),
        backend_store_uri="sqlite:///x",
        artifacts_destination="a",
        storage_path=str(folder / "runs"),
        mlflow_pid=0,
        ray_start_pid=0,
        logs_dir="l",
        python="p",
        started_at=0.0,
    )
    from dataclasses import asdict

    (folder / stack.STATE_FILE).write_text(json.dumps(asdict(state)))
    target = resolve_target(None)
    assert target.address == "http://127.0.0.1:18265" and target.source.startswith("the local stack")
    assert target.headers == {"authorization": "Bearer t0ken"}
    assert target.tracking_uri == "http://127.0.0.1:15000" and target.storage_path == str(folder / "runs")
    monkeypatch.setenv("RAY_ADDRESS", "http://other:8265")
    assert resolve_target(None).address == "http://other:8265" and resolve_target(None).headers == {}
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://api:8265/")
    assert resolve_target(None).address == "http://api:8265"
    assert resolve_target("http://flag:8265").address == "http://flag:8265"
    # the stack's own address, however given, still gets its token
    assert resolve_target("http://localhost:18265").headers == {"authorization": "Bearer t0ken"}


def test_bad_address_gives_a_clear_error(capsys, no_cluster_env):
    port = stack.free_port()
    code = main(["submit", "train", SMOKE, "train.epochs=1", "--address", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot reach the Ray job server at http://127.0.0.1:{port}" in err
    assert "ConnectionError" in err
    # no address anywhere
    assert main(["submit", "train", SMOKE]) == 2
    assert "no Ray cluster to submit to" in capsys.readouterr().err


def test_an_address_that_is_not_a_ray_job_server(capsys, no_cluster_env):
    class NotRay(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"nothing here")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotRay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["submit", "--address", address, "eval", "ck"]) == 2
        assert f"{address} answers, but not as a Ray job server (GET /api/version: HTTP 404)" in capsys.readouterr().err
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- the local stack
@pytest.fixture(scope="module")
def local_stack():
    """A local stack on free ports in a short temp folder (Ray's socket paths are
    length-limited), stopped at the end of the module if a test did not stop it."""
    folder = Path(tempfile.mkdtemp(prefix="svstack-"))
    settings = stack.StackSettings(
        state_dir=folder,
        dashboard_port=stack.free_port(),
        mlflow_port=stack.free_port(),
        ray_port=stack.free_port(),
        num_cpus=4,
        mlflow_workers=1,
        timeout_s=240,
    )
    started = time.monotonic()
    status = stack.up(settings)
    status.startup_s = time.monotonic() - started
    try:
        yield status
    finally:
        stack.down(folder, grace_s=5)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def on_stack(local_stack, monkeypatch):
    """Point `splitvit submit` at the module's stack, nothing else."""
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(stack.STATE_DIR_ENV, local_stack.state_dir)
    return local_stack


def test_stack_comes_up_healthy_on_loopback_only(local_stack):
    from splitvit.cluster.stack import _psutil

    assert local_stack.healthy, [c.detail for c in local_stack.components]
    assert {c.name for c in local_stack.components} == {"ray-dashboard", "ray-job-server", "ray-job-agent", "mlflow"}
    state = local_stack.state
    folder = Path(local_stack.state_dir)
    assert stack.load_state(folder) == state
    env_file = (folder / stack.ENV_FILE).read_text()
    assert f"export RAY_API_SERVER_ADDRESS={state.dashboard_url}" in env_file
    assert f"export MLFLOW_TRACKING_URI={state.mlflow_url}" in env_file
    assert oct((folder / stack.TOKEN_FILE).stat().st_mode & 0o777) == "0o600"
    # the job server wants the token
    code, _ = stack.http_get(f"{state.dashboard_url}/api/version")
    assert code == 401
    # every socket any stack process listens on is a loopback one
    psutil = _psutil()
    pids = {p.pid for p in stack.marked_processes(state.stack_id, cmdline_markers=[state.ray_temp_dir])}
    listening = [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 4
    assert all(c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for c in listening), [
        (c.laddr, psutil.Process(c.pid).name()) for c in listening if not c.laddr.ip.endswith("127.0.0.1")
    ]
    # a second `up` finds it healthy and starts nothing
    again = stack.up(stack.StackSettings(state_dir=folder))
    assert again.already_running and again.state.stack_id == state.stack_id
    print(f"stack up in {local_stack.startup_s:.1f}s")


def test_training_job_submitted_to_the_stack_lands_in_its_mlflow(on_stack, tmp_path, capsys):
    from mlflow import MlflowClient

    state = on_stack.state
    out = tmp_path / "submit.json"
    job_json = tmp_path / "train.json"
    code = main(
        [
            "submit",
            "--json",
            str(out),
            "train",
            SMOKE,
            *TINY,
            "storage.name=stack-smoke",
            "tracking.experiment=stack-test",
            "--json",
            str(job_json),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["job_status"] == "SUCCEEDED" and result["job_id"] in captured.out
    assert f"job {result['job_id']} SUCCEEDED" in captured.out
    assert "epoch 1" in captured.out, "the job's log was followed"
    # the job ran with the stack's MLflow and runs folder, and its own --json
    assert result["tracking_uri"] == state.mlflow_url
    assert f"storage.path={state.storage_path}" in result["entrypoint"]
    trained = json.loads(job_json.read_text())
    assert trained["status"] == "ok" and trained["run_status"] == "completed"
    assert Path(trained["checkpoint_uri"]).parent == Path(state.storage_path) / "stack-smoke"
    # the run, read back from the MLflow server
    client = MlflowClient(tracking_uri=state.mlflow_url)
    experiment = client.get_experiment_by_name("stack-test")
    run = client.get_run(trained["mlflow_run_id"])
    assert run.info.experiment_id == experiment.experiment_id and run.info.status == "FINISHED"
    assert {"accuracy", "tokens_per_image", "token_ratio"} <= set(run.data.metrics)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accuracy")] == [0, 1]
    assert run.data.params["train.epochs"] == "2"
    # provenance: the job's copy has no .git, so submit passed the checkout's commit along
    from splitvit import __version__
    from splitvit.tracking.provenance import git_state

    commit, dirty = git_state(str(Path(__file__).resolve().parents[1]))
    assert run.data.tags["mlflow.source.git.commit"] == commit
    assert run.data.tags["splitvit.git_dirty"] == str(dirty).lower()
    assert run.data.tags["splitvit.version"] == __version__ and run.data.tags["mlflow.user"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "split_maps"} <= artifacts
    # artifacts went through the server into its destination folder
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    stored = list(Path(state.artifacts_destination).rglob("config.json"))
    assert any(run.info.run_id in str(p) for p in stored)


def test_failing_job_reports_its_id_and_log_tail(on_stack, tmp_path, capsys):
    out = tmp_path / "submit.json"
    code = main(["submit", "train", SMOKE, "train.epochs=0", "--json", str(out), "--log-lines", "15"])
    assert code == 1
    err = capsys.readouterr().err
    # --json came after the job's arguments, so it went to the job (on this machine),
    # whose config error still wrote the envelope
    written = json.loads(out.read_text())
    assert written["command"] == "train" and written["status"] == "failed"
    assert "train.epochs: must be >= 1, got 0" in written["error"]
    lines = err.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("splitvit submit: error:")]
    assert len(errors) == 1, err
    first = lines[errors[0]]
    assert first.startswith("splitvit submit: error: job raysubmit_") and " FAILED on " in first
    job_id = first.split("job ", 1)[1].split()[0]
    # the error line comes first, the job's log tail after it
    assert any("lines of its log:" in line for line in lines[errors[0] :]), err
    assert "config error: train.epochs: must be >= 1, got 0" in err
    assert f"ray job logs {job_id} --address {on_stack.state.dashboard_url}" in err


def test_runtime_env_puts_the_submitted_package_first_on_driver_and_workers(on_stack):
    """The driver and a Ray worker of a job import `splitvit` from the uploaded
    py_modules copy, not from an installation on the node."""
    from splitvit.cluster.submit import connect, follow

    target = resolve_target(None)
    client = connect(target)
    script = (
        "import ray, splitvit; ray.init(); "
        "f = ray.remote(lambda: __import__('splitvit').__file__); "
        "print('DRIVER', splitvit.__file__); print('WORKER', ray.get(f.remote()))"
    )
    job_id = client.submit_job(entrypoint=f'python -c "{script}"', runtime_env=build_runtime_env(ROOT))
    info = follow(client, job_id, None, poll_s=0.5)
    logs = client.get_job_logs(job_id)
    assert str(info.status) == "SUCCEEDED", logs[-2000:]
    paths = dict(line.split(" ", 1) for line in logs.splitlines() if line.startswith(("DRIVER ", "WORKER ")))
    resources = str(Path(on_stack.state.ray_temp_dir))
    for who in ("DRIVER", "WORKER"):
        assert paths[who].startswith(resources) and "py_modules" in paths[who], (who, paths[who])
        assert not paths[who].startswith(str(ROOT))


def test_stack_stops_cleanly(local_stack):
    state = local_stack.state
    folder = Path(local_stack.state_dir)
    report = stack.down(folder, grace_s=5)
    assert report.was_running and report.clean and report.stopped + report.killed > 0
    assert stack.marked_processes(state.stack_id, cmdline_markers=[state.ray_temp_dir]) == []
    for url in (state.dashboard_url, state.mlflow_url):
        assert not stack.port_is_listening(int(url.rsplit(":", 1)[1]))
    assert not (folder / stack.STATE_FILE).exists() and not (folder / stack.ENV_FILE).exists()
    assert (folder / "mlflow.db").exists(), "data stays"
    assert not stack.status(folder).running
    assert not stack.down(folder).was_running


class FakeJobs:
    """A job server that answers from a script of final job states (no Ray needed)."""

    def __init__(self, outcomes: list[tuple[str, str]], logs: str = "") -> None:
        from types import SimpleNamespace

        self.outcomes = [SimpleNamespace(status=s, message=m) for s, m in outcomes]
        self.submitted: list[dict] = []
        self.logs = logs

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return f"raysubmit_{len(self.submitted)}"

    async def tail_job_logs(self, job_id):
        yield f"log of {job_id}\n"

    def get_job_info(self, job_id):
        return self.outcomes[int(job_id.rsplit("_", 1)[1]) - 1]

    def get_job_logs(self, job_id):
        return self.logs


def test_a_package_ray_lost_is_submitted_again_once(monkeypatch, no_cluster_env):
    """Ray's SDK does not pin a package it did not upload; when Ray deletes it before the
    job starts, the job is submitted again (which uploads it); other failures are not."""
    import splitvit.cluster.submit as submit

    gone = (
        "runtime_env setup failed: Failed to set up runtime environment.\n"
        "Failed to download runtime_env file package gcs://_ray_pkg_abc.zip from the GCS to the Ray worker node."
    )
    fake = FakeJobs([("FAILED", gone), ("SUCCEEDED", "")])
    monkeypatch.setattr(submit, "connect", lambda target: fake)
    chunks: list[str] = []
    result = submit.run_job("train", [SMOKE], address="http://jobs:8265", working_dir=ROOT, sink=chunks.append)
    assert result.status == "SUCCEEDED" and result.job_id == "raysubmit_2" and len(fake.submitted) == 2
    assert chunks == ["log of raysubmit_1\n", "log of raysubmit_2\n"]

    # twice lost: the error carries Ray's whole message, since the job has no log
    fake = FakeJobs([("FAILED", gone), ("FAILED", gone)])
    monkeypatch.setattr(submit, "connect", lambda target: fake)
    with pytest.raises(submit.JobFailed) as failed:
        submit.run_job("train", [SMOKE], address="http://jobs:8265", working_dir=ROOT, submission_id="mine")
    assert [s["submission_id"] for s in fake.submitted] == ["mine", "mine-2"]
    text = str(failed.value)
    assert text.startswith("job raysubmit_2 FAILED on http://jobs:8265: runtime_env setup failed")
    assert "gcs://_ray_pkg_abc.zip" in text and "its log is empty" in text

    # an entrypoint failure is the job's own: no second try, Ray's copy of the log is cut
    fake = FakeJobs(
        [
            (
                "FAILED",
                "Job entrypoint command failed with exit code 2, last available logs (truncated "
                "to 20,000 chars):\nboom",
            )
        ],
        logs="line 1\nconfig error: boom\n",
    )
    monkeypatch.setattr(submit, "connect", lambda target: fake)
    with pytest.raises(submit.JobFailed) as failed:
        submit.run_job("train", [SMOKE], address="http://jobs:8265", working_dir=ROOT, log_lines=1)
    assert len(fake.submitted) == 1
    assert failed.value.result.message == "Job entrypoint command failed with exit code 2"
    assert failed.value.result.log_tail == "config error: boom"


def test_stack_finds_psutil_in_a_fresh_process():
    """psutil comes with Ray (its thirdparty_files): in a process that has not imported
    Ray yet, as `splitvit stack` is, the stack still finds it."""
    code = "from splitvit.cluster.stack import _psutil; print(_psutil().pid_exists(1))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
