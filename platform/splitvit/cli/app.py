"""The ``splitvit`` command itself: the parser, running one subcommand, its exit status.

:func:`main` parses, turns SIGINT/SIGTERM into ``errors.Interrupted``, runs the
subcommand's function, maps what it raised to one error line and an exit status,
and writes the ``--json`` envelope (:func:`.output.envelope`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from ..train.console import environment
from . import bench, config, data, demo, evaluate, pareto, recipes, stack, study, submit, sweep, train, viz
from .output import Report, envelope, write_json


def _tracking_env(uri: str | None) -> contextlib.AbstractContextManager[None]:
    """``--tracking-uri`` as ``$MLFLOW_TRACKING_URI`` while the command runs, for what
    reads the store from the environment (``bench train --tracking``, the default
    config); commands with a config also get it as an override, which beats the file."""
    return environment({"MLFLOW_TRACKING_URI": uri}) if uri else contextlib.nullcontext()


#: every subcommand's module, in the order ``splitvit --help`` lists them
COMMANDS: list[ModuleType] = [
    demo,
    viz,
    bench,
    data,
    recipes,
    config,
    train,
    evaluate,
    sweep,
    study,
    pareto,
    submit,
    stack,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``splitvit`` parser: ``-v``, then one subcommand of :data:`COMMANDS` with its options."""
    parser = argparse.ArgumentParser(
        prog="splitvit", description="SPLIT: learned hierarchical patch splitting for ViTs"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log progress at INFO level (also accepted after the subcommand)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _exit_status(exc: BaseException) -> int | None:
    """1 for an error that came through Ray (a worker's, a task's) or any of the
    project's own; 2 for bad input found before anything started (ValueError,
    OSError: a bad setting, a missing file, storage); None: a bug, shown in full."""
    from ..errors import from_ray, is_project_error

    if from_ray(exc):
        return 1
    if isinstance(exc, (ValueError, OSError)):
        return 2
    return 1 if is_project_error(exc) else None


def _raise_interrupted(signum: int, frame: Any) -> None:
    from ..errors import note_signal

    raise note_signal(signum)


def _handle_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise ``errors.Interrupted`` (a KeyboardInterrupt): the same
    cleanup runs for Ctrl-C, ``timeout``, ``ray job stop`` or a scheduler's SIGTERM.
    Returns the handlers replaced (none outside the main thread)."""
    from .. import errors

    errors._last_signal.clear()  # a signal noted by an earlier command in this process
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _raise_interrupted)
        except ValueError:  # not the main thread
            break
    return previous


def main(argv: list[str] | None = None) -> int:
    """Run a command. Exit status: 0 done; 1 failed (an error inside Ray is one line,
    its worker's traceback with ``-v``); 2 bad input found before starting; 130/143
    interrupted by SIGINT/SIGTERM (what was kept is said)."""
    from ..errors import as_interrupted, error_line, worker_traceback

    args = build_parser().parse_args(argv)
    # the subcommands' -v/--tracking-uri leave no default (one before the subcommand stays)
    args.verbose = getattr(args, "verbose", False)
    args.tracking_uri = getattr(args, "tracking_uri", None)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    # a command with actions or kinds (bench, data, stack) names the one run: "bench train"
    name = " ".join(filter(None, [args.command, getattr(args, f"{args.command}_command", None)]))
    args.report = Report(
        name, mlflow={"tracking_uri": args.tracking_uri} if getattr(args, "uses_mlflow", False) else {}
    )
    started = time.monotonic()
    json_path = getattr(args, "json", None)
    unwritable = _json_folder_problem(json_path) if json_path else None
    if unwritable:  # found before anything starts, not after an hour of training
        print(f"splitvit {name}: error: --json {json_path}: {unwritable}", file=sys.stderr)
        return 2
    code = 1
    previous = _handle_signals()
    try:
        with _tracking_env(args.tracking_uri if getattr(args, "uses_mlflow", False) else None):
            _check_tracking_scheme(args)
            code = int(args.func(args) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM
        stopped = as_interrupted(exc)
        sys.stdout.flush()
        print(f"\nsplitvit {name}: {stopped}", file=sys.stderr)
        args.report.error = str(stopped)
        code = stopped.exit_code
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a SIGPIPE'd tool does
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python's own flush at exit would fail again
        code = 128 + signal.SIGPIPE
    except Exception as exc:  # noqa: BLE001 - bad input, storage, errors from Ray's workers
        status = _exit_status(exc)
        if status is None:  # a bug: the envelope says so, then the traceback in full
            args.report.error = f"{type(exc).__name__}: {exc}"
            _write_envelope(args, 1, time.monotonic() - started)
            raise
        sys.stdout.flush()
        # bad input says what it has to say (as before); errors through Ray: their root, one line
        args.report.error = str(exc) if status == 2 else error_line(exc)
        print(f"splitvit {name}: error: {args.report.error}", file=sys.stderr)
        if args.verbose:
            print(worker_traceback(exc) or "".join(traceback.format_exception(exc)), file=sys.stderr, end="")
        code = status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return _write_envelope(args, code, time.monotonic() - started)


def _check_tracking_scheme(args: argparse.Namespace) -> None:
    """``--tracking-uri`` of a command that uses MLflow names a kind of store MLflow has:
    said in a second, before MLflow loads (its own answer is a traceback after ~20 s)."""
    if args.tracking_uri and getattr(args, "uses_mlflow", False):
        from ..train.names import tracking_uri_problem

        why = tracking_uri_problem(args.tracking_uri)
        if why:
            raise ValueError(f"--tracking-uri: {why}")


def _json_folder_problem(path: str) -> str | None:
    """Why ``--json PATH``'s folder cannot be made or written (its nearest existing
    ancestor is a file, or read-only), else None: it is made when the JSON is written."""
    folder = Path(path).expanduser().absolute().parent
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _write_envelope(args: argparse.Namespace, code: int, wall_time_s: float) -> int:
    """Write the envelope to ``--json`` (when given); returns the exit status, 2 when
    a command that succeeded cannot write its JSON (a bad path: bad input)."""
    path = getattr(args, "json", None)
    if not path:
        return code
    try:
        write_json(path, envelope(args.report, code, wall_time_s))
    except OSError as exc:
        print(f"splitvit {args.report.command}: error: --json {path}: {exc}", file=sys.stderr)
        return code or 2
    return code
