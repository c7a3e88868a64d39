"""The local stack: a Ray head (dashboard and job server) and an MLflow tracking
server on this machine, brought up and down with one command each.

``splitvit stack up`` starts

* a Ray head node (``ray start --head``) with its dashboard and job server on
  ``http://127.0.0.1:8265``, token authentication on (the token lives in the
  stack's folder), and its own Ray temp folder, so it never mixes with another
  Ray instance on the machine;
* an MLflow tracking server on ``http://127.0.0.1:5000`` with a SQLite (or any
  SQLAlchemy, e.g. PostgreSQL) backend store and artifacts *served by the
  server* (``--artifacts-destination``), so jobs upload artifacts over HTTP;

waits on their health endpoints, and writes where they are to
``<state dir>/stack.json`` (read by ``splitvit submit``) and ``<state dir>/stack.env``
(``source`` it to point ``ray job submit`` and MLflow clients at the stack). The
state folder is ``$SPLITVIT_STACK_DIR``, else ``~/.splitvit/stack``.

Nothing listens beyond loopback unless asked (``host="0.0.0.0"``): with the
default host Ray runs in its single-machine mode, in which every Ray server binds
127.0.0.1.

``splitvit stack down`` stops exactly the stack's processes: each is started with
a marker in its environment, and the stop walks the marker's processes and their
descendants (Ray workers, job drivers). It never stops by process name, so other
Ray instances on the machine keep running (``ray stop`` would stop them all).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..jsontypes import JsonObject

log = logging.getLogger(__name__)

STATE_DIR_ENV = "SPLITVIT_STACK_DIR"
DEFAULT_STATE_DIR = "~/.splitvit/stack"
STATE_FILE = "stack.json"
ENV_FILE = "stack.env"
TOKEN_FILE = "ray_auth_token"
#: Environment marker every stack process carries (Ray passes its environment on
#: to the processes it starts, MLflow to its workers).
MARKER_ENV = "SPLITVIT_STACK_ID"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Unix socket paths (Ray puts its sockets under the temp folder) are limited to 107 bytes.
_SOCKET_PATH_MAX = 107
_RAY_SOCKET_SUFFIX = "/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"


class StackError(RuntimeError):
    """The stack could not be started, checked or stopped; the message says why."""


# ---------------------------------------------------------------------- settings and state
@dataclass
class StackSettings:
    """How to bring the stack up.

    Attributes:
        state_dir: folder for the state file, logs, the MLflow store and the Ray
            temp folder (default ``$SPLITVIT_STACK_DIR`` or ``~/.splitvit/stack``).
        host: interface the dashboard and MLflow listen on. ``127.0.0.1`` (default)
            keeps every Ray server on loopback too; ``0.0.0.0`` or an address opens them.
        dashboard_port: Ray dashboard and job server.
        mlflow_port: MLflow tracking server.
        ray_port: Ray's GCS (``ray status --address 127.0.0.1:<port>``).
        client_port, agent_port, autoscaler_metrics_port, dashboard_metrics_port: Ray's
            internal ports; ``None`` picks a free one, so the stack does not collide
            with another Ray instance on the machine (Ray's fixed defaults would).
        num_cpus, num_gpus: resources the Ray head advertises (default: detected).
        backend_store_uri: MLflow backend store (default SQLite in the state folder;
            ``postgresql+psycopg2://...`` for PostgreSQL).
        artifacts_destination: where the MLflow server stores artifacts (default a
            folder in the state folder; ``s3://bucket/prefix`` works too).
        mlflow_workers: MLflow server worker processes.
        ray_temp_dir: Ray's temp folder (default ``<state_dir>/ray``).
        timeout_s: bound on every wait for a component to become healthy.
    """

    state_dir: Path | None = None
    host: str = "127.0.0.1"
    dashboard_port: int = 8265
    mlflow_port: int = 5000
    ray_port: int = 6379
    client_port: int | None = None
    agent_port: int | None = None
    autoscaler_metrics_port: int | None = None
    dashboard_metrics_port: int | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    backend_store_uri: str | None = None
    artifacts_destination: str | None = None
    mlflow_workers: int = 2
    ray_temp_dir: Path | None = None
    timeout_s: float = 180.0


@dataclass
class StackState:
    """What ``stack.json`` holds: where the running stack's parts are.

    ``backend_store_uri`` is stored without its password.
    """

    stack_id: str
    host: str
    dashboard_url: str
    gcs_address: str
    mlflow_url: str
    agent_port: int
    ray_temp_dir: str
    auth_token_path: str
    backend_store_uri: str
    artifacts_destination: str
    storage_path: str
    mlflow_pid: int
    ray_start_pid: int
    logs_dir: str
    python: str
    started_at: float

    def auth_headers(self) -> dict[str, str]:
        """The HTTP header that authenticates to the stack's Ray dashboard and job server."""
        token = Path(self.auth_token_path).read_text().strip()
        return {"authorization": f"Bearer {token}"}

    def env(self) -> dict[str, str]:
        """Environment that points the Ray jobs CLI and MLflow clients at the stack.

        ``RAY_API_SERVER_ADDRESS`` (read by the jobs CLI/SDK only), not
        ``RAY_ADDRESS``: an HTTP ``RAY_ADDRESS`` would break a local ``ray.init()``.
        """
        return {
            "RAY_API_SERVER_ADDRESS": self.dashboard_url,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": self.auth_token_path,
            "MLFLOW_TRACKING_URI": self.mlflow_url,
        }


@dataclass
class ComponentHealth:
    """One health check's outcome."""

    name: str
    url: str
    healthy: bool
    detail: str = ""


@dataclass
class StackStatus:
    """What :func:`up` and :func:`status` report."""

    state_dir: str
    running: bool
    components: list[ComponentHealth] = field(default_factory=list)
    state: StackState | None = None
    already_running: bool = False
    processes: int = 0

    @property
    def healthy(self) -> bool:
        """True when the stack is running and every check passed."""
        return self.running and bool(self.components) and all(c.healthy for c in self.components)

    def to_dict(self) -> JsonObject:
        """Plain dict for JSON."""
        out = asdict(self)
        out["healthy"] = self.healthy
        if self.state is not None:
            out["env"] = self.state.env()
        return out


@dataclass
class DownReport:
    """What :func:`down` did."""

    state_dir: str
    was_running: bool
    stopped: int = 0
    killed: int = 0
    ports_open: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when nothing of the stack is left running."""
        return not self.ports_open

    def to_dict(self) -> JsonObject:
        """Plain dict for JSON."""
        return {**asdict(self), "clean": self.clean}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One `up` or `down` at a time per stack folder (two would start two stacks)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_state_dir() -> Path:
    """``$SPLITVIT_STACK_DIR``, else ``~/.splitvit/stack``."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).expanduser().resolve()


def load_state(state_dir: Path | str | None = None) -> StackState | None:
    """The running stack's state, or ``None`` when no stack was brought up there."""
    path = Path(state_dir or default_state_dir()).expanduser() / STATE_FILE
    if not path.is_file():
        return None
    try:
        return StackState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise StackError(f"{path} is not a stack state file ({exc}); remove it or run `splitvit stack down`") from None


# ---------------------------------------------------------------------- processes
def _psutil():
    try:
        import psutil
    except ImportError:
        # Ray ships psutil in its thirdparty_files and puts that on sys.path on import,
        # so ray must come first (importlib: an import sorter must not reorder the two)
        import ray  # noqa: F401

        psutil = importlib.import_module("psutil")
    return psutil


def marked_processes(marker_value: str, *, marker_env: str = MARKER_ENV, cmdline_markers: Iterable[str] = ()) -> list:
    """Processes that carry ``marker_env=marker_value`` in their environment (or one of
    ``cmdline_markers`` in their command line), with all their descendants.

    Descendants count because processes that rename themselves (Ray workers become
    ``ray::IDLE``) overwrite the memory ``/proc/<pid>/environ`` reads from.
    """
    psutil = _psutil()
    me = os.getpid()
    markers = [m for m in cmdline_markers if m]
    roots = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(marker_env) == marker_value:
                roots.append(proc)
                continue
            if markers:
                cmdline = " ".join(proc.cmdline())
                if any(m in cmdline for m in markers):
                    roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    found = {p.pid: p for p in roots}
    for proc in roots:
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found.pop(me, None)
    return list(found.values())


def terminate_processes(procs: list, grace_s: float = 10.0) -> tuple[int, int]:
    """SIGTERM ``procs``, wait up to ``grace_s`` seconds, SIGKILL the rest.

    Returns ``(stopped_by_sigterm, killed)``.
    """
    psutil = _psutil()
    if not procs:
        return 0, 0
    for proc in procs:
        try:
            proc.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs) - len(alive), len(alive)


# ---------------------------------------------------------------------- network
def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` (a bind succeeds)."""
    bind_host = "0.0.0.0" if host in ("0.0.0.0", "") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as servers do: a port in TIME_WAIT (a server just stopped) is free, a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_listening(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_get(url: str, *, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """``(status, body)`` of a GET; raises ``OSError`` when nothing answers."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) URLs we built
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def wait_until(
    check: Callable[[], tuple[bool, str]],
    *,
    timeout_s: float,
    what: str,
    alive: Callable[[], str | None] | None = None,
    interval_s: float = 0.5,
) -> str:
    """Poll ``check`` (returns ``(ok, detail)``) until it passes or ``timeout_s`` runs out.

    ``alive`` returns a message when the process behind the check has died: the
    wait stops at once instead of running out the clock. Returns the last detail;
    raises :class:`StackError` on timeout or death.
    """
    deadline = time.monotonic() + timeout_s
    detail = "no answer yet"
    while True:
        ok, detail = check()
        if ok:
            return detail
        if alive is not None:
            dead = alive()
            if dead:
                raise StackError(f"{what} stopped before it became healthy: {dead}")
        if time.monotonic() >= deadline:
            raise StackError(f"{what} was not healthy after {timeout_s:.0f}s: {detail}")
        time.sleep(interval_s)


def _http_check(url: str, headers: dict[str, str] | None = None, expect: str | None = None) -> tuple[bool, str]:
    try:
        code, body = http_get(url, headers=headers, timeout=5.0)
    except OSError as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"
    if code != 200:
        return False, f"{url}: HTTP {code} {body[:200].strip()}"
    if expect is not None and expect not in body:
        return False, f"{url}: unexpected answer {body[:200].strip()!r}"
    return True, f"{url}: OK"


def tail(path: Path | str, lines: int = 30) -> str:
    """The last ``lines`` lines of a text file ('' when it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return ""
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024))
        text = handle.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------- health
def check_health(state: StackState) -> list[ComponentHealth]:
    """Health of each part of a running stack (one pass, no waiting)."""
    try:
        headers = state.auth_headers()
    except OSError as exc:
        headers = {}
        log.warning("cannot read the stack's Ray token %s: %s", state.auth_token_path, exc)
    checks = [
        ("ray-dashboard", f"{state.dashboard_url}/api/gcs_healthz", None, "success"),
        ("ray-job-server", f"{state.dashboard_url}/api/version", headers, "ray_version"),
        ("ray-job-agent", f"http://{_client_host(state.host)}:{state.agent_port}/api/healthz", None, None),
        ("mlflow", f"{state.mlflow_url}/health", None, "OK"),
    ]
    out = []
    for name, url, hdrs, expect in checks:
        ok, detail = _http_check(url, hdrs, expect)
        out.append(ComponentHealth(name, url, ok, detail))
    return out


def status(state_dir: Path | str | None = None) -> StackStatus:
    """Whether a stack runs in ``state_dir`` and the health of each of its parts."""
    folder = Path(state_dir or default_state_dir()).expanduser().resolve()
    state = load_state(folder)
    if state is None:
        return StackStatus(str(folder), running=False)
    procs = marked_processes(state.stack_id, cmdline_markers=[state.ray_temp_dir])
    return StackStatus(
        str(folder), running=bool(procs), components=check_health(state), state=state, processes=len(procs)
    )


# ---------------------------------------------------------------------- up
def _client_host(host: str) -> str:
    """Where clients on this machine reach a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") or host in LOOPBACK else host


def _ray_command() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


def _redact(uri: str) -> str:
    from ..config import redact_uri

    return redact_uri(uri)


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (tokens, state with local paths)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def _ensure_token(path: Path) -> None:
    """A Ray auth token for the stack, kept across restarts so ``stack.env`` stays valid."""
    if path.is_file() and path.read_text().strip():
        return
    _write_private(path, secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate`


def _base_env(stack_id: str, settings: StackSettings, token_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Settings of another cluster must not leak into the stack's processes (and, through
    # Ray, into every job it runs).
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_TMPDIR"):
        env.pop(key, None)
    env[MARKER_ENV] = stack_id
    # Job entrypoints run `python ...` through a shell: make it this environment's Python.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if settings.host in LOOPBACK:
        # Ray's single-machine mode: its node address becomes 127.0.0.1 and every Ray
        # server binds loopback (by default Ray resolves 127.0.0.1 to the machine's
        # routable address and its gRPC servers listen on all interfaces).
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def up(settings: StackSettings | None = None) -> StackStatus:
    """Start the stack (or report the one already running) and wait until it is healthy.

    Raises:
        StackError: a port is taken, a component failed to start (its log's tail is
            in the message) or was not healthy within ``timeout_s``; whatever had
            started is stopped again.
    """
    settings = settings or StackSettings()
    folder = Path(settings.state_dir or default_state_dir()).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    with _locked(folder):
        return _up(settings, folder)


@dataclass
class _Launch:
    """Everything :func:`_up` settles before it starts a process: ports, folders, the
    MLflow stores and the environment every stack process gets."""

    settings: StackSettings
    folder: Path
    client_host: str
    ports: dict[str, int]
    ray_temp: Path
    logs: Path
    token_path: Path
    stack_id: str
    env: dict[str, str]
    backend: str
    artifacts: str

    @property
    def dashboard_url(self) -> str:
        """The Ray dashboard and job server, as clients on this machine reach it."""
        return f"http://{self.client_host}:{self.settings.dashboard_port}"

    @property
    def mlflow_url(self) -> str:
        """The MLflow server, as clients on this machine reach it."""
        return f"http://{self.client_host}:{self.settings.mlflow_port}"

    @property
    def mlflow_log(self) -> Path:
        """The MLflow server's output."""
        return self.logs / "mlflow.log"

    @property
    def ray_log(self) -> Path:
        """``ray start``'s output."""
        return self.logs / "ray-start.log"


def _up(settings: StackSettings, folder: Path) -> StackStatus:
    """:func:`up` with the stack folder locked: report a healthy stack, else stop what
    is left of an unhealthy one, start MLflow and the Ray head and wait for both."""
    current = status(folder)
    if current.state is not None:
        if current.healthy:
            current.already_running = True
            return current
        log.warning("a previous stack in %s is not healthy; stopping what is left of it", folder)
        _down(folder, 10.0)
    launch = _plan_launch(settings, folder)
    # MLflow first: it is the slower to boot and comes up while `ray start` runs.
    mlflow_proc = _start_mlflow(launch)
    state = _initial_state(launch, mlflow_proc.pid)
    # Written before anything can fail, so that `stack down` finds whatever did start.
    _write_state(folder, state)
    try:
        _start_ray_head(launch, state)
        _wait_until_healthy(launch, state, mlflow_proc)
    except BaseException:
        log.error("the stack did not come up; stopping what started")
        _down(folder, 10.0)
        raise
    _write_private(folder / ENV_FILE, "".join(f"export {k}={_shell_quote(v)}\n" for k, v in state.env().items()))
    if settings.host not in LOOPBACK:
        log.warning(
            "the stack listens on %s: Ray's job server needs its token, but the local MLflow server has no "
            "authentication (see infra/mlflow for a server with it)",
            settings.host,
        )
    return status(folder)


def _plan_launch(settings: StackSettings, folder: Path) -> _Launch:
    """Check the ports and Ray's temp folder, create the stack's folders and token, and
    settle the processes' environment and the MLflow stores."""
    client_host = _client_host(settings.host)
    ports = _stack_ports(settings, client_host)
    ray_temp = Path(settings.ray_temp_dir or folder / "ray").expanduser().resolve()
    if len(str(ray_temp)) + len(_RAY_SOCKET_SUFFIX) > _SOCKET_PATH_MAX:
        raise StackError(
            f"Ray's temp folder {ray_temp} is too long for the Unix sockets Ray creates in it "
            f"(at most {_SOCKET_PATH_MAX - len(_RAY_SOCKET_SUFFIX)} characters); "
            "pass a shorter --ray-temp-dir"
        )
    logs = folder / "logs"
    for path in (ray_temp, logs, folder / "runs"):
        path.mkdir(parents=True, exist_ok=True)
    token_path = folder / TOKEN_FILE
    _ensure_token(token_path)
    stack_id = uuid.uuid4().hex
    return _Launch(
        settings=settings,
        folder=folder,
        client_host=client_host,
        ports=ports,
        ray_temp=ray_temp,
        logs=logs,
        token_path=token_path,
        stack_id=stack_id,
        env=_base_env(stack_id, settings, token_path),
        backend=settings.backend_store_uri or f"sqlite:///{folder / 'mlflow.db'}",
        artifacts=settings.artifacts_destination or str(folder / "mlartifacts"),
    )


def _stack_ports(settings: StackSettings, client_host: str) -> dict[str, int]:
    """The stack's ports by setting name (Ray's internal ones picked free when unset);
    raises :class:`StackError` when two are the same or one is taken."""
    ports = {
        "dashboard_port": settings.dashboard_port,
        "mlflow_port": settings.mlflow_port,
        "ray_port": settings.ray_port,
        "client_port": settings.client_port or free_port(),
        "agent_port": settings.agent_port or free_port(),
        "autoscaler_metrics_port": settings.autoscaler_metrics_port or free_port(),
        "dashboard_metrics_port": settings.dashboard_metrics_port or free_port(),
    }
    if len(set(ports.values())) != len(ports):
        raise StackError(f"the stack's ports must differ: {ports}")
    for name, port in ports.items():
        if not port_is_free(port, "0.0.0.0" if settings.host not in LOOPBACK else client_host):
            option = "--" + name.replace("_", "-")
            raise StackError(
                f"port {port} ({name}) is already in use on this machine; "
                f"stop what listens there or pick another with {option}"
            )
    return ports


def _initial_state(launch: _Launch, mlflow_pid: int) -> StackState:
    """The stack's state once MLflow has started (``ray_start_pid`` follows with ``ray start``)."""
    return StackState(
        stack_id=launch.stack_id,
        host=launch.settings.host,
        dashboard_url=launch.dashboard_url,
        gcs_address=f"{launch.client_host}:{launch.ports['ray_port']}",
        mlflow_url=launch.mlflow_url,
        agent_port=launch.ports["agent_port"],
        ray_temp_dir=str(launch.ray_temp),
        auth_token_path=str(launch.token_path),
        backend_store_uri=_redact(launch.backend),
        artifacts_destination=_redact(launch.artifacts),
        storage_path=str(launch.folder / "runs"),
        mlflow_pid=mlflow_pid,
        ray_start_pid=0,
        logs_dir=str(launch.logs),
        python=sys.executable,
        started_at=time.time(),
    )


def _write_state(folder: Path, state: StackState) -> None:
    """``stack.json``: where the stack's parts are (read by ``stack down`` and ``submit``)."""
    _write_private(folder / STATE_FILE, json.dumps(asdict(state), indent=2) + "\n")


def _start_mlflow(launch: _Launch) -> subprocess.Popen:
    """Start the MLflow tracking server in its own session; returns its process (not yet healthy)."""
    settings = launch.settings
    env = dict(launch.env)
    # MLflow's background job runner serves GenAI judges; training tracking does not
    # use it, and it costs several processes on a laptop.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        launch.backend,
        "--artifacts-destination",
        launch.artifacts,
        "--serve-artifacts",
        "--host",
        settings.host,
        "--port",
        str(settings.mlflow_port),
        "--workers",
        str(settings.mlflow_workers),
    ]
    log.info(
        "starting MLflow on %s (backend %s, artifacts %s)",
        launch.mlflow_url,
        _redact(launch.backend),
        _redact(launch.artifacts),
    )
    with open(launch.mlflow_log, "ab") as out:
        return subprocess.Popen(
            command,
            env=env,
            cwd=launch.folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _start_ray_head(launch: _Launch, state: StackState) -> None:
    """Run ``ray start --head`` (it returns once the head's processes run), recording
    its pid in ``stack.json`` first; raises :class:`StackError` with its log's tail when
    it fails or outlasts ``timeout_s``."""
    settings, ports = launch.settings, launch.ports
    host = settings.host
    command = [
        *_ray_command(),
        "start",
        "--head",
        "--port",
        str(ports["ray_port"]),
        "--dashboard-host",
        host,
        "--dashboard-port",
        str(settings.dashboard_port),
        "--include-dashboard",
        "true",
        "--dashboard-agent-listen-port",
        str(ports["agent_port"]),
        "--ray-client-server-port",
        str(ports["client_port"]),
        "--temp-dir",
        str(launch.ray_temp),
        "--disable-usage-stats",
    ]
    if host not in LOOPBACK and host not in ("0.0.0.0", "::", ""):
        command += ["--node-ip-address", host]
    if settings.num_cpus is not None:
        command += ["--num-cpus", str(settings.num_cpus)]
    if settings.num_gpus is not None:
        command += ["--num-gpus", str(settings.num_gpus)]
    env = dict(launch.env)
    # Jobs on the stack log to the stack's MLflow unless their runtime env says otherwise
    # (so `ray job submit` without extra options does what `splitvit submit` does).
    env["MLFLOW_TRACKING_URI"] = launch.mlflow_url
    # Ray's fixed metrics ports would collide with any other Ray instance on the machine.
    env["AUTOSCALER_METRIC_PORT"] = str(ports["autoscaler_metrics_port"])
    env["DASHBOARD_METRIC_PORT"] = str(ports["dashboard_metrics_port"])
    ray_log = launch.ray_log
    log.info("starting the Ray head (dashboard %s, temp folder %s)", launch.dashboard_url, launch.ray_temp)
    with open(ray_log, "ab") as out:
        ray_proc = subprocess.Popen(
            command,
            env=env,
            cwd=launch.folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        state.ray_start_pid = ray_proc.pid
        _write_state(launch.folder, state)
        try:
            code = ray_proc.wait(timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            raise StackError(
                f"`ray start` did not finish within {settings.timeout_s:.0f}s; "
                f"its log ({ray_log}) ends:\n{tail(ray_log)}"
            ) from None
    if code != 0:
        raise StackError(f"`ray start` failed (exit {code}); its log ({ray_log}) ends:\n{tail(ray_log)}")


def _wait_until_healthy(launch: _Launch, state: StackState, mlflow_proc: subprocess.Popen) -> None:
    """Wait for the Ray dashboard, job server and job agent and the MLflow server to
    answer; stop at once if the MLflow server exits."""
    timeout_s = launch.settings.timeout_s
    dashboard_url, mlflow_url, mlflow_log = launch.dashboard_url, launch.mlflow_url, launch.mlflow_log

    def mlflow_dead() -> str | None:
        if mlflow_proc.poll() is None:
            return None
        return f"exit {mlflow_proc.returncode}; its log ({mlflow_log}) ends:\n{tail(mlflow_log)}"

    headers = state.auth_headers()
    wait_until(
        lambda: _http_check(f"{dashboard_url}/api/gcs_healthz", None, "success"),
        timeout_s=timeout_s,
        what=f"the Ray dashboard ({dashboard_url})",
    )
    wait_until(
        lambda: _http_check(f"{dashboard_url}/api/version", headers, "ray_version"),
        timeout_s=timeout_s,
        what=f"the Ray job server ({dashboard_url})",
    )
    # The job server hands jobs to this agent; a submission before it is up fails.
    wait_until(
        lambda: _http_check(f"http://{launch.client_host}:{launch.ports['agent_port']}/api/healthz"),
        timeout_s=timeout_s,
        what="the Ray job agent",
    )
    wait_until(
        lambda: _http_check(f"{mlflow_url}/health", None, "OK"),
        timeout_s=timeout_s,
        what=f"the MLflow server ({mlflow_url})",
        alive=mlflow_dead,
    )


def _shell_quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


# ---------------------------------------------------------------------- down
def down(state_dir: Path | str | None = None, grace_s: float = 10.0) -> DownReport:
    """Stop the stack in ``state_dir``: MLflow first, then every Ray process of the
    stack (workers and job drivers included), SIGTERM then SIGKILL after ``grace_s``.

    Idempotent: with nothing running it reports ``was_running=False``. The state and
    env files go; data (MLflow store, artifacts, runs, logs, the token) stays.
    """
    folder = Path(state_dir or default_state_dir()).expanduser().resolve()
    if not (folder / STATE_FILE).is_file():
        return DownReport(str(folder), was_running=False)
    with _locked(folder):
        return _down(folder, grace_s)


def _down(folder: Path, grace_s: float) -> DownReport:
    state = load_state(folder)
    report = DownReport(str(folder), was_running=state is not None)
    if state is None:
        return report
    psutil = _psutil()
    # MLflow (its uvicorn workers share its session) before Ray, so no job writes to
    # a server that is going away after the job itself was stopped.
    mlflow = []
    try:
        root = psutil.Process(state.mlflow_pid)
        if root.environ().get(MARKER_ENV) == state.stack_id:
            mlflow = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass
    stopped, killed = terminate_processes(mlflow, grace_s)
    rest = marked_processes(state.stack_id, cmdline_markers=[state.ray_temp_dir])
    more_stopped, more_killed = terminate_processes(rest, grace_s)
    report.stopped, report.killed = stopped + more_stopped, killed + more_killed
    ports = [
        int(state.dashboard_url.rsplit(":", 1)[1]),
        int(state.mlflow_url.rsplit(":", 1)[1]),
        int(state.gcs_address.rsplit(":", 1)[1]),
        state.agent_port,
    ]
    host = _client_host(state.host)
    deadline = time.monotonic() + 10.0
    while True:  # sockets close a moment after their processes exit
        report.ports_open = [p for p in ports if port_is_listening(p, host, timeout=0.5)]
        if not report.ports_open or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    leftovers = marked_processes(state.stack_id, cmdline_markers=[state.ray_temp_dir])
    if leftovers:
        log.warning("%d stack processes outlived SIGKILL: %s", len(leftovers), [p.pid for p in leftovers])
    for name in (STATE_FILE, ENV_FILE):
        (folder / name).unlink(missing_ok=True)
    return report
