"""Errors across Ray, and interruptions.

Ray wraps an exception raised on a worker: Ray Train's ``WorkerGroupError`` (one
``UserExceptionWithTraceback`` per failed rank) or ``ControllerError``, a task's
``RayTaskError``, Tune's ``TuneError``; the project adds its own wrappers
(``TrainingError``, ``TrialFailed``) with the cause chained. :func:`root_cause`
finds the exception that was raised first, :func:`error_line` the one line the
command line prints, :func:`worker_traceback` the worker's traceback for ``-v``.

:class:`Interrupted` is what Ctrl-C (SIGINT) and SIGTERM (``timeout``, ``ray job
stop``, a batch scheduler) raise in ``splitvit``: a ``KeyboardInterrupt``, so every
``except KeyboardInterrupt`` cleanup runs (an MLflow run ends ``KILLED``), with the
exit status a shell expects (130, 143) and what was kept.

:class:`DeterministicError` marks a failure a retry would repeat (the same input
fails the same way): Ray Train restarts the workers on none of them
(:func:`is_deterministic`); the run ends on its first attempt with one line.

The project's exceptions all survive pickling (Ray pickles a worker's exception to
send it to the driver): one with ``__init__`` arguments other than its message
defines ``__reduce__``.
"""

from __future__ import annotations

import signal
from typing import Any

#: Ray's wrapper exceptions, by class name (anywhere in the class's MRO, so the
#: ``RayTaskError(ValueError)`` classes Ray makes with ``as_instanceof_cause`` count)
RAY_WRAPPERS = frozenset(
    {
        "TrainingFailedError",
        "WorkerGroupError",
        "ControllerError",
        "UserExceptionWithTraceback",
        "RayTaskError",
        "TuneError",
    }
)
#: the project's own wrappers: their message says what failed, the cause why
PROJECT_WRAPPERS = frozenset({"TrainingError", "TrialFailed"})


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. ``kept`` says what survives (the last checkpoint)."""

    def __init__(self, signum: int = signal.SIGINT, kept: str = "") -> None:
        super().__init__(int(signum), kept)
        self.signum = int(signum)
        self.kept = kept

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}" + (f"; {self.kept}" if self.kept else "")


class DeterministicError(Exception):
    """A failure that a retry would repeat: the same input fails the same way (a
    corrupt image read with ``strict=true``, a file that is no checkpoint). Training
    ends on the first attempt instead of spending ``train.max_failures`` restarts on it.

    Parts that may not import this module (``splitvit.data``) mark their exceptions
    the same way with a ``deterministic = True`` attribute (:func:`is_deterministic`).
    """

    deterministic = True


def is_deterministic(exc: BaseException) -> bool:
    """True when ``exc``, or the exception under Ray's and the project's wrappers,
    is marked deterministic (a :class:`DeterministicError`, or ``deterministic`` true)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "deterministic", False) is True:
            return True
        current = _inner(current, project=True)
    return False


_last_signal: list[int] = []


def note_signal(signum: int) -> Interrupted:
    """Record that ``signum`` arrived and return the exception to raise for it.

    Ray's blocking calls (``ray.get``) turn whatever a signal handler raises into a
    plain ``KeyboardInterrupt``; :func:`as_interrupted` recovers the signal from here.
    """
    _last_signal[:] = [int(signum)]
    return Interrupted(signum)


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as :class:`Interrupted`, with the signal that caused it (SIGINT if none was noted)."""
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted(_last_signal[0] if _last_signal else signal.SIGINT)


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def is_ray_wrapper(exc: BaseException) -> bool:
    """True for Ray's exceptions that only carry another one."""
    return bool(_names(exc) & RAY_WRAPPERS)


def _inner(exc: BaseException, project: bool) -> BaseException | None:
    """The exception ``exc`` wraps, or None. ``project``: unwrap the project's wrappers too."""
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return failures[sorted(failures)[0]]  # the lowest rank that failed
    for attr in ("_base_exc", "controller_failure"):
        inner = getattr(exc, attr, None)
        if isinstance(inner, BaseException):
            return inner
    names = _names(exc)
    if "RayTaskError" in names:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    if names & RAY_WRAPPERS or (project and names & PROJECT_WRAPPERS):
        return exc.__cause__
    return None


def _unwrap(exc: BaseException, project: bool) -> BaseException:
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = _inner(exc, project)
        if inner is None:
            break
        exc = inner
    return exc


def root_cause(exc: BaseException) -> BaseException:
    """The exception first raised under Ray's and the project's wrappers."""
    return _unwrap(exc, project=True)


def is_project_error(exc: BaseException) -> bool:
    """True for an exception class defined in the ``splitvit`` package."""
    return type(exc).__module__.split(".")[0] == "splitvit"


def describe(exc: BaseException) -> str:
    """One line: the project's exceptions by their message, others as ``Type: message``."""
    text = str(exc).strip()
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = repr(exc.args[0])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(lines) > 1:
        first += " (...; the whole message with -v)"
    if is_project_error(exc) or isinstance(exc, (ValueError, OSError)) and first:
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def error_line(exc: BaseException) -> str:
    """What ``splitvit`` prints after ``error:``: the message of the first exception
    under Ray's wrappers (the project's own wrappers already say what failed and why)."""
    return describe(_unwrap(exc, project=False))


def worker_traceback(exc: BaseException) -> str | None:
    """The traceback Ray recorded where the error was raised (a worker, a task), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for attr in ("_traceback_str", "traceback_str"):
            text = getattr(current, attr, None)
            if isinstance(text, str) and text.strip():
                return text
        if "RayTaskError" in _names(current):  # as_instanceof_cause keeps it in the message only
            return str(current)
        current = _inner(current, project=True) or current.__cause__
    return None


def from_ray(exc: BaseException) -> bool:
    """True when ``exc`` (or a cause) came through Ray: raised in a worker, a task or an actor."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_ray_wrapper(current) or type(current).__module__.split(".")[0] == "ray":
            return True
        current = _inner(current, project=True) or current.__cause__
    return False


def reduce_with(exc: BaseException, *args: Any) -> tuple:
    """``__reduce__`` for an exception rebuilt from ``args`` (its ``__init__``'s), keeping
    attributes set later (``__dict__``)."""
    return (type(exc), args, dict(exc.__dict__))
