"""Peak working memory of one batch forward pass, per model (``splitvit bench forward``'s part d).

Methods (:func:`measure_memory`; :data:`MEMORY_METHODS` words them for the report):

* ``cuda``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus ``memory_allocated`` before the pass, in process;
* ``rss`` (CPU): one fresh subprocess per model (:func:`_memory_probe`) loads the
  pickled model and images, runs a one-image warm-up (lazy library initialisation),
  resets the kernel's peak-RSS counter (``/proc/self/clear_refs``) and reports the
  peak RSS (``VmHWM``) during one batch forward minus the RSS just before it; where
  the counter cannot be reset it falls back to ``ru_maxrss`` growth and says so;
* ``profiler`` (CPU): the peak of live torch tensor allocations during one batch
  forward, from ``torch.profiler``'s ``profile_memory`` allocation and free events
  summed in time order (exact for torch tensors, blind to allocator caching and
  library scratch memory; RSS sees those but also glibc's retained heap).

A probed model is ``(module, kind)``: ``kind`` ``timm`` or ``split`` runs the
module's forward pass, ``policy`` its ``split_scores`` alone.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..jsontypes import JsonObject

log = logging.getLogger(__name__)

#: The package's source root (the folder holding ``splitvit``): the probe subprocesses
#: import this very copy of the package, installed or not.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: What a probe subprocess runs (``sys.argv[1]``: the payload's path).
_PROBE_CODE = "import sys; from splitvit.bench.memory import _memory_probe; _memory_probe(sys.argv[1])"

#: Probed models by name: ``(module, kind)``, kind ``timm``, ``split`` or ``policy``.
Probes = dict[str, tuple[nn.Module, str]]


def _rss_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (Linux ``/proc``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value, unit = line.split()
                out[key[:-1]] = int(value) * 1024
    return out


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``); ``False`` where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_probe(payload_path: str) -> None:
    """Subprocess entry point: one model's peak RSS growth during one forward pass.

    Writes ``{"rss_before", "peak_rss", "growth", "method"}`` (bytes) as JSON to
    the payload's path with the suffix ``.json``.
    """
    payload = torch.load(payload_path, map_location="cpu", weights_only=False)
    torch.set_num_threads(int(payload["threads"]))
    model, images, kind = payload["model"], payload["images"], payload["kind"]
    model.eval()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if payload["bf16"] else nullcontext()
    del payload
    with torch.inference_mode(), ctx:
        _call(model, kind, images[:1])  # lazy initialisation of kernels and thread pools
        gc.collect()
        can_reset = _reset_peak_rss()
        before = _rss_status()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        _call(model, kind, images)
        after = _rss_status()
        maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if can_reset:
        peak, method = after["VmHWM"], "peak RSS (VmHWM after clear_refs reset) minus RSS before the forward"
    else:
        peak, method = before["VmRSS"] + max(0, maxrss_after - maxrss_before), "ru_maxrss growth (lower bound)"
    result = {"rss_before": before["VmRSS"], "peak_rss": peak, "growth": peak - before["VmRSS"], "method": method}
    Path(payload_path).with_suffix(".json").write_text(json.dumps(result))


def _call(model: nn.Module, kind: str, images: torch.Tensor) -> Any:
    """One forward pass of a probed model (``kind``: ``timm``, ``split``, or ``policy``
    for ``split_scores`` alone)."""
    if kind == "policy":
        return model.split_scores(images)
    return model(images)


def _probe_env() -> dict[str, str]:
    """This environment with the package's source root first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_SOURCE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _cpu_memory(models: Probes, images: torch.Tensor, bf16: bool, parallel: int) -> dict[str, dict]:
    """Run one fresh subprocess per model (at most ``parallel`` at once)."""
    env = _probe_env()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="splitvit-bench-") as tmp:
        jobs = []
        for name, (model, kind) in models.items():
            path = Path(tmp) / f"{name}.pt"
            payload = {"model": model, "images": images, "kind": kind, "bf16": bf16, "threads": torch.get_num_threads()}
            torch.save(payload, path)
            jobs.append((name, path))
        running: list[tuple[str, subprocess.Popen]] = []

        def finish(name: str, proc: subprocess.Popen) -> None:
            _, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"memory probe for {name} failed ({proc.returncode}): {stderr.strip()[-2000:]}")
            results[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
            log.info("bench: memory of %s: %.1f MiB", name, results[name]["growth"] / 2**20)

        for name, path in jobs:
            while len(running) >= max(parallel, 1):
                finish(*running.pop(0))
            proc = subprocess.Popen(
                [sys.executable, "-c", _PROBE_CODE, str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            running.append((name, proc))
        for name, proc in running:
            finish(name, proc)
    return {name: results[name] for name in models}


def _cuda_memory(models: Probes, images: torch.Tensor, bf16: bool, device: torch.device) -> dict[str, dict]:
    """Peak CUDA allocation during one forward minus the allocation before it, in process."""
    results = {}
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    for name, (model, kind) in models.items():
        with torch.inference_mode(), ctx:
            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            _call(model, kind, images)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        results[name] = {"allocated_before": before, "peak_allocated": peak, "growth": peak - before}
    return results


def _profiler_memory(models: Probes, images: torch.Tensor, bf16: bool) -> dict[str, dict]:
    """Peak of live torch CPU allocations during one forward: the running sum of the
    profiler's allocation/free events (``profile_memory=True``), in time order."""
    from torch.profiler import ProfilerActivity, profile

    results = {}
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    for name, (model, kind) in models.items():
        with torch.inference_mode(), ctx:
            _call(model, kind, images[:1])
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                _call(model, kind, images)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:
            live += e.nbytes()
            peak = max(peak, live)
        results[name] = {"growth": peak, "events": len(events)}
    return results


MEMORY_METHODS = {
    "rss": "peak RSS (VmHWM, reset via /proc/self/clear_refs) during one batch forward minus RSS before it, "
    "one fresh subprocess per model after a one-image warm-up",
    "rss_fallback": "ru_maxrss growth during one batch forward, fresh subprocess per model (a lower bound: "
    "the peak counter could not be reset)",
    "profiler": "peak of live torch CPU tensor allocations during one batch forward (torch.profiler "
    "profile_memory events, running sum in time order), in process",
    "cuda": "torch.cuda.max_memory_allocated during one batch forward minus memory_allocated before it",
}


@dataclass(frozen=True)
class MemoryFigures:
    """Peak forward memory (:func:`measure_memory`): how each method measured, and per
    model its figures in bytes (``rss_growth``, ``profiler_peak``, ``cuda_growth``, ...)."""

    methods: dict[str, str] = field(default_factory=dict)  # per method, how it measures, in words
    models: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> JsonObject:
        """Its JSON: ``methods`` and ``models``."""
        return {"methods": self.methods, "models": self.models}


def measure_memory(
    probes: Probes,
    images: torch.Tensor,
    *,
    methods: tuple[str, ...],
    bf16: bool = False,
    parallel: int = 1,
) -> MemoryFigures:
    """Peak forward memory of each model by each of ``methods`` (``rss``, ``profiler``
    on CPU; ``cuda`` on a GPU): per method how it measures, per model its bytes."""
    out = MemoryFigures(models={name: {} for name in probes})
    for method in methods:
        if method == "rss":
            res = _cpu_memory(probes, images.cpu(), bf16, parallel)
            fallback = any("ru_maxrss" in r["method"] for r in res.values())
            out.methods["rss"] = MEMORY_METHODS["rss_fallback" if fallback else "rss"]
            for name, r in res.items():
                out.models[name].update(rss_growth=r["growth"], rss_before=r["rss_before"], rss_peak=r["peak_rss"])
        elif method == "profiler":
            res = _profiler_memory(probes, images, bf16)
            out.methods["profiler"] = MEMORY_METHODS["profiler"]
            for name, r in res.items():
                out.models[name].update(profiler_peak=r["growth"])
        elif method == "cuda":
            res = _cuda_memory(probes, images, bf16, images.device)
            out.methods["cuda"] = MEMORY_METHODS["cuda"]
            for name, r in res.items():
                out.models[name].update(
                    cuda_growth=r["growth"], cuda_peak=r["peak_allocated"], cuda_before=r["allocated_before"]
                )
        else:
            raise ValueError(f"unknown memory method {method!r}; expected rss, profiler or cuda")
        log.info("bench: memory measured by %s", method)
    return out
