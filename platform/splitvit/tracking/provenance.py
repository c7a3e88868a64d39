"""Where a run came from: the tags every MLflow run of the project carries.

MLflow's fluent API tags a run with its source, user and git commit; the project
opens runs with ``MlflowClient.create_run``, which does not, so :func:`provenance_tags`
resolves the same tags (MLflow's own context providers) and adds the project's: the
git commit of the code that runs and the package version. A submitted Ray job's
working directory has no ``.git``: ``splitvit submit`` passes the commit in
``SPLITVIT_GIT_COMMIT`` (and whether tracked files had changes in ``SPLITVIT_GIT_DIRTY``).
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

from .. import __version__

GIT_COMMIT_ENV = "SPLITVIT_GIT_COMMIT"
GIT_DIRTY_ENV = "SPLITVIT_GIT_DIRTY"
GIT_COMMIT_TAG = "mlflow.source.git.commit"
GIT_DIRTY_TAG = "splitvit.git_dirty"  # "true": the run's code differs from the commit
VERSION_TAG = "splitvit.version"
COMMAND_TAG = "splitvit.command"  # the command line that made the run (secrets masked)
SOURCE_NAME_TAG = "mlflow.source.name"  # the UI's "Source" column: the command (splitvit sweep)
SOURCE_DIR = Path(__file__).resolve().parents[1]  # the package: its repository, in a checkout


@functools.cache
def git_state(folder: str | None = None) -> tuple[str, bool] | None:
    """``(commit, dirty)`` of the checkout at ``folder`` (default: the package's own):
    ``dirty`` when tracked files differ from the commit. ``None`` outside a git
    repository or without git."""
    where = folder or str(SOURCE_DIR)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip(), bool(status.returncode == 0 and status.stdout.strip())


def git_env(folder: str | Path) -> dict[str, str]:
    """The environment that carries ``folder``'s git state into a job that runs a copy
    of it without ``.git`` (empty outside a repository)."""
    state = git_state(str(folder))
    return {GIT_COMMIT_ENV: state[0], GIT_DIRTY_ENV: str(state[1]).lower()} if state else {}


@functools.cache
def _mlflow_context_tags() -> dict[str, str]:
    """MLflow's own source and user tags of this process (resolved once: a sweep opens a
    run per threshold point, and MLflow's git context probes the repository each time)."""
    from mlflow.tracking.context.registry import resolve_tags

    return {k: v for k, v in resolve_tags().items() if k.startswith(("mlflow.source.", "mlflow.user"))}


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as a person typed it: ``splitvit sweep space.yaml
    --set train.lr=0.01`` (the console script's path shortened to its name), with
    secret-named ``key=value`` settings masked and passwords taken out of URIs."""
    from ..config import REDACTED, is_secret_key, redact_uri

    args = list(sys.argv if argv is None else argv)
    if args and Path(args[0]).name == "splitvit":
        args[0] = "splitvit"
    safe = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq:
            safe.append(redact_uri(arg))
        else:  # a key=value setting (or --option=value)
            safe.append(f"{key}={REDACTED if is_secret_key(key.lstrip('-')) else redact_uri(value)}")
    return shlex.join(safe)


def source_name(argv: list[str] | None = None) -> str:
    """The command that made a run, as MLflow's *Source* column shows it: ``splitvit
    sweep`` (the program and its subcommand), a script's file name (``sweep.py``), or
    the program's name. The UI shows a local source's last path part, so a whole
    command line would read as its last argument there (``sweep.json``); the command
    line itself is the ``splitvit.command`` tag."""
    args = list(sys.argv if argv is None else argv)
    if not args or not args[0]:
        return "splitvit"
    program = Path(args[0]).name
    if program == "splitvit" or (program == "__main__.py" and "splitvit" in Path(args[0]).parts):
        command = next((a for a in args[1:] if not a.startswith("-")), None)
        return f"splitvit {command}" if command else "splitvit"
    return program


def provenance_tags() -> dict[str, str]:
    """``mlflow.source.*`` (the source named by the command: :func:`source_name`),
    ``mlflow.user``, the command line, the git commit and ``splitvit.version``."""
    tags = dict(_mlflow_context_tags())
    tags[COMMAND_TAG] = command_line()
    tags[SOURCE_NAME_TAG] = source_name()
    if os.environ.get(GIT_COMMIT_ENV):
        tags[GIT_COMMIT_TAG] = os.environ[GIT_COMMIT_ENV]
        if os.environ.get(GIT_DIRTY_ENV):
            tags[GIT_DIRTY_TAG] = os.environ[GIT_DIRTY_ENV]
    elif (state := git_state()) is not None:
        tags[GIT_COMMIT_TAG], tags[GIT_DIRTY_TAG] = state[0], str(state[1]).lower()
    tags[VERSION_TAG] = __version__
    return tags
