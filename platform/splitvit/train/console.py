"""What a person sees while a sweep or a study runs.

Ray Tune's own console (a configuration box per trial, a status table every few
seconds, a TensorBoard hint although this project has no TensorBoard) is off
unless the command runs with ``-v``, and so is the output Ray forwards from a
sweep's workers; the project's callbacks print one line per trial event instead, and
:class:`Progress` draws a bar over the trials on a terminal.

It lives in :mod:`splitvit.train`, beside :mod:`.trial` (one experiment fitted inside
a Tune trial): the lowest layer that runs Ray Tune trials, which the sweep
(:mod:`splitvit.tune`) and the study (:mod:`splitvit.study`) both use, and the command
line (``-v``) sets. It imports nothing of Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

#: The logger of ``ray.tune.tune.run``, which ends an interrupted experiment with a hint.
RAY_TUNE_LOGGER = "ray.tune.tune"

# Ray Tune's console output: off by default, on with `splitvit -v` (the CLI calls show_ray_output)
_ray_output = False


def show_ray_output(on: bool) -> None:
    """Let Ray Tune print its own console output (``-v``), or keep it quiet (default)."""
    global _ray_output
    _ray_output = bool(on)


def ray_output_shown() -> bool:
    """Whether Ray prints its own output here (``-v``): Tune's console, and the lines
    Ray forwards from a sweep's workers and controllers (the sweep's own lines say
    what each trial does)."""
    return _ray_output


def tune_verbosity() -> int:
    """``RunConfig(verbose=...)``: 1 (Ray's default output) with ``-v``, else 0."""
    return 1 if ray_output_shown() else 0


@contextlib.contextmanager
def environment(values: dict[str, str | None], *, override: bool = True) -> Iterator[None]:
    """Environment variables set while the block runs (``None``: unset), restored
    after. With ``override=False`` a variable already set keeps its value (the user's
    choice wins)."""
    before = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if not override and before[key] is not None:
            continue
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def ray_console() -> Iterator[None]:
    """Around ``Tuner.fit``: keep Ray Tune's console quiet unless it was asked for.

    ``verbose=0`` alone is not enough in Ray 2.x: its new output engine prints the
    experiment's configuration box, its folder and the TensorBoard hint whatever the
    verbosity. The legacy engine (``RAY_AIR_NEW_OUTPUT=0``) at verbosity 0 prints
    nothing; the variable is read when ``fit`` starts, so it is set only around it.
    Ray Tune's resume hint after a Ctrl-C (``Tuner.restore(...)``) is dropped too.
    """
    if ray_output_shown():
        yield
        return
    tune_logger = logging.getLogger(RAY_TUNE_LOGGER)
    hint = _NoRestoreHint()
    tune_logger.addFilter(hint)
    try:
        with environment({"RAY_AIR_NEW_OUTPUT": "0"}):
            yield
    finally:
        tune_logger.removeFilter(hint)


class _NoRestoreHint(logging.Filter):
    """Drops Ray Tune's "Resume experiment with: Tuner.restore(...)" warning after a
    Ctrl-C: a Python call, where the project's own line says which command continues."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tuner.restore(" not in record.getMessage()


class Progress:
    """A text progress bar on stderr while a person waits (``[#####-----] 3/8 trials``).

    Drawn only when stderr is a terminal; elsewhere (logs, CI, a Ray job) the
    per-event lines, which carry the same count, are the record, so nothing is
    added. Lines logged through :meth:`log` clear the bar first and redraw it after,
    so the two do not run into each other.
    """

    def __init__(self, what: str, total: int, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.what = what
        self.total = max(int(total), 0)
        self.done = 0
        self.width = width
        self._stream = stream
        self.drawn = False

    @property
    def stream(self) -> TextIO:
        """Where the bar goes: the stream given, else ``sys.stderr`` as it is now."""
        return self._stream if self._stream is not None else sys.stderr

    def __getstate__(self) -> dict[str, Any]:
        # Ray Tune pickles its callbacks (with the bar) into the experiment state: a
        # stream cannot be pickled, and after a restore the bar goes to stderr
        return {**self.__dict__, "_stream": None, "drawn": False}

    @property
    def active(self) -> bool:
        """Whether the bar is drawn: a terminal, and something to count."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(self.total) and callable(isatty) and bool(isatty())

    def bar(self) -> str:
        """The bar's text, e.g. ``[##########----------] 3/8 trials``."""
        filled = round(self.width * min(self.done, self.total) / self.total) if self.total else 0
        return f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {self.what}"

    def update(self, done: int) -> None:
        """Set the count and redraw; the bar ends its line once everything is done."""
        self.done = done
        if not self.active:
            return
        self.stream.write(f"\r\033[K{self.bar()}")
        self.drawn = True
        if self.done >= self.total:
            self.stream.write("\n")
            self.drawn = False
        self.stream.flush()

    def log(self, logger: logging.Logger, level: int, message: str, *args: Any) -> None:
        """Log a line without it running into the bar."""
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
        logger.log(level, message, *args)
        if self.drawn:
            self.stream.write(self.bar())
            self.stream.flush()
