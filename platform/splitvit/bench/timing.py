"""The benchmarks' timer: interleaved rounds, medians, and a check on the machine.

Every timing of the project goes through :func:`time_interleaved`: ``warmup`` untimed
rounds, then ``repeats`` rounds in which every callable runs once, interleaved (A, B,
C, ... then ..., C, B, A) so that drift in clock speed or cache state falls on all of
them alike, with the garbage collector off and ``torch.cuda.synchronize`` around each
call on CUDA (:func:`synchronizer`). :func:`time_beside_others` adds the CPU time other
processes used meanwhile (Linux ``/proc/stat`` minus this process's CPU time): a
timing taken beside more than :data:`OTHER_LOAD_WARNING` busy CPUs is noisy, and the
benchmarks say so. :func:`machine_info` describes what a timing ran on.

Used by ``splitvit bench`` (forward and train) and by the sweeps' and studies'
speed measurements (:mod:`splitvit.bench.speed`), so a figure means the same everywhere.
"""

from __future__ import annotations

import gc
import logging
import os
import platform as _stdlib_platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import timm
import torch

from ..jsontypes import JsonObject
from .records import MachineInfo

log = logging.getLogger(__name__)

#: Warn when other processes used more than this many CPUs on average while timing.
OTHER_LOAD_WARNING = 0.25


def checked_device(device: str) -> torch.device:
    """``device`` as a ``torch.device``; a ``ValueError`` for CUDA where there is none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def compile_options(device: torch.device) -> dict[str, str]:
    """``torch.compile`` options of a benchmark's compiled side: CUDA graphs on a GPU
    (``mode="reduce-overhead"``), where launches would cost more than the kernels."""
    return {"mode": "reduce-overhead"} if device.type == "cuda" else {}


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (CUDA), or does nothing."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
    cpu_samples: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Wall-clock seconds per call of every function, interleaved: each round runs every
    function once, in forward order on even rounds and reverse order on odd ones.

    When ``cpu_samples`` is given it receives, per function, the CPU seconds this
    process (all its threads) spent in each timed call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one timed call would land on one model only
    try:
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                sync()
                cpu_start, start = time.process_time(), time.perf_counter()
                fns[name]()
                sync()
                samples[name].append(time.perf_counter() - start)
                if cpu_samples is not None:
                    cpu_samples.setdefault(name, []).append(time.process_time() - cpu_start)
            log.info("bench: round %d/%d done", r + 1, repeats)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def time_beside_others(
    fns: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[dict[str, list[float]], dict[str, list[float]], float | None]:
    """:func:`time_interleaved` with per-call CPU seconds, and the CPU cores that other
    processes used on average meanwhile (``None`` without ``/proc/stat``): the check
    that a timing was taken on a quiet machine."""
    busy_before, own_before, wall_before = cpu_busy_seconds(), time.process_time(), time.perf_counter()
    cpu_samples: dict[str, list[float]] = {}
    samples = time_interleaved(fns, repeats=repeats, warmup=warmup, sync=sync, cpu_samples=cpu_samples)
    busy_after, own_after, wall_after = cpu_busy_seconds(), time.process_time(), time.perf_counter()
    others = None
    if busy_before is not None and busy_after is not None:
        others = max(0.0, (busy_after - busy_before) - (own_after - own_before)) / (wall_after - wall_before)
    return samples, cpu_samples, others


@dataclass(frozen=True)
class TimingSummary:
    """One timed callable's figures (:func:`timing_summary`)."""

    median_s: float
    min_s: float
    max_s: float
    images_per_s: float  # at the median
    samples_s: list[float]  # every timed round's seconds
    cpu_median_s: float  # process CPU seconds per call
    cpu_samples_s: list[float]

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields, in order."""
        return asdict(self)


def timing_summary(samples: list[float], cpu_samples: list[float], batch_size: int) -> TimingSummary:
    """One timed callable's figures: median/min/max seconds, images/s at the median,
    the raw samples, and the process CPU seconds per call."""
    median = statistics.median(samples)
    return TimingSummary(
        median_s=median,
        min_s=min(samples),
        max_s=max(samples),
        images_per_s=batch_size / median,
        samples_s=samples,
        cpu_median_s=statistics.median(cpu_samples),
        cpu_samples_s=cpu_samples,
    )


def quartiles(values: list[float]) -> dict[str, float]:
    """Median and quartiles of per-round figures: how well one run resolves a ratio."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


def cpu_busy_seconds() -> float | None:
    """CPU-seconds all processes of the machine have spent busy (Linux ``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10])  # already counted in user and nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or ``""`` where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info(device: torch.device) -> MachineInfo:
    """What a benchmark ran on: CPUs, threads, versions, load, and the GPU's name."""
    return MachineInfo(
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        timm_version=timm.__version__,
        python=_stdlib_platform.python_version(),
        platform=_stdlib_platform.platform(),
        processor=_cpu_model() or _stdlib_platform.processor() or _stdlib_platform.machine(),
        device=str(device),
        load_average_end=list(os.getloadavg()),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    )
