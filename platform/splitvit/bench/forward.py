"""``splitvit bench``: SPLIT's forward speed, where its time goes, and memory, side by side.

Every figure comes from one run on one machine; no figure is tuned to a target and
no timing is compared with a number measured elsewhere. The workload is any timm
``VisionTransformer`` (default ``vit_base_patch16_224`` at its own 224 px, 16-px
fine patches and a 2-level quadtree of 32-px coarse patches; :func:`benchmark_vit`),
with random weights: speed does not depend on them. Timed, interleaved:

* ``timm``: the plain timm ViT at full resolution (the baseline);
* ``split_full``: the same ViT wrapped in :class:`SplitViT` with the ``full`` policy
  (every node splits), i.e. our code path doing the same work as timm;
* one **operating point** per policy and token ratio (``learned@0.50``): the policy's
  thresholds calibrated on the benchmark images to that share of ``N_full``, on
  the default packed path. Policies: ``learned`` (SPLIT's policy with narrow blocks
  of its own, ``policy_width``), ``learned_shared`` (the policy on the ViT's first
  ``policy_depth`` blocks) and ``entropy`` (APT-style); untrained learned policies
  are as fast as trained ones;
* per point, ``.../encoder``: :meth:`SplitViT.encode` alone on the point's gathered
  leaves; per policy, ``policy/...``: ``split_scores`` alone; optionally
  ``.../padded_b{b}``: the padded path with ``length_buckets=b``;
* ``seq/{n}``: the timm ViT's encoder (``norm_pre``, blocks, ``norm``, head) on
  fixed-length random token sequences of ``N_full`` and of each point's mean count.

**Ideal speed-up.** For a point that keeps a mean of ``n`` image tokens out of
``N_full``: ``t_seq(N_full) / t_seq(n)``, both measured in this run. It is what a
perfect mixed-scale ViT would reach: no policy, no embedding of extra scales, no
gather, no padding, no attention mask.

**Where the time goes** (per point, from medians): the policy (``split_scores``);
embedding, gather and head (the forward pass minus policy and encoder); attention
kernel and packing (the encoder minus the fixed-length blocks of the same mean
length); and the blocks themselves. Time outside the ViT blocks is the forward pass
minus the encoder.

**Timing.** Under ``torch.inference_mode()`` (and bf16 autocast when asked), after
``warmup`` rounds, ``repeats`` rounds in which every callable runs once, interleaved
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
import math
import os
import platform as _stdlib_platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import timm
import torch
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

from ..data.synthetic import SyntheticObjects
from ..model import SplitViT
from ..train.steps import calibrate_thresholds

log = logging.getLogger(__name__)

#: The project's targets: (a) SplitViT(full) overhead over timm; (b) the learned
#: policy's speed-up over timm at a token ratio (CPU: ViT-B/16 at 224 px, batch 8;
#: GPU: bf16, batch 256); (c) its time outside the ViT blocks.
OVERHEAD_TARGET = 0.05
CPU_SPEEDUP_TARGETS = {0.5: 1.85, 0.7: 1.38}
GPU_SPEEDUP_TARGETS = {0.5: 1.6}
OUTSIDE_BLOCKS_TARGET = 0.05
#: Warn when other processes used more than this many CPUs on average while timing.
OTHER_LOAD_WARNING = 0.25

DEFAULT_MODEL = "vit_base_patch16_224"
#: The learned policy's own blocks in the benchmark: narrow beside a ViT-B (768).
DEFAULT_POLICY_WIDTH = 192
#: ``learned``: the policy with blocks of its own (``policy_width``); ``learned_shared``:
#: the policy on the ViT's first ``policy_depth`` blocks; ``entropy``: APT-style.
BENCH_POLICIES = ("learned", "learned_shared", "entropy")


# ---------------------------------------------------------------------- models
def benchmark_vit(
    model_name: str = DEFAULT_MODEL,
    *,
    image_size: int | None = None,
    patch_size: int | None = None,
    levels: int | None = None,
    timm_kwargs: dict[str, Any] | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> tuple[VisionTransformer, int]:
    """The timm ViT to benchmark (random weights) and the quadtree's levels.

    Image and patch size default to the model's own; ``levels`` defaults to the
    deepest quadtree (3, else 2) whose coarsest patch divides the image, e.g. 2 levels
    (32-px coarse patches over 16-px fine ones) for ViT-B/16 at 224 px.

    Raises:
        ValueError: naming ``--model`` for a name timm does not know or a model that
            is not a ``VisionTransformer``, ``--image-size`` when no quadtree fits.
    """
    create: dict[str, Any] = dict(timm_kwargs or {})
    for key, value in (("img_size", image_size), ("patch_size", patch_size), ("num_classes", num_classes)):
        if value is not None:
            create[key] = value
    torch.manual_seed(seed)
    try:
        vit = timm.create_model(model_name, pretrained=False, **create).eval()
    except RuntimeError as exc:  # timm: "Unknown model (...)"
        raise ValueError(f"--model {model_name!r}: {exc}") from None
    if not isinstance(vit, VisionTransformer):
        raise ValueError(f"--model {model_name!r} is a {type(vit).__name__}, not a timm VisionTransformer")
    size, patch = vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0]
    if levels is None:
        levels = next((n for n in (3, 2) if size % (patch * 2 ** (n - 1)) == 0), 0)
        if not levels:
            raise ValueError(f"--image-size {size} is not a multiple of twice the {patch}-px patch: no quadtree fits")
    return vit, levels


def build_benchmark_models(
    vit: VisionTransformer,
    *,
    levels: int,
    policies: tuple[str, ...] = BENCH_POLICIES,
    policy_width: int | None = DEFAULT_POLICY_WIDTH,
    policy_depth: int = 2,
    buckets: tuple[int, ...] = (),
    token_buckets: int = 0,
) -> dict[str, SplitViT]:
    """The SplitViT variants that wrap ``vit`` (sharing its weights), in eval mode.

    Keys: ``split_full`` (the ``full`` policy: timm's own work), each of ``policies``
    (the default packed path; see :data:`BENCH_POLICIES`), and ``{policy}_padded_b{b}``
    (``attention='padded'``, ``length_buckets=b``) for each of ``buckets``, sharing
    the policy module of the packed model (identical decisions).
    """
    models: dict[str, SplitViT] = {"split_full": SplitViT(vit, levels=levels, policy="full").eval()}
    for key in policies:
        name = "learned" if key.startswith("learned") else key
        width = policy_width if key == "learned" else None
        first = SplitViT(vit, levels=levels, policy=name, policy_depth=policy_depth, policy_width=width,
                         token_buckets=token_buckets).eval()
        models[key] = first
        for b in buckets:
            models[f"{key}_padded_b{b}"] = SplitViT(
                vit, levels=levels, policy=first.policy, policy_depth=policy_depth, length_buckets=b, attention="padded"
            ).eval()
    return models


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

        code = "import sys; from splitvit.bench.forward import _memory_probe; _memory_probe(sys.argv[1])"
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


def _full_token_stats(full_tokens: int, batch_size: int) -> dict[str, Any]:
    slots = full_tokens * batch_size
    return {"mean": float(full_tokens), "min": full_tokens, "max": full_tokens, "fraction": 1.0, "padded_slots": slots,
            "real_tokens": slots, "padding_waste": 0.0, "attention_slots": slots, "attention_padding_waste": 0.0}


def point_key(policy: str, ratio: float) -> str:
    """The key of one operating point (a policy at a target token ratio): ``learned@0.50``."""
    return f"{policy}@{ratio:.2f}"


def _speed_targets(device: torch.device) -> dict[float, float]:
    return GPU_SPEEDUP_TARGETS if device.type == "cuda" else CPU_SPEEDUP_TARGETS


def run_forward_benchmark(
    model_name: str = DEFAULT_MODEL,
    image_size: int | None = None,
    patch_size: int | None = None,
    levels: int | None = None,
    batch_size: int = 8,
    ratios: tuple[float, ...] = (0.5, 0.7),
    policies: tuple[str, ...] = BENCH_POLICIES,
    *,
    policy_width: int | None = DEFAULT_POLICY_WIDTH,
    policy_depth: int = 2,
    buckets: tuple[int, ...] = (),
    token_buckets: int = 0,
    compile: bool = False,
    repeats: int = 10,
    warmup: int = 2,
    device: str = "cpu",
    autocast_bf16: bool = False,
    memory: tuple[str, ...] | None = None,
    memory_parallel: int | None = None,
    timm_kwargs: dict[str, Any] | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure SplitViT against the plain timm ViT, side by side in one run.

    Args:
        model_name, image_size, patch_size, levels, timm_kwargs, num_classes: the
            workload (see :func:`benchmark_vit`); sizes default to the model's own.
        batch_size: images per forward pass.
        ratios: token budgets (fractions of ``N_full``) at which every split policy is
            timed, its thresholds calibrated on the benchmark images.
        policies: split policies to time (:data:`BENCH_POLICIES`).
        policy_width, policy_depth: the learned policy's blocks (``learned``: its own
            blocks of ``policy_width``; ``learned_shared``: the ViT's first
            ``policy_depth`` blocks).
        buckets: ``length_buckets`` of padded-path variants timed beside each point
            (the default packed path is what the targets judge); ``()``: none.
        token_buckets: the split policies' packed sizes rounded up to this many fixed
            sizes (``SplitViT(token_buckets=...)``); ``0``: exact sizes.
        compile: ``torch.compile`` the timm ViT, the fixed-length encoder of the ideal
            and the split policies' packed encoders (:meth:`SplitViT.compile_encoder`,
            CUDA graphs on a GPU); pair it with ``token_buckets``. SplitViT(full) stays
            eager, so the overhead target means nothing under it.
        repeats, warmup: timed and untimed interleaved rounds.
        device, autocast_bf16: where and in which precision.
        memory: ``rss`` and/or ``profiler`` on CPU, ``cuda`` on a GPU; ``None``: the
            device's default; ``()``: no memory figures.
        memory_parallel: CPU RSS probes run at once (default: CPU count).
        seed: weights and images.

    Returns:
        A JSON-serialisable dict: ``config``, ``machine``, ``timings`` (per timed
        callable), ``points`` (one entry per policy and ratio, with ``token_ratio``,
        ``speedup_vs_timm``, ``ideal_speedup`` and the time breakdown),
        ``overhead``, ``memory``, ``checks``, ``targets`` (value, bound, ``passed`` as
        measured) and ``warnings``.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    ratios = tuple(float(r) for r in ratios)
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"ratios must be token fractions in (0, 1], got {list(ratios)}")
    unknown = [p for p in policies if p not in BENCH_POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies: unknown {unknown or 'none given'}; expected some of {', '.join(BENCH_POLICIES)}")
    if policy_width is None:
        policies = tuple(p for p in policies if p != "learned_shared") or ("learned",)  # both would be the same model
    if any(b < 1 for b in buckets):
        raise ValueError(f"buckets must be positive integers, got {buckets}")
    buckets = tuple(int(b) for b in buckets)
    sync = synchronizer(dev)
    load_start = list(os.getloadavg())

    vit, levels = benchmark_vit(model_name, image_size=image_size, patch_size=patch_size, levels=levels,
                                timm_kwargs=timm_kwargs, num_classes=num_classes, seed=seed)
    models = build_benchmark_models(vit, levels=levels, policies=policies, policy_width=policy_width,
                                    policy_depth=policy_depth, buckets=buckets, token_buckets=token_buckets)
    vit.to(dev)
    for m in models.values():
        m.to(dev)
    runners = _compiled_runners(vit, models, policies, dev) if compile else {"timm": vit, "sequence": _encode_sequence}
    size = models["split_full"].geometry.image_size[0]
    images = benchmark_images(batch_size, size, seed=seed).to(dev)
    geometry = models["split_full"].geometry
    full_tokens = geometry.full_tokens

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()

    with torch.inference_mode(), autocast():
        points, encoder_inputs, full_diff = _operating_points(vit, models, images, policies, ratios, buckets)
    fns = _timed_callables(vit, models, images, points, encoder_inputs, buckets, full_tokens, seed, runners)
    log.info("bench: timing %d callables, %d warm-up + %d rounds", len(fns), warmup, repeats)
    with torch.inference_mode(), autocast():
        samples, cpu_samples, others_cores = time_beside_others(fns, repeats=repeats, warmup=warmup, sync=sync)
    timings = {name: timing_summary(s, cpu_samples[name], batch_size) for name, s in samples.items()}
    for point in points.values():
        _summarise_point(point, timings, buckets)
    overhead = timings["split_full"]["median_s"] / timings["timm"]["median_s"] - 1.0

    if memory is None:
        memory = ("cuda",) if dev.type == "cuda" else ("rss", "profiler")
    mem_result: dict[str, Any] = {}
    if memory:
        mem_result = _point_memory(vit, models, images, points, ratios[0], tuple(memory), autocast_bf16,
                                   memory_parallel or os.cpu_count() or 1)

    targets = _forward_targets(points, samples, overhead, _speed_targets(dev))
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
            "num_prefix_tokens": int(vit.num_prefix_tokens),
            "num_classes": int(vit.num_classes),
            "batch_size": batch_size,
            "image_size": size,
            "patch_size": geometry.patch_size,
            "levels": levels,
            "coarse_patch_size": geometry.coarse_patch_size,
            "full_tokens": full_tokens,
            "min_tokens": geometry.min_tokens,
            "ratios": list(ratios),
            "policies": list(policies),
            "policy_width": policy_width,
            "policy_depth": policy_depth,
            "buckets": list(buckets),
            "token_buckets": token_buckets,
            "compile": compile,
            "repeats": repeats,
            "warmup": warmup,
            "autocast_bf16": autocast_bf16,
            "images": f"SyntheticObjects(seed={seed})",
            "seed": seed,
        },
        "machine": {**machine_info(dev), "load_average_start": load_start, "other_processes_cpus_during_timing": others_cores},
        "timings": timings,
        "points": list(points.values()),
        "overhead": {"split_full_vs_timm": overhead,
                     "fastest": timings["split_full"]["min_s"] / timings["timm"]["min_s"] - 1.0},
        "warnings": warnings,
        "memory": mem_result,
        "checks": {"split_full_vs_timm_max_abs_logit_diff": full_diff},
        "targets": targets,
        "ideal_definition": (
            "t(N_full)/t(n): the timm encoder (norm_pre, blocks, norm, head) on fixed-length random "
            "sequences of num_prefix+N_full vs num_prefix+round(mean tokens) tokens, same run"
        ),
        "breakdown_definition": (
            "policy = split_scores alone (the level embeddings it needs and the policy); "
            "embedding+gather+head = forward - policy - encoder; encoder = SplitViT.encode on the gathered leaves "
            "(packing, blocks, attention kernel, norm); attention+packing = encoder - fixed-length blocks of the "
            "same mean length; outside the blocks = forward - encoder"
        ),
    }


def _operating_points(vit, models, images, policies, ratios, buckets):
    """Calibrate every policy to every ratio on the benchmark images; token figures
    per point, the encoder's inputs at each point, and the full policy's logit
    difference to timm."""
    full_tokens = models["split_full"].geometry.full_tokens
    points: dict[str, dict[str, Any]] = {}
    inputs: dict[str, tuple] = {}
    for policy in policies:
        model = models[policy]
        for ratio in ratios:
            key = point_key(policy, ratio)
            tau = [float(t) for t in calibrate_thresholds(model, images, ratio)]
            stats = _token_stats(model(images, thresholds=tau), full_tokens)
            padded = {b: _token_stats(models[f"{policy}_padded_b{b}"](images, thresholds=tau), full_tokens) for b in buckets}
            points[key] = {"key": key, "policy": policy, "target_ratio": ratio, "thresholds": tau,
                           "token_ratio": stats["fraction"], "tokens": stats,
                           "padded_tokens": {f"b{b}": t for b, t in padded.items()}}
            inputs[key] = model.encoder_inputs(images, thresholds=tau)
            log.info("bench: %s thresholds %s, %.1f tokens per image", key, tau, stats["mean"])
    diff = float((vit(images).float() - models["split_full"](images).logits.float()).abs().max())
    return points, inputs, diff


def _compiled_runners(vit, models, policies, device) -> dict[str, Callable]:
    """``torch.compile`` for every side alike: timm's ViT, the ideal's encoder, and the
    split policies' packed encoders (CUDA graphs on a GPU)."""
    options: dict[str, Any] = {"dynamic": False}
    if device.type == "cuda":
        options["mode"] = "reduce-overhead"
    for policy in policies:
        models[policy].compile_encoder(**options)
    return {"timm": torch.compile(vit, **options), "sequence": torch.compile(_encode_sequence, **options)}


def _timed_callables(vit, models, images, points, encoder_inputs, buckets, full_tokens, seed, runners):
    """Everything timed in one interleaved run: timm, SplitViT(full), per point the
    forward pass and the encoder alone, per policy its scores alone, and the timm
    encoder on fixed-length sequences of every point's mean length (the ideal)."""
    num_prefix, dim = vit.num_prefix_tokens, vit.embed_dim
    batch = images.shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = sorted({full_tokens, *(max(1, round(p["tokens"]["mean"])) for p in points.values())}, reverse=True)
    sequences = {n: torch.randn(batch, num_prefix + n, dim, generator=gen).to(images.device) for n in lengths}
    timm_vit, encode = runners["timm"], runners["sequence"]
    fns: dict[str, Callable[[], Any]] = {"timm": lambda: timm_vit(images), "split_full": lambda: models["split_full"](images)}
    for n, seq in sequences.items():
        fns[f"seq/{n}"] = (lambda s: lambda: encode(vit, s))(seq)
    for policy in dict.fromkeys(p["policy"] for p in points.values()):
        fns[f"policy/{policy}"] = (lambda m: lambda: m.split_scores(images))(models[policy])
    for key, point in points.items():
        model, tau = models[point["policy"]], point["thresholds"]
        fns[key] = (lambda m, t: lambda: m(images, thresholds=t))(model, tau)
        fns[f"{key}/encoder"] = (lambda m, args: lambda: m.encode(*args))(model, encoder_inputs[key])
        for b in buckets:
            padded = models[f"{point['policy']}_padded_b{b}"]
            fns[f"{key}/padded_b{b}"] = (lambda m, t: lambda: m(images, thresholds=t))(padded, tau)
    return fns


def _summarise_point(point: dict[str, Any], timings: dict[str, dict], buckets: tuple[int, ...]) -> None:
    """Speed-ups, the ideal, and where the time goes, from the medians (in place)."""
    key, full_tokens = point["key"], round(point["tokens"]["mean"] / point["tokens"]["fraction"])
    med = {name: t["median_s"] for name, t in timings.items()}
    n = max(1, round(point["tokens"]["mean"]))
    total, policy, encoder, blocks = med[key], med[f"policy/{point['policy']}"], med[f"{key}/encoder"], med[f"seq/{n}"]
    point.update(
        images_per_s=timings[key]["images_per_s"],
        speedup_vs_timm=med["timm"] / total,
        ideal_speedup=med[f"seq/{full_tokens}"] / blocks,
        sequence_tokens=n,
        speedup_fastest=timings["timm"]["min_s"] / timings[key]["min_s"],
        speedup_cpu_time=timings["timm"]["cpu_median_s"] / timings[key]["cpu_median_s"],
        breakdown_s={
            "forward": total,
            "policy": policy,
            "embedding_gather_head": total - policy - encoder,
            "attention_packing": encoder - blocks,
            "blocks_fixed_length": blocks,
        },
        outside_blocks_share=(total - encoder) / total,
        padded_speedup_vs_timm={f"b{b}": med["timm"] / med[f"{key}/padded_b{b}"] for b in buckets},
    )
    point["efficiency"] = point["speedup_vs_timm"] / point["ideal_speedup"]


def _point_memory(vit, models, images, points, ratio, methods, bf16, parallel) -> dict[str, Any]:
    """Peak forward memory of timm, SplitViT(full) and each policy at ``ratio``."""
    probes: dict[str, tuple[nn.Module, str]] = {"timm": (vit, "timm"), "split_full": (models["split_full"], "split")}
    for point in points.values():
        if point["target_ratio"] == ratio:
            model = models[point["policy"]]
            model.set_thresholds(point["thresholds"])  # the probe runs the model with its own thresholds
            probes[point["key"]] = (model, "split")
    log.info("bench: measuring memory of %d models by %s", len(probes), ", ".join(methods))
    return measure_memory(probes, images, methods=methods, bf16=bf16, parallel=parallel)


def _forward_targets(points, samples, overhead: float, speed_bounds: dict[float, float]) -> list[dict[str, Any]]:
    """The targets, judged on medians, for the learned policy (the product): speed-up
    at the ratios that have a bound on this device, and its time outside the blocks."""

    def per_round(num: str, den: str, offset: float = 0.0) -> list[float]:
        return [a / b + offset for a, b in zip(samples[num], samples[den])]

    targets = [make_target("a", "overhead of SplitViT(full) vs timm ViT", overhead, "<=", OVERHEAD_TARGET, "percent",
                           rounds=per_round("split_full", "timm", -1.0))]
    for point in points.values():
        if point["policy"] != "learned":
            continue
        key, ratio = point["key"], point["target_ratio"]
        bound = next((b for r, b in speed_bounds.items() if math.isclose(r, ratio)), None)
        if bound is not None:
            targets.append(make_target(
                "b", f"learned@{point['token_ratio']:.0%} tokens: img/s vs timm ViT", point["speedup_vs_timm"], ">=", bound,
                "times", note=f"ideal {point['ideal_speedup']:.2f}x", rounds=per_round("timm", key)))
        targets.append(make_target(
            "c", f"learned@{point['token_ratio']:.0%} tokens: time outside the ViT blocks", point["outside_blocks_share"],
            "<=", OUTSIDE_BLOCKS_TARGET, "percent",
            rounds=[(t - e) / t for t, e in zip(samples[key], samples[f"{key}/encoder"])]))
    return targets


def make_target(
    key: str, what: str, value: float, op: str, bound: float, unit: str, note: str = "", rounds: list[float] | None = None
) -> dict[str, Any]:
    """One target, judged on ``value`` (a ratio of medians). ``rounds`` are the same
    ratio within each interleaved round; their quartiles show how well one run
    resolves the figure."""
    passed = value <= bound if op == "<=" else value >= bound
    out = {"key": key, "what": what, "value": value, "op": op, "bound": bound, "unit": unit, "passed": bool(passed), "note": note}
    if rounds:
        out["per_round"] = {**quartiles(rounds), "values": rounds}
    return out


def quartiles(values: list[float]) -> dict[str, float]:
    """Median and quartiles of per-round figures: how well one run resolves a ratio."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


# ---------------------------------------------------------------------- report
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
    return f"{t['op']} {t['bound']:.0%}" if t["unit"] == "percent" else f"{t['op']} {t['bound']:.3g}x"


def _timing_label(name: str) -> str:
    if name == "timm":
        return "timm ViT (full res)"
    if name == "split_full":
        return "SplitViT full"
    if name.startswith("seq/"):
        return f"timm encoder, fixed {name[4:]} tokens"
    if name.startswith("policy/"):
        return f"{name[7:]} split_scores"
    key, _, part = name.partition("/")
    return f"SplitViT {key}" + (f" {part.replace('_b', ' buckets=')}" if part else "")


def format_report(result: dict[str, Any]) -> str:
    """A readable report of :func:`run_forward_benchmark`'s result, targets marked
    PASS or MISS as measured."""
    cfg, mach, tim = result["config"], result["machine"], result["timings"]
    others = mach.get("other_processes_cpus_during_timing")
    lines = [
        f"SPLIT forward benchmark: {mach['device']}{' (' + mach['device_name'] + ')' if 'device_name' in mach else ''}, "
        f"{mach['cpu_count']} CPUs ({mach['processor']}), {mach['torch_threads']} torch threads, torch {mach['torch_version']}, "
        f"timm {mach['timm_version']}, {'bf16 autocast' if cfg['autocast_bf16'] else 'fp32'}; other processes used "
        + (f"{others:.2f}" if others is not None else "?")
        + f" CPUs while timing (1-min load average {mach['load_average_start'][0]:.2f} at start, "
        f"{mach['load_average_end'][0]:.2f} at end)",
        f"model {cfg['model_name']} (dim {cfg['embed_dim']}, depth {cfg['depth']}, heads {cfg['num_heads']}), "
        f"{cfg['image_size']} px, fine patch {cfg['patch_size']} px, L={cfg['levels']} levels (coarse patch "
        f"{cfg['coarse_patch_size']} px), N_full={cfg['full_tokens']}, N_min={cfg['min_tokens']}, batch {cfg['batch_size']}",
        f"learned policy: own blocks of width {cfg['policy_width']}, depth {cfg['policy_depth']}; learned_shared: the ViT's "
        f"first {cfg['policy_depth']} blocks; median of {cfg['repeats']} interleaved rounds after {cfg['warmup']} warm-up; "
        "inference_mode; thresholds calibrated on the batch"
        + (f"; packed sizes in {cfg['token_buckets']} fixed buckets" if cfg.get("token_buckets") else "")
        + ("; torch.compile (timm, ideal encoder, packed encoders; SplitViT full eager)" if cfg.get("compile") else ""),
        "",
    ]
    base = tim["timm"]["median_s"]
    rows = [[_timing_label(name), f"{t['median_s'] * 1e3:.1f}", f"{t['min_s'] * 1e3:.1f}-{t['max_s'] * 1e3:.1f}",
             f"{t['images_per_s']:.1f}", f"{base / t['median_s']:.2f}x"] for name, t in tim.items()]
    lines += text_table(["timed", "ms/batch", "min-max ms", "img/s", "vs timm"], rows)
    lines.append("")
    rows = []
    for p in result["points"]:
        b = p["breakdown_s"]
        rows.append([
            p["policy"], f"{p['target_ratio']:.2f}", f"{p['tokens']['mean']:.1f} ({p['tokens']['min']}-{p['tokens']['max']})",
            f"{p['token_ratio']:.3f}", f"{p['images_per_s']:.1f}", f"{p['speedup_vs_timm']:.2f}x", f"{p['ideal_speedup']:.2f}x",
            f"{p['efficiency']:.0%}", f"{p['outside_blocks_share']:.1%}",
            " / ".join(f"{b[k] * 1e3:.1f}" for k in ("policy", "embedding_gather_head", "attention_packing", "blocks_fixed_length")),
            ", ".join(f"{k} {v:.2f}x" for k, v in p["padded_speedup_vs_timm"].items()),
        ])
    lines += text_table(["policy", "ratio", "tokens/img (min-max)", "token ratio", "img/s", "vs timm", "ideal", "of ideal",
                         "outside blocks", "ms: policy / embed+gather+head / attn+packing / blocks", "padded"], rows)
    lines.append("ideal = " + result["ideal_definition"])
    lines.append("time breakdown: " + result["breakdown_definition"])
    lines.append(f"check: SplitViT(full) vs timm max |logit diff| = {result['checks']['split_full_vs_timm_max_abs_logit_diff']:.3g}")
    lines.append("")
    rows = [
        [t["key"], t["what"], format_value(t), format_bound(t), "PASS" if t["passed"] else "MISS", format_spread(t), t["note"]]
        for t in result["targets"]
    ]
    lines += text_table(["", "target", "measured", "bound", "", "per-round IQR", "note"], rows)
    lines.append("checks on the medians: speed-up vs timm from each model's fastest round: "
                 + ", ".join(f"{p['key']} {p['speedup_fastest']:.2f}x" for p in result["points"])
                 + "; from median process CPU time: "
                 + ", ".join(f"{p['key']} {p['speedup_cpu_time']:.2f}x" for p in result["points"]))
    for warning in result.get("warnings", []):
        lines.append(f"WARNING: {warning}")
    mem = result.get("memory") or {}
    if mem.get("models"):
        lines.append("")
        lines.append(f"d. peak memory of one batch forward pass (MiB; ratio to the timm ViT), at {cfg['ratios'][0]:.0%} tokens:")
        columns = [(key, label) for key, label in (
            ("rss_growth", "rss"), ("profiler_peak", "profiler"), ("cuda_growth", "cuda")) if label in mem["methods"]]
        base_mem = mem["models"].get("timm", {})
        rows = []
        for name, m in mem["models"].items():
            row = [_timing_label(name)]
            for key, _ in columns:
                ratio = f" ({m[key] / base_mem[key]:.2f}x)" if base_mem.get(key) else ""
                row.append(f"{m[key] / 2**20:.1f}{ratio}")
            rows.append(row)
        lines += text_table(["model"] + [label for _, label in columns], rows)
        for method, text in mem["methods"].items():
            lines.append(f"  {method}: {text}")
    return "\n".join(lines)
