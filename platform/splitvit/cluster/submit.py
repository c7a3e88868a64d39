"""Submit ``train``, ``sweep`` and ``eval`` as Ray jobs and follow them.

``splitvit submit train jobs/configs/smoke.yaml train.epochs=1 --address http://HEAD:8265``
does what ``ray job submit --working-dir . -- python jobs/train.py ...`` does, through
Ray's ``JobSubmissionClient``: it uploads the working directory, runs the job's entry
point (``jobs/train.py``, ``jobs/sweep.py`` or ``jobs/evaluate.py``) on the cluster,
streams the driver's log and returns the job's final status.

The runtime environment is right both here and on a real cluster:

* ``working_dir``: the checkout (``jobs/``, configs, search spaces), without the
  virtualenv, runs, checkpoints and ``.git`` (Ray also honours ``.gitignore``);
* ``py_modules``: the ``splitvit`` package from that checkout. Ray puts it first on
  the ``PYTHONPATH`` of the job's driver *and of every worker it starts*, so the
  code that runs is the code submitted, whether or not (and whichever version of)
  ``splitvit`` is installed on the nodes. A worker needs it: Ray Train pickles the
  training loop by reference to ``splitvit.train``;
* the third-party dependencies (torch, timm, mlflow...) come from the nodes' Python
  (the image built from ``infra/docker/Dockerfile``, or this virtualenv for the
  local stack); ``pip=[...]`` adds packages per job;
* ``env_vars``: ``MLFLOW_TRACKING_URI`` so every process of the job logs to the same
  MLflow server, plus whatever ``env`` adds.

Address resolution: ``address`` argument, else ``$RAY_API_SERVER_ADDRESS``, else
``$RAY_ADDRESS``, else the local stack's dashboard (``splitvit stack up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..jsontypes import JsonObject

log = logging.getLogger(__name__)

#: ``splitvit submit ENTRY`` -> the script it runs, relative to the working dir.
ENTRYPOINTS = {"train": "jobs/train.py", "sweep": "jobs/sweep.py", "eval": "jobs/evaluate.py"}
#: What never goes into the uploaded working dir (anchored patterns: the checkout's root).
EXCLUDES = [
    "/.git",
    "/.venv",
    "/venv",
    "/runs",
    "/mlruns",
    "/mlartifacts",
    "/mlflow.db",
    "/.splitvit",
    ".pytest_cache",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.safetensors",
]
PACKAGE_DIR = "platform/splitvit"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
#: Options of ``splitvit submit`` that may also follow the job's arguments: name -> takes a value.
SUBMIT_OPTIONS = {
    "--address": True,
    "--working-dir": True,
    "--env": True,
    "--pip": True,
    "--tracking-uri": True,
    "--submission-id": True,
    "--log-lines": True,
    "--no-wait": False,
}
REPEATABLE = ("--env", "--pip")


class SubmitError(RuntimeError):
    """Submitting or following a job failed. ``job_id`` is set once the job exists."""

    def __init__(self, message: str, *, job_id: str | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.address = address


class ClusterUnreachable(SubmitError):
    """Nothing (or no Ray job server) answers at the address."""


class JobFailed(SubmitError):
    """The job ended ``FAILED`` or ``STOPPED``; ``result`` has its status, message and log tail."""

    def __init__(self, result: JobResult) -> None:
        lines = [
            f"job {result.job_id} {result.status} on {result.address}"
            + (f": {result.message}" if result.message else "")
        ]
        if result.log_tail:
            lines.append(f"last {len(result.log_tail.splitlines())} lines of its log:")
            lines.extend(f"  | {line}" for line in result.log_tail.splitlines())
        else:
            lines.append("its log is empty")
        lines.append(f"whole log: ray job logs {result.job_id} --address {result.address}")
        super().__init__("\n".join(lines), job_id=result.job_id, address=result.address)
        self.result = result

    def __reduce__(self):  # rebuild from the result (pickling, e.g. through Ray)
        return (type(self), (self.result,), dict(self.__dict__))


@dataclass
class JobTarget:
    """Where a job goes: the address, how it was found, and the headers it needs."""

    address: str
    source: str
    headers: dict[str, str] = field(default_factory=dict)
    tracking_uri: str | None = None
    storage_path: str | None = None


@dataclass
class JobResult:
    """A submitted job's outcome (``splitvit submit --json`` writes it)."""

    job_id: str
    address: str
    entrypoint: str
    status: str
    message: str = ""
    tracking_uri: str | None = None
    log_tail: str = ""
    duration_s: float = 0.0
    runtime_env: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> JsonObject:
        """Plain dict for JSON (environment values that look secret are masked)."""
        from ..config import redact_secrets, redact_uri

        out = asdict(self)
        out["runtime_env"] = redact_secrets(self.runtime_env)
        out["tracking_uri"] = redact_uri(self.tracking_uri) if self.tracking_uri else None
        return out


# ---------------------------------------------------------------------- arguments
def split_submit_options(tokens: list[str]) -> tuple[dict[str, str | bool | list[str]], list[str]]:
    """Separate ``splitvit submit`` options that follow the job's arguments.

    ``["cfg.yaml", "train.epochs=1", "--address", "http://h:8265", "--json", "x"]`` ->
    ``({"address": "http://h:8265"}, ["cfg.yaml", "train.epochs=1", "--json", "x"])``.
    Only the names in :data:`SUBMIT_OPTIONS` are taken (``--json`` stays with the
    job: before the entry it is submit's own); ``--`` ends the search.
    """
    options: dict[str, str | bool | list[str]] = {}  # a flag's True, an option's value, a repeated one's values
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            rest.extend(tokens[i + 1 :])
            break
        name, eq, inline = token.partition("=")
        if name in SUBMIT_OPTIONS:
            key = name.lstrip("-").replace("-", "_")
            if SUBMIT_OPTIONS[name]:
                if eq:
                    value = inline
                elif i + 1 < len(tokens):
                    i += 1
                    value = tokens[i]
                else:
                    raise ValueError(f"{name} needs a value")
                if name in REPEATABLE:
                    options.setdefault(key, []).append(value)
                else:
                    options[key] = value
            else:
                options[key] = True
        else:
            rest.append(token)
        i += 1
    return options, rest


def parse_env(items: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """``["A=1", "B"]`` -> ``{"A": "1", "B": <B from this environment>}``."""
    environ = os.environ if environ is None else environ
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key:
            raise ValueError(f"--env: expected KEY=VALUE or KEY, got {item!r}")
        if not eq:
            if key not in environ:
                raise ValueError(f"--env {key}: not set in this environment (use {key}=VALUE)")
            value = environ[key]
        out[key] = value
    return out


def build_entrypoint(entry: str, args: list[str], working_dir: Path | str = ".") -> str:
    """The job's shell command, e.g. ``python jobs/train.py jobs/configs/smoke.yaml train.epochs=1``.

    Raises ``ValueError`` for an unknown entry and ``FileNotFoundError`` when the
    working dir has no such script.
    """
    if entry not in ENTRYPOINTS:
        raise ValueError(f"unknown job {entry!r}; expected one of {', '.join(ENTRYPOINTS)}")
    script = ENTRYPOINTS[entry]
    if not (Path(working_dir) / script).is_file():
        raise FileNotFoundError(
            f"{script} not found in the working dir {Path(working_dir).resolve()}; "
            "submit from the root of a splitvit checkout or pass --working-dir"
        )
    return shlex.join(["python", script, *args])


def build_runtime_env(
    working_dir: Path | str, env_vars: dict[str, str] | None = None, pip: list[str] | None = None
) -> dict[str, Any]:
    """The job's runtime environment (see the module docstring for why each part)."""
    root = Path(working_dir).expanduser().resolve()
    package = root / PACKAGE_DIR
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"{root} is not a splitvit checkout ({PACKAGE_DIR}/__init__.py is missing)")
    runtime_env: dict[str, Any] = {
        "working_dir": str(root),
        "py_modules": [str(package)],
        "excludes": list(EXCLUDES),
    }
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    if pip:
        runtime_env["pip"] = list(pip)
    return runtime_env


def _config_storage_path(config: Path) -> str | None:
    """``storage.path`` of an experiment YAML as written (default ``runs``); None if unreadable."""
    import yaml

    try:
        raw = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None  # the job reports the problem itself
    storage = raw.get("storage") if isinstance(raw, dict) else None
    if storage is None:
        return "runs"
    return str(storage.get("path") or "runs") if isinstance(storage, dict) else None


def _written_storage_path(entry: str, first: Path) -> str | None:
    """The storage path a ``train`` config or a ``sweep`` space (through its ``base``) sets."""
    if first.suffix not in (".yaml", ".yml") or not first.is_file():
        return None
    if entry == "train":
        return _config_storage_path(first)
    import yaml

    try:
        space = yaml.safe_load(first.read_text()) or {}
    except yaml.YAMLError:
        return None
    if not isinstance(space, dict):
        return None
    fixed = (space.get("parameters") or {}).get("storage.path")
    if fixed is not None:
        return str(fixed)
    base = space.get("base")
    return _config_storage_path(first.parent / base) if isinstance(base, str) else "runs"


def with_stack_storage(
    entry: str, args: list[str], storage_path: str | None, working_dir: Path | str = "."
) -> list[str]:
    """For ``train`` and ``sweep`` on the local stack: point a relative ``storage.path``
    at the stack's runs folder.

    A job runs in a temporary copy of its working dir, so a relative storage path
    (the configs' default ``runs``) would leave checkpoints where Ray later deletes
    them. An absolute path, an ``s3://`` URI or an explicit ``storage.path=`` override
    is left alone.
    """
    if entry not in ("train", "sweep") or not storage_path or not args or any("storage.path=" in a for a in args):
        return args
    first = Path(args[0]) if Path(args[0]).is_absolute() else Path(working_dir) / args[0]
    path = _written_storage_path(entry, first)
    if path is None or ("://" in path and not path.startswith("file://")) or Path(path).expanduser().is_absolute():
        return args
    log.info("storage.path %r is relative; the job writes to the stack's runs folder %s", path, storage_path)
    override = f"storage.path={storage_path}"
    if entry == "sweep":
        return [*args, "--set", override]
    # `splitvit train CONFIG [KEY=VALUE ...] [--options]`: overrides go before the first option
    at = next((i for i, a in enumerate(args) if i > 0 and a.startswith("-")), len(args))
    return [*args[:at], override, *args[at:]]


# ---------------------------------------------------------------------- address
def resolve_target(address: str | None = None, *, state_dir: Path | str | None = None) -> JobTarget:
    """Find the job server: ``address``, ``$RAY_API_SERVER_ADDRESS``, ``$RAY_ADDRESS``,
    or the local stack. A target that is the local stack gets its token and MLflow URL.

    Raises :class:`ClusterUnreachable` when there is none.
    """
    from . import stack

    state = None
    try:
        state = stack.load_state(state_dir)
    except stack.StackError as exc:
        log.warning("%s", exc)
    source = "--address"
    if not address:
        for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            if os.environ.get(var):
                address, source = os.environ[var], f"${var}"
                break
    if not address and state is not None:
        address, source = (
            state.dashboard_url,
            f"the local stack ({stack.default_state_dir() if state_dir is None else state_dir})",
        )
    if not address:
        raise ClusterUnreachable(
            "no Ray cluster to submit to: pass --address http://HEAD:8265, set RAY_ADDRESS, "
            "or start the local stack with `splitvit stack up`"
        )
    address = address.rstrip("/")
    target = JobTarget(address=address, source=source)
    if state is not None and _same_server(address, state.dashboard_url):
        with contextlib.suppress(OSError):
            target.headers = state.auth_headers()
        target.tracking_uri = state.mlflow_url
        target.storage_path = state.storage_path
    return target


def _same_server(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        url = url if "://" in url else f"http://{url}"
        return url.replace("://localhost:", "://127.0.0.1:").rstrip("/")

    return norm(a) == norm(b)


@contextlib.contextmanager
def _explicit_address() -> Iterator[None]:
    """Ray's client lets ``$RAY_API_SERVER_ADDRESS``/``$RAY_ADDRESS`` override the address
    it is given; the address we resolved already took them into account."""
    saved = {k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def connect(target: JobTarget, timeout_s: float = 15.0):
    """A ``JobSubmissionClient`` for ``target``, after a bounded reachability check.

    Raises :class:`ClusterUnreachable` with the reason (nothing listens, not a Ray
    job server, token missing or refused).
    """
    from ray.job_submission import JobSubmissionClient

    address = target.address
    if address.startswith(("http://", "https://")):
        import requests

        try:
            response = requests.get(f"{address}/api/version", headers=target.headers, timeout=timeout_s)
        except requests.RequestException as exc:
            raise ClusterUnreachable(
                f"cannot reach the Ray job server at {address} (from {target.source}): "
                f"{_reason(exc)}. Is the cluster up (`splitvit stack status`, `ray status`) and "
                "is this the dashboard's address (http://HEAD:8265)?",
                address=address,
            ) from None
        if response.status_code in (401, 403):
            raise ClusterUnreachable(
                f"the Ray job server at {address} refused us (HTTP {response.status_code}): "
                "it needs Ray's auth token; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
                "RAY_AUTH_TOKEN_PATH)",
                address=address,
            )
        if response.status_code != 200 or "ray_version" not in response.text:
            raise ClusterUnreachable(
                f"{address} answers, but not as a Ray job server (GET /api/version: HTTP {response.status_code})",
                address=address,
            )
    try:
        with _explicit_address():
            return JobSubmissionClient(address, headers=dict(target.headers) or None)
    except Exception as exc:  # ConnectionError, AuthenticationError, RuntimeError, ValueError...
        raise ClusterUnreachable(
            f"cannot connect to the Ray cluster at {address} (from {target.source}): {_reason(exc)}", address=address
        ) from None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------------- following
def log_tail(client, job_id: str, lines: int = 40) -> str:
    """The last ``lines`` lines of a job's driver log ('' when it cannot be read)."""
    try:
        text = client.get_job_logs(job_id)
    except Exception as exc:  # the log is a courtesy in an error message; never mask the error
        log.warning("could not read the log of job %s: %s", job_id, exc)
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:]) if lines > 0 else ""


def _short_message(message: str | None, max_lines: int = 30) -> str:
    """Ray's failure message without the copy of the driver's log it appends to an
    entrypoint failure. Other failures (runtime env setup, scheduling) keep their
    detail: the driver never ran, so there is no log to show instead."""
    if not message:
        return ""
    text = message.strip()
    if ", last available logs" in text:
        return text.split(", last available logs", 1)[0].rstrip(":, ")
    lines = text.splitlines()
    return "\n".join(lines[:max_lines] + (["..."] if len(lines) > max_lines else []))


#: Ray's job SDK skips the upload of a package the cluster already holds without
#: pinning it, so a package shared with a job that just ended can be deleted before
#: this job's runtime env fetches it. Ray's advice is to submit again (which uploads).
_PACKAGE_GONE = "Failed to download runtime_env file package"


def follow(
    client, job_id: str, sink: Callable[[str], None] | None, *, poll_s: float = 2.0, lost_after_s: float = 120.0
) -> Any:
    """Stream a job's log to ``sink`` until the job ends; return its ``JobDetails``.

    ``sink=None`` only waits. If the log stream breaks, the job's status is polled
    instead; :class:`SubmitError` when the job server stays unreachable for
    ``lost_after_s`` seconds (the job itself may still be running).
    """
    if sink is not None:

        async def stream() -> None:
            async for chunk in client.tail_job_logs(job_id):
                sink(chunk)

        try:
            asyncio.run(stream())
        except Exception as exc:  # the websocket broke; the job may well go on
            log.warning("log stream of job %s broke (%s); polling its status", job_id, _reason(exc))
    last_ok = time.monotonic()
    while True:
        try:
            info = client.get_job_info(job_id)
            last_ok = time.monotonic()
            if _status(info.status) in TERMINAL:
                return info
        except Exception as exc:
            if time.monotonic() - last_ok > lost_after_s:
                raise SubmitError(
                    f"lost the Ray job server while following job {job_id} ({_reason(exc)}); "
                    f"the job may still be running: ray job status {job_id}",
                    job_id=job_id,
                ) from None
        time.sleep(poll_s)


def _status(value: Any) -> str:
    return str(getattr(value, "value", value))


# ---------------------------------------------------------------------- submit
def run_job(
    entry: str,
    args: list[str],
    *,
    address: str | None = None,
    working_dir: Path | str = ".",
    env: dict[str, str] | None = None,
    pip: list[str] | None = None,
    tracking_uri: str | None = None,
    submission_id: str | None = None,
    wait: bool = True,
    sink: Callable[[str], None] | None = None,
    log_lines: int = 40,
    state_dir: Path | str | None = None,
    on_submitted: Callable[[str, str], None] | None = None,
) -> JobResult:
    """Submit ``entry`` (``train``, ``sweep`` or ``eval``) with ``args``; with ``wait``,
    follow it to the end, streaming its log to ``sink``.

    ``tracking_uri`` defaults to ``$MLFLOW_TRACKING_URI``, else the local stack's
    MLflow server when the job goes to the stack. ``on_submitted(job_id, address)`` is
    called as soon as the job exists.

    Raises:
        ClusterUnreachable: no job server at the address.
        JobFailed: the job ended FAILED or STOPPED (message: job id, status, log tail).
        SubmitError: anything else that went wrong after submission (job id set).
    """
    working_dir = Path(working_dir).expanduser().resolve()
    target = resolve_target(address, state_dir=state_dir)
    args = with_stack_storage(entry, list(args), target.storage_path, working_dir)
    entrypoint = build_entrypoint(entry, args, working_dir)
    from ..tracking.provenance import git_env

    # the job's copy of working_dir has no .git: its runs learn their commit from here
    env_vars = {**git_env(working_dir), **(env or {})}
    tracking_uri = (
        tracking_uri
        or env_vars.get("MLFLOW_TRACKING_URI")
        or os.environ.get("MLFLOW_TRACKING_URI")
        or target.tracking_uri
    )
    if tracking_uri:
        env_vars["MLFLOW_TRACKING_URI"] = tracking_uri
        _warn_if_loopback(tracking_uri, target.address)
    runtime_env = build_runtime_env(working_dir, env_vars, pip)
    client = connect(target)
    metadata = {"job_name": f"splitvit-{entry}", "splitvit.entry": entry}
    started = time.monotonic()
    for attempt in (1, 2):
        try:
            job_id = client.submit_job(
                entrypoint=entrypoint,
                runtime_env=runtime_env,
                metadata=metadata,
                submission_id=submission_id if attempt == 1 or not submission_id else f"{submission_id}-2",
            )
        except Exception as exc:
            raise SubmitError(
                f"the Ray job server at {target.address} rejected the job: {_reason(exc)}", address=target.address
            ) from None
        log.info("submitted job %s to %s: %s", job_id, target.address, entrypoint)
        if on_submitted is not None:
            on_submitted(job_id, target.address)
        result = JobResult(
            job_id=job_id,
            address=target.address,
            entrypoint=entrypoint,
            status="PENDING",
            tracking_uri=tracking_uri,
            runtime_env=runtime_env,
        )
        if not wait:
            return result
        info = follow(client, job_id, sink)
        message = getattr(info, "message", "") or ""
        if attempt == 1 and _status(info.status) == "FAILED" and _PACKAGE_GONE in message:
            # the entrypoint never ran: submitting again is safe
            log.warning("job %s: Ray lost the uploaded package before the job started; submitting again", job_id)
            continue
        break
    result.duration_s = time.monotonic() - started
    result.status = _status(info.status)
    result.message = _short_message(message)
    if result.status != "SUCCEEDED":
        result.log_tail = log_tail(client, job_id, log_lines)
        raise JobFailed(result)
    return result


def _warn_if_loopback(tracking_uri: str, address: str) -> None:
    """A loopback MLflow URI only works for jobs that run on this machine."""
    from urllib.parse import urlparse

    from ..config import redact_uri

    mlflow_host = urlparse(tracking_uri).hostname or ""
    ray_host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    loop = ("127.0.0.1", "localhost", "::1")
    if mlflow_host in loop and ray_host not in loop:
        log.warning(
            "MLFLOW_TRACKING_URI %s is loopback but the cluster at %s is not on this machine: the job's "
            "processes will not reach it (pass --tracking-uri with an address the cluster can reach)",
            redact_uri(tracking_uri),
            address,
        )
