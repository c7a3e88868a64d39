"""``splitvit bench``: SPLIT's forward speed, overhead and memory, measured side by side.

Every figure comes from one run on one machine; no figure is tuned to a target and
no timing is compared with a number measured elsewhere. The models compared:

* ``timm``: the plain timm ``VisionTransformer`` at full resolution (the baseline);
* ``split_full``: the same ViT wrapped in :class:`SplitViT` with the ``full`` policy
  (every node splits), i.e. our code path doing the same work as timm;
* ``learned_packed``: SplitViT with the ``learned`` policy (untrained: it only
  matters for speed) at thresholds calibrated to ``target_ratio`` of the full token
  count, on its default packed path (norms, linear layers and MLP on the real
  tokens only; attention grouped per image: on the CPU padded per length group);
* ``learned_padded_b1`` / ``learned_padded_b4``: the same model forced onto the
  padded path (``attention='padded'``: every block runs on the batch padded to the
  longest sequence, keys masked) with ``length_buckets`` 1 and 4, for comparison;
* ``entropy_packed``, ``entropy_padded_b1``, ``entropy_padded_b4``: the same with
  the ``entropy`` policy;
* ``policy_learned`` / ``policy_entropy``: ``model.split_scores(images)`` alone,
  the policy's share of a SplitViT forward pass;
* ``seq_full`` / ``seq_learned`` / ``seq_entropy``: the timm ViT's encoder
  (``norm_pre``, blocks, ``norm``, head) on fixed-length random token sequences of
  ``N_full`` and of the measured mean token count of each policy.

**Ideal speed-up.** For a policy that keeps a mean of ``n`` image tokens out of
``N_full``, the ideal forward speed-up is ``t_seq(N_full) / t_seq(n)``: the time the
same timm encoder (``norm_pre``, blocks, ``norm``, head; no patch embedding on
either side) takes on fixed-length random sequences of ``num_prefix + N_full``
tokens divided by its time on sequences of ``num_prefix + round(n)`` tokens, both
measured in this run. It is what a perfect mixed-scale ViT would reach: no policy,
no embedding of extra scales, no gather, no padding, no attention mask.

**Timing.** Under ``torch.inference_mode()`` (and bf16 autocast when asked), after
``warmup`` rounds, ``repeats`` rounds in which every model runs once, interleaved
(A, B, C, ... then ..., C, B, A) so that drift in clock speed or cache state falls
on all models alike; each figure is the median of its ``repeats`` timings, with
``torch.cuda.synchronize`` around each call on CUDA. The targets are judged on the
medians; the same ratios from each model's fastest round are reported beside them
as a check. On Linux the CPU time other processes used during the timing is
measured (``/proc/stat`` minus this process's CPU time) and a warning is added to
the result when they competed for the cores.

**Memory** (peak working memory of one batch forward pass, per model):

* ``cuda``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus ``memory_allocated`` before the pass, in process;
* ``rss`` (CPU): one fresh subprocess per model loads the pickled model and images,
  runs a one-image warm-up (lazy library initialisation), resets the kernel's
  peak-RSS counter (``/proc/self/clear_refs``) and reports the peak RSS
  (``VmHWM``) during one batch forward minus the RSS just before it; where the
  counter cannot be reset it falls back to ``ru_maxrss`` growth and says so;
* ``profiler`` (CPU): the peak of live torch tensor allocations during one batch
  forward, from ``torch.profiler``'s ``profile_memory`` allocation and free events
  summed in time order (exact for torch tensors, blind to allocator caching and
  library scratch memory; RSS sees those but also glibc's retained heap).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform as _stdlib_platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable

import timm
import torch
import torch.nn as nn

from .data.synthetic import SyntheticObjects
from .model import SplitViT
from .train.steps import calibrate_thresholds

log = logging.getLogger(__name__)

#: The project's targets: (a) SplitViT(full) overhead over timm, (b) speed-up at the
#: token budget over timm, (c) the policy's share of a SplitViT forward pass.
OVERHEAD_TARGET = 0.05
SPEEDUP_TARGET = 1.6
POLICY_SHARE_TARGET = 0.10
#: Warn when other processes used more than this many CPUs on average while timing.
OTHER_LOAD_WARNING = 0.25

_SPLIT_VARIANTS = ("learned", "entropy")


# ---------------------------------------------------------------------- models
def build_benchmark_models(
    *,
    model_name: str = "vit_tiny_patch16_224",
    image_size: int = 96,
    patch_size: int = 8,
    levels: int = 3,
    num_classes: int | None = None,
    timm_kwargs: dict[str, Any] | None = None,
    buckets: tuple[int, ...] = (1, 4),
    seed: int = 0,
) -> tuple[nn.Module, dict[str, SplitViT]]:
    """The plain timm ViT and the SplitViT variants that wrap it (sharing its weights).

    Returns ``(vit, models)`` with ``models`` keyed ``split_full``, ``{policy}_packed``
    (the default path) and ``{policy}_padded_b{b}`` (``attention='padded'``,
    ``length_buckets=b`` for each of ``buckets``) for each policy in
    :data:`_SPLIT_VARIANTS`; variants of one policy share the policy module, so they
    make identical decisions.
    """
    torch.manual_seed(seed)
    create: dict[str, Any] = {"patch_size": patch_size, "img_size": image_size, **(timm_kwargs or {})}
    if num_classes is not None:
        create["num_classes"] = num_classes
    vit = timm.create_model(model_name, pretrained=False, **create).eval()
    models: dict[str, SplitViT] = {
        "split_full": SplitViT.from_timm(vit, levels=levels, policy="full", image_size=image_size).eval()
    }
    for name in _SPLIT_VARIANTS:
        first = SplitViT(vit, levels=levels, policy=name, image_size=image_size).eval()
        models[f"{name}_packed"] = first
        for b in buckets:
            models[f"{name}_padded_b{b}"] = SplitViT(
                vit, levels=levels, policy=first.policy, image_size=image_size, length_buckets=b, attention="padded"
            ).eval()
    return vit, models


def benchmark_images(batch_size: int, image_size: int, seed: int = 0) -> torch.Tensor:
    """A batch of :class:`SyntheticObjects` images (an object among clutter): content
    with structure, so the entropy policy's decisions are those of a real image."""
    data = SyntheticObjects(batch_size, image_size=image_size, object_size=max(image_size // 8, 2), seed=seed)
    return torch.stack([data[i][0] for i in range(batch_size)])


def _encode_sequence(vit: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The timm ViT's encoder and head on an already-embedded sequence (no patch
    embedding, no mask): the cost a ViT pays for a sequence of this length."""
    x = vit.norm_pre(tokens)
    x = vit.blocks(x)
    x = vit.norm(x)
    return vit.forward_head(x)


# ---------------------------------------------------------------------- timing
def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (CUDA), or does nothing."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_beside_others(
    fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int, sync: Callable[[], None] = lambda: None,
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


def timing_summary(samples: list[float], cpu_samples: list[float], batch_size: int) -> dict[str, Any]:
    """One timed callable's figures: median/min/max seconds, images/s at the median,
    the raw samples, and the process CPU seconds per call."""
    median = statistics.median(samples)
    return {"median_s": median, "min_s": min(samples), "max_s": max(samples), "images_per_s": batch_size / median,
            "samples_s": samples, "cpu_median_s": statistics.median(cpu_samples), "cpu_samples_s": cpu_samples}


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
    gc.disable()
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


# ---------------------------------------------------------------------- memory
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


def _cpu_memory(models: dict[str, tuple[nn.Module, str]], images: torch.Tensor, bf16: bool, parallel: int) -> dict[str, dict]:
    """Run one fresh subprocess per model (at most ``parallel`` at once)."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="splitvit-bench-") as tmp:
        jobs = []
        for name, (model, kind) in models.items():
            path = Path(tmp) / f"{name}.pt"
            torch.save({"model": model, "images": images, "kind": kind, "bf16": bf16, "threads": torch.get_num_threads()}, path)
            jobs.append((name, path))
        running: list[tuple[str, subprocess.Popen]] = []

        def finish(name: str, proc: subprocess.Popen) -> None:
            _, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"memory probe for {name} failed ({proc.returncode}): {stderr.strip()[-2000:]}")
            results[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
            log.info("bench: memory of %s: %.1f MiB", name, results[name]["growth"] / 2**20)

        code = "import sys; from splitvit.bench import _memory_probe; _memory_probe(sys.argv[1])"
        for name, path in jobs:
            while len(running) >= max(parallel, 1):
                finish(*running.pop(0))
            proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            running.append((name, proc))
        for name, proc in running:
            finish(name, proc)
    return {name: results[name] for name in models}


def _cuda_memory(models: dict[str, tuple[nn.Module, str]], images: torch.Tensor, bf16: bool, device: torch.device) -> dict[str, dict]:
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


def _profiler_memory(models: dict[str, tuple[nn.Module, str]], images: torch.Tensor, bf16: bool) -> dict[str, dict]:
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


def measure_memory(
    probes: dict[str, tuple[nn.Module, str]], images: torch.Tensor, *, methods: tuple[str, ...], bf16: bool = False,
    parallel: int = 1,
) -> dict[str, Any]:
    """Peak forward memory of each model by each of ``methods`` (``rss``, ``profiler``
    on CPU; ``cuda`` on a GPU). Returns ``{"methods": {...}, "models": {name: {method: bytes}}}``."""
    out: dict[str, Any] = {"methods": {}, "models": {name: {} for name in probes}}
    for method in methods:
        if method == "rss":
            res = _cpu_memory(probes, images.cpu(), bf16, parallel)
            fallback = any("ru_maxrss" in r["method"] for r in res.values())
            out["methods"]["rss"] = MEMORY_METHODS["rss_fallback" if fallback else "rss"]
            for name, r in res.items():
                out["models"][name].update(rss_growth=r["growth"], rss_before=r["rss_before"], rss_peak=r["peak_rss"])
        elif method == "profiler":
            res = _profiler_memory(probes, images, bf16)
            out["methods"]["profiler"] = MEMORY_METHODS["profiler"]
            for name, r in res.items():
                out["models"][name].update(profiler_peak=r["growth"])
        elif method == "cuda":
            res = _cuda_memory(probes, images, bf16, images.device)
            out["methods"]["cuda"] = MEMORY_METHODS["cuda"]
            for name, r in res.items():
                out["models"][name].update(cuda_growth=r["growth"], cuda_peak=r["peak_allocated"],
                                           cuda_before=r["allocated_before"])
        else:
            raise ValueError(f"unknown memory method {method!r}; expected rss, profiler or cuda")
        log.info("bench: memory measured by %s", method)
    return out


# ---------------------------------------------------------------------- benchmark
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
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info(device: torch.device) -> dict[str, Any]:
    """What a benchmark ran on: CPUs, threads, versions, load, and the GPU's name."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "timm_version": timm.__version__,
        "python": _stdlib_platform.python_version(),
        "platform": _stdlib_platform.platform(),
        "processor": _cpu_model() or _stdlib_platform.processor() or _stdlib_platform.machine(),
        "device": str(device),
        "load_average_end": list(os.getloadavg()),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def _token_stats(out, full_tokens: int) -> dict[str, Any]:
    """Token counts and padding of one forward pass. ``padded_slots``: image-token
    slots the blocks' norms, linear layers and MLP processed; ``attention_slots``:
    those attention processed (they differ on the packed path, where only the CPU
    attention kernel pads)."""
    tokens = out.tokens.float()
    real = float(tokens.sum())
    attention_slots = int(out.extras.get("attention_slots", out.padded_tokens))
    return {
        "mean": float(tokens.mean()),
        "min": int(out.tokens.min()),
        "max": int(out.tokens.max()),
        "fraction": float(tokens.mean()) / full_tokens,
        "padded_slots": int(out.padded_tokens),
        "real_tokens": int(real),
        "padding_waste": (int(out.padded_tokens) - real) / real,
        "attention_slots": attention_slots,
        "attention_padding_waste": (attention_slots - real) / real,
    }


def run_forward_benchmark(
    batch_size: int = 64,
    image_size: int = 96,
    patch_size: int = 8,
    levels: int = 3,
    repeats: int = 10,
    device: str = "cpu",
    *,
    warmup: int = 2,
    model_name: str = "vit_tiny_patch16_224",
    timm_kwargs: dict[str, Any] | None = None,
    num_classes: int | None = None,
    target_ratio: float = 0.5,
    buckets: tuple[int, ...] = (1, 4),
    autocast_bf16: bool = False,
    memory: tuple[str, ...] | None = None,
    memory_parallel: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure SplitViT against the plain timm ViT, side by side in one run.

    Args:
        batch_size, image_size, patch_size, levels: the workload (``patch_size`` is
            the finest patch ``p``; the timm model is built with it).
        repeats: timed rounds (each model's figure is the median of its timings).
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        warmup: untimed rounds before timing.
        model_name, timm_kwargs, num_classes: the timm architecture (created with
            ``patch_size`` and ``img_size=image_size``; ``timm_kwargs`` override, e.g.
            a smaller ``embed_dim``/``depth`` for tests).
        target_ratio: token budget of the split policies as a fraction of ``N_full``,
            reached by :func:`calibrate_thresholds` on the benchmark images.
        buckets: ``length_buckets`` values of the padded-path variants, timed beside
            the default packed path (which the targets judge); ``()`` skips them.
        autocast_bf16: run every model under ``torch.autocast(dtype=bfloat16)``.
        memory: memory methods (see module doc): ``rss`` and/or ``profiler`` on CPU,
            ``cuda`` on a GPU; ``None`` picks ``("rss", "profiler")`` on CPU and
            ``("cuda",)`` on CUDA; ``()`` skips memory.
        memory_parallel: CPU RSS probes run at once (default: CPU count).
        seed: weights and images.

    Returns:
        A JSON-serialisable dict: ``config``, ``machine``, ``tokens`` (per model:
        mean/min/max tokens, fraction, padding waste), ``timings`` (per timed callable:
        median/min/max seconds, images per second, raw samples), ``ideal``,
        ``ratios``, ``memory``, ``checks`` and ``targets`` (each with value, bound and
        ``passed`` as measured).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if not 0.0 < target_ratio <= 1.0:
        raise ValueError(f"target_ratio must be in (0, 1], got {target_ratio}")
    if any(b < 1 for b in buckets):
        raise ValueError(f"buckets must be positive integers, got {buckets}")
    buckets = tuple(int(b) for b in buckets)
    sync = synchronizer(dev)
    load_start = list(os.getloadavg())

    vit, models = build_benchmark_models(
        model_name=model_name, image_size=image_size, patch_size=patch_size, levels=levels,
        num_classes=num_classes, timm_kwargs=timm_kwargs, buckets=buckets, seed=seed,
    )
    vit.to(dev)
    for m in models.values():
        m.to(dev)
    images = benchmark_images(batch_size, image_size, seed=seed).to(dev)
    geometry = models["split_full"].geometry
    full_tokens = geometry.full_tokens
    ref = "_packed"

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()

    # ---- operating points: calibrate thresholds, measure tokens and padding
    thresholds: dict[str, list[float]] = {}
    tokens: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(autocast())
        for policy in _SPLIT_VARIANTS:
            tau = calibrate_thresholds(models[policy + ref], images, target_ratio)
            thresholds[policy] = [float(t) for t in tau]
            for key in _variant_keys(policy, buckets):
                models[key].set_thresholds(tau)
            log.info("bench: %s thresholds %s", policy, thresholds[policy])
        timm_logits = vit(images)
        full_out = models["split_full"](images)
        full_diff = float((timm_logits.float() - full_out.logits.float()).abs().max())
        tokens["timm"] = {"mean": float(full_tokens), "min": full_tokens, "max": full_tokens, "fraction": 1.0,
                          "padded_slots": full_tokens * batch_size, "real_tokens": full_tokens * batch_size,
                          "padding_waste": 0.0, "attention_slots": full_tokens * batch_size,
                          "attention_padding_waste": 0.0}
        tokens["split_full"] = _token_stats(full_out, full_tokens)
        for policy in _SPLIT_VARIANTS:
            for key in _variant_keys(policy, buckets):
                tokens[key] = _token_stats(models[key](images), full_tokens)

    # ---- fixed-length sequences for the ideal ratio
    num_prefix = vit.num_prefix_tokens
    seq_lengths = {"seq_full": full_tokens}
    for policy in _SPLIT_VARIANTS:
        seq_lengths[f"seq_{policy}"] = max(1, round(tokens[policy + ref]["mean"]))
    gen = torch.Generator().manual_seed(seed + 1)
    sequences = {
        name: torch.randn(batch_size, num_prefix + n, vit.embed_dim, generator=gen).to(dev)
        for name, n in seq_lengths.items()
    }

    # ---- timing, interleaved
    fns: dict[str, Callable[[], Any]] = {"timm": lambda: vit(images)}
    for name, model in models.items():
        fns[name] = (lambda m: lambda: m(images))(model)
    for policy in _SPLIT_VARIANTS:
        fns[f"policy_{policy}"] = (lambda m: lambda: m.split_scores(images))(models[policy + ref])
    for name, seq in sequences.items():
        fns[name] = (lambda s: lambda: _encode_sequence(vit, s))(seq)
    log.info("bench: timing %d callables, %d warm-up + %d rounds", len(fns), warmup, repeats)
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(autocast())
        samples, cpu_samples, others_cores = time_beside_others(fns, repeats=repeats, warmup=warmup, sync=sync)
    timings = {
        name: timing_summary(s, cpu_samples[name], batch_size)
        for name, s in samples.items()
    }
    med = {name: t["median_s"] for name, t in timings.items()}

    # ---- ratios and the ideal (from medians; the same from each model's fastest round as a check)
    ideal = {}
    for policy in _SPLIT_VARIANTS:
        ideal[policy] = {
            "mean_tokens": tokens[policy + ref]["mean"],
            "sequence_tokens": seq_lengths[f"seq_{policy}"],
            "prefix_tokens": num_prefix,
            "full_tokens": full_tokens,
            "seq_full_s": med["seq_full"],
            "seq_split_s": med[f"seq_{policy}"],
            "ratio": med["seq_full"] / med[f"seq_{policy}"],
            "ratio_fastest": timings["seq_full"]["min_s"] / timings[f"seq_{policy}"]["min_s"],
            "ratio_cpu_time": timings["seq_full"]["cpu_median_s"] / timings[f"seq_{policy}"]["cpu_median_s"],
        }
    ratios = _ratios(med, buckets, ref)
    ratios_fastest = _ratios({name: t["min_s"] for name, t in timings.items()}, buckets, ref)
    ratios_cpu = _ratios({name: t["cpu_median_s"] for name, t in timings.items()}, buckets, ref)

    # ---- memory
    if memory is None:
        memory = ("cuda",) if dev.type == "cuda" else ("rss", "profiler")
    mem_result: dict[str, Any] = {}
    if memory:
        probes: dict[str, tuple[nn.Module, str]] = {"timm": (vit, "timm")}
        probes.update({name: (m, "split") for name, m in models.items()})
        log.info("bench: measuring memory of %d models by %s", len(probes), ", ".join(memory))
        mem_result = measure_memory(
            probes, images, methods=tuple(memory), bf16=autocast_bf16, parallel=memory_parallel or os.cpu_count() or 1
        )

    def per_round(num: str, den: str, offset: float = 0.0) -> list[float]:
        return [a / b + offset for a, b in zip(samples[num], samples[den])]

    targets = [
        make_target("a", "overhead of SplitViT(full) vs timm ViT", ratios["split_full_overhead"], "<=", OVERHEAD_TARGET,
                "percent", rounds=per_round("split_full", "timm", -1.0)),
    ]
    for policy in _SPLIT_VARIANTS:
        key = policy + ref
        targets.append(make_target(
            "b", f"{policy}@{tokens[key]['fraction']:.0%} tokens (packed): img/s vs timm ViT",
            ratios[f"{key}_speedup_vs_timm"], ">=", SPEEDUP_TARGET, "times",
            note=f"ideal {ideal[policy]['ratio']:.2f}x", rounds=per_round("timm", key),
        ))
    for policy in _SPLIT_VARIANTS:
        targets.append(make_target(
            "c", f"{policy} policy (split_scores) share of its SplitViT forward", ratios[f"policy_{policy}_share"],
            "<=", POLICY_SHARE_TARGET, "percent", rounds=per_round(f"policy_{policy}", policy + ref),
        ))

    warnings = []
    if others_cores is not None and others_cores > OTHER_LOAD_WARNING:
        warnings.append(
            f"other processes used {others_cores:.2f} of the {os.cpu_count()} CPUs on average while the models "
            f"were timed: wall-clock timings are noisy; see the fastest-round and CPU-time ratios, and rerun on an idle machine"
        )
    return {
        "config": {
            "model_name": model_name,
            "timm_kwargs": dict(timm_kwargs or {}),
            "embed_dim": int(vit.embed_dim),
            "depth": len(vit.blocks),
            "num_heads": int(vit.blocks[0].attn.num_heads) if hasattr(vit.blocks[0].attn, "num_heads") else None,
            "num_prefix_tokens": int(num_prefix),
            "num_classes": int(vit.num_classes),
            "batch_size": batch_size,
            "image_size": image_size,
            "patch_size": patch_size,
            "levels": levels,
            "coarse_patch_size": geometry.coarse_patch_size,
            "full_tokens": full_tokens,
            "min_tokens": geometry.min_tokens,
            "target_ratio": target_ratio,
            "buckets": list(buckets),
            "thresholds": thresholds,
            "repeats": repeats,
            "warmup": warmup,
            "autocast_bf16": autocast_bf16,
            "images": f"SyntheticObjects(seed={seed})",
            "seed": seed,
        },
        "machine": {**machine_info(dev), "load_average_start": load_start, "other_processes_cpus_during_timing": others_cores},
        "tokens": tokens,
        "timings": timings,
        "ideal": ideal,
        "ratios": ratios,
        "ratios_fastest": ratios_fastest,
        "ratios_cpu_time": ratios_cpu,
        "warnings": warnings,
        "memory": mem_result,
        "checks": {"split_full_vs_timm_max_abs_logit_diff": full_diff},
        "targets": targets,
        "ideal_definition": (
            "t(N_full)/t(n): the timm encoder (norm_pre, blocks, norm, head) on fixed-length random "
            "sequences of num_prefix+N_full vs num_prefix+round(mean tokens) tokens, same run"
        ),
    }


def _variant_keys(policy: str, buckets: tuple[int, ...]) -> list[str]:
    """Model keys of one policy: the packed path, then the padded variants."""
    return [f"{policy}_packed"] + [f"{policy}_padded_b{b}" for b in buckets]


def _ratios(times: dict[str, float], buckets: tuple[int, ...], ref: str) -> dict[str, float]:
    """Overhead, speed-ups (images per second ratios), efficiency against the ideal,
    and policy shares, from one figure per timed callable."""
    out = {"split_full_overhead": times["split_full"] / times["timm"] - 1.0}
    for policy in _SPLIT_VARIANTS:
        ideal = times["seq_full"] / times[f"seq_{policy}"]
        for key in _variant_keys(policy, buckets):
            out[f"{key}_speedup_vs_timm"] = times["timm"] / times[key]
            out[f"{key}_speedup_vs_split_full"] = times["split_full"] / times[key]
            out[f"{key}_efficiency"] = (times["timm"] / times[key]) / ideal
        out[f"policy_{policy}_share"] = times[f"policy_{policy}"] / times[policy + ref]
    return out


def make_target(
    key: str, what: str, value: float, op: str, bound: float, unit: str, note: str = "", rounds: list[float] | None = None
) -> dict[str, Any]:
    """One target, judged on ``value`` (a ratio of medians). ``rounds`` are the same
    ratio within each interleaved round; their quartiles show how well one run
    resolves the figure."""
    passed = value <= bound if op == "<=" else value >= bound
    out = {"key": key, "what": what, "value": value, "op": op, "bound": bound, "unit": unit, "passed": bool(passed), "note": note}
    if rounds:
        q = statistics.quantiles(rounds, n=4, method="inclusive") if len(rounds) > 1 else [rounds[0]] * 3
        out["per_round"] = {"median": statistics.median(rounds), "q1": q[0], "q3": q[2], "values": rounds}
    return out


# ---------------------------------------------------------------------- report
_LABELS = {
    "timm": "timm ViT (full res)",
    "split_full": "SplitViT full",
    "policy_learned": "learned split_scores",
    "policy_entropy": "entropy split_scores",
    "seq_full": "timm encoder, fixed N_full",
    "seq_learned": "timm encoder, fixed n(learned)",
    "seq_entropy": "timm encoder, fixed n(entropy)",
}


def _label(name: str) -> str:
    if name in _LABELS:
        return _LABELS[name]
    if name.endswith("_packed"):
        return f"SplitViT {name.removesuffix('_packed')} packed"
    policy, _, b = name.rpartition("_padded_b")
    return f"SplitViT {policy} padded buckets={b}"


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header and a rule, as lines."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return lines


def format_value(t: dict[str, Any]) -> str:
    """A target's measured value as the report prints it."""
    return f"{t['value']:+.1%}" if t["unit"] == "percent" and t["key"] == "a" else (
        f"{t['value']:.1%}" if t["unit"] == "percent" else f"{t['value']:.2f}x")


def format_spread(t: dict[str, Any]) -> str:
    """Interquartile range of the per-round ratio, in the target's unit."""
    if "per_round" not in t:
        return ""
    q1, q3 = t["per_round"]["q1"], t["per_round"]["q3"]
    if t["unit"] == "percent":
        sign = "+" if t["key"] == "a" else ""
        return f"{q1:{sign}.1%} .. {q3:{sign}.1%}"
    return f"{q1:.2f}x .. {q3:.2f}x"


def format_bound(t: dict[str, Any]) -> str:
    """A target's bound as the report prints it (``<= 5%``, ``>= 1.6x``)."""
    return f"{t['op']} {t['bound']:.0%}" if t["unit"] == "percent" else f"{t['op']} {t['bound']:.2g}x"


def _ratio_line(ratios: dict[str, float], ideal: dict[str, dict], ideal_key: str) -> str:
    return (
        f"a {ratios['split_full_overhead']:+.1%}; b "
        + ", ".join(f"{k.removesuffix('_speedup_vs_timm')} {v:.2f}x" for k, v in ratios.items() if k.endswith("_speedup_vs_timm"))
        + " (ideal " + ", ".join(f"{p} {i[ideal_key]:.2f}x" for p, i in ideal.items())
        + "); c " + ", ".join(f"{p} {ratios[f'policy_{p}_share']:.1%}" for p in ideal)
    )


def format_report(result: dict[str, Any]) -> str:
    """A readable report of :func:`run_forward_benchmark`'s result, targets marked
    PASS or MISS as measured."""
    cfg, mach, tok, tim = result["config"], result["machine"], result["tokens"], result["timings"]
    lines = [
        f"SPLIT forward benchmark: {mach['device']}{' (' + mach['device_name'] + ')' if 'device_name' in mach else ''}, "
        f"{mach['cpu_count']} CPUs ({mach['processor']}), {mach['torch_threads']} torch threads, torch {mach['torch_version']}, timm {mach['timm_version']}, "
        f"{'bf16 autocast' if cfg['autocast_bf16'] else 'fp32'}; other processes used "
        + (f"{mach['other_processes_cpus_during_timing']:.2f}" if mach.get("other_processes_cpus_during_timing") is not None else "?")
        + f" CPUs while timing (1-min load average {mach['load_average_start'][0]:.2f} at start, "
        f"{mach['load_average_end'][0]:.2f} at end)",
        f"model {cfg['model_name']} (dim {cfg['embed_dim']}, depth {cfg['depth']}, heads {cfg['num_heads']}), "
        f"{cfg['image_size']} px, p={cfg['patch_size']}, L={cfg['levels']} (P={cfg['coarse_patch_size']}), "
        f"N_full={cfg['full_tokens']}, N_min={cfg['min_tokens']}, batch {cfg['batch_size']}",
        f"median of {cfg['repeats']} interleaved rounds after {cfg['warmup']} warm-up; inference_mode; "
        f"policies calibrated to {cfg['target_ratio']:.0%} tokens on the batch "
        + ", ".join(f"{p} tau={t[0]:.4g}" for p, t in cfg["thresholds"].items()),
        "",
    ]
    base = tim["timm"]["median_s"]
    rows = []
    for name, t in tim.items():
        k = tok.get(name)
        rows.append([
            _label(name),
            f"{k['mean']:.1f}" if k else "",
            f"{k['min']}-{k['max']}" if k else "",
            f"{k['fraction']:.3f}" if k else "",
            f"{k['padding_waste']:.1%}" if k else "",
            f"{k['attention_padding_waste']:.1%}" if k else "",
            f"{t['median_s'] * 1e3:.1f}",
            f"{t['min_s'] * 1e3:.1f}-{t['max_s'] * 1e3:.1f}",
            f"{t['images_per_s']:.1f}",
            f"{base / t['median_s']:.2f}x",
        ])
    lines += text_table(["model", "tokens/img", "min-max", "fraction", "pad waste", "attn pad", "ms/batch", "min-max ms", "img/s",
                     "speed vs timm"], rows)
    lines.append("pad waste = (padded slots - real tokens) / real tokens in the norms, linear layers and MLP "
                 "(SplitOutput.padded_tokens); attn pad = the same in attention (the packed path's CPU kernel pads "
                 "per length group)")
    lines.append("")
    lines.append("ideal speed-up = " + result["ideal_definition"])
    for policy, i in result["ideal"].items():
        lines.append(
            f"  {policy}: mean {i['mean_tokens']:.1f} of {i['full_tokens']} tokens -> sequences of {i['prefix_tokens']}+{i['sequence_tokens']} "
            f"vs {i['prefix_tokens']}+{i['full_tokens']}: {i['seq_full_s'] * 1e3:.1f} / {i['seq_split_s'] * 1e3:.1f} ms = {i['ratio']:.2f}x"
        )
    lines.append(f"check: SplitViT(full) vs timm max |logit diff| = {result['checks']['split_full_vs_timm_max_abs_logit_diff']:.3g}")
    lines.append("")
    rows = [
        [t["key"], t["what"], format_value(t), format_bound(t), "PASS" if t["passed"] else "MISS", format_spread(t), t["note"]]
        for t in result["targets"]
    ]
    lines += text_table(["", "target", "measured", "bound", "", "per-round IQR", "note"], rows)
    lines.append("checks on the medians above, the same ratios")
    lines.append("  from each model's fastest round: " + _ratio_line(result["ratios_fastest"], result["ideal"], "ratio_fastest"))
    lines.append("  from median process CPU time (all threads; immune to time-slicing, counts OpenMP spin-waits): "
                 + _ratio_line(result["ratios_cpu_time"], result["ideal"], "ratio_cpu_time"))
    for warning in result.get("warnings", []):
        lines.append(f"WARNING: {warning}")
    mem = result.get("memory") or {}
    if mem.get("models"):
        lines.append("")
        lines.append("d. peak memory of one batch forward pass (MiB; ratio to the timm ViT):")
        columns = [(key, label) for key, label in (
            ("rss_growth", "rss"), ("profiler_peak", "profiler"), ("cuda_growth", "cuda")) if label in mem["methods"]]
        base_mem = mem["models"].get("timm", {})
        rows = []
        for name, m in mem["models"].items():
            row = [_label(name)]
            for key, _ in columns:
                ratio = f" ({m[key] / base_mem[key]:.2f}x)" if base_mem.get(key) else ""
                row.append(f"{m[key] / 2**20:.1f}{ratio}")
            rows.append(row)
        lines += text_table(["model"] + [label for _, label in columns], rows)
        for method, text in mem["methods"].items():
            lines.append(f"  {method}: {text}")
    return "\n".join(lines)
