"""Measured speed of operating points: each (checkpoint, thresholds) point timed
against the full-resolution model, side by side, in one run on one device.

:func:`time_operating_points` is the one timing routine of sweeps (every frontier
point) and studies (every method's point at each evaluation ratio). It reuses
:mod:`splitvit.bench.timing`'s timer (:func:`~splitvit.bench.timing.time_beside_others`:
interleaved rounds, forward order then reverse, ``synchronize`` around each call on
CUDA, medians), so a figure here means what it means in ``splitvit bench forward``:

* every point's model (its checkpoint, its own policy, its thresholds) and the
  full-resolution model (the same checkpoint format with the ``full`` policy: every
  node splits, the sweep's "full resolution" baseline) run on **one fixed batch**:
  the first ``batch_size`` images of the evaluation split of the reference
  checkpoint;
* under ``torch.inference_mode()`` and the precision evaluations run in (bf16
  autocast on CUDA, float32 on the CPU), after ``warmup`` rounds, ``rounds`` rounds
  in which every model runs once;
* ``speedup_vs_full`` = median seconds of the full-resolution model / median
  seconds of the point (a ratio of medians, measured in the same run), beside the
  same ratio from the fastest rounds and the quartiles of the per-round ratio;
* ``token_ratio`` is measured on the timed batch (tokens per image / full tokens).

Points whose checkpoints differ in architecture (model, width, depth, image size,
levels) are each compared with a full-resolution model of their own architecture;
all of them run in the same interleaved rounds. Nothing here is judged against a
target: the figures are recorded as measured.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from contextlib import ExitStack
from typing import Any

log = logging.getLogger(__name__)


def spread(items: list[Any], count: int | None) -> list[Any]:
    """At most ``count`` of ``items`` (kept in order): both ends and evenly in between."""
    if count is None or len(items) <= count:
        return list(items)
    if count <= 0:
        return []
    if count == 1:
        return [items[0]]
    picked = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)})
    return [items[i] for i in picked]


def _architecture(payload: dict[str, Any]) -> str:
    """What decides a forward pass's cost apart from the policy and thresholds."""
    spec = payload.get("spec") or {}
    return json.dumps(
        {k: v for k, v in spec.items() if not k.startswith("policy") and k != "thresholds"}, sort_keys=True, default=str
    )


def time_operating_points(
    points: list[dict[str, Any]],
    *,
    full_checkpoint: str | None = None,
    batch_size: int = 32,
    rounds: int = 5,
    warmup: int = 1,
    split: str | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Time every operating point against the full-resolution model, interleaved.

    Args:
        points: one dict per point: ``checkpoint`` (a checkpoint folder or ``model.pt``),
            ``thresholds`` (per level; ``None``: the checkpoint's own), optionally
            ``policy`` (default: the checkpoint's), ``budget`` (the target token
            ratio a budget-conditioned policy is told, as when the thresholds were
            calibrated; default: the checkpoint's) and ``label``.
        full_checkpoint: the full-resolution model's checkpoint (run with the ``full``
            policy) for the points of its architecture. Points of another
            architecture (or all, by default) are compared with the first of their
            checkpoints run with the ``full`` policy.
        batch_size, rounds, warmup: the timing (see the module docstring).
        split: the data split the batch comes from (default: the checkpoint's
            validation split).
        device: where to time (the device the sweep or study evaluated on).

    Returns:
        ``{"device", "machine", "batch_size", "rounds", "warmup", "precision",
        "images", "full": [...], "points": [...], "other_processes_cpus",
        "warnings", "seconds"}``; each point (in the order given) has
        ``images_per_s``, ``speedup_vs_full``, ``token_ratio``,
        ``tokens_per_image`` and the full-resolution model it was compared with
        (``full``, a key of ``full``).
    """
    import torch

    from ..bench.timing import (
        OTHER_LOAD_WARNING,
        machine_info,
        quartiles,
        synchronizer,
        time_beside_others,
        timing_summary,
    )
    from ..model import SplitViT
    from ..train.checkpoints import load_payload
    from ..train.evaluation import CheckpointEvaluator

    if not points:
        raise ValueError("no operating points to time")
    if batch_size < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"batch_size and rounds must be >= 1 and warmup >= 0, got {batch_size}, {rounds}, {warmup}")
    started = time.time()
    dev = torch.device(device)
    payloads: dict[str, dict[str, Any]] = {}

    def payload(checkpoint: str) -> dict[str, Any]:
        if checkpoint not in payloads:
            payloads[checkpoint] = load_payload(checkpoint)
        return payloads[checkpoint]

    # the full-resolution models, one per architecture, and the batch each runs on
    arch_of = {p["checkpoint"]: _architecture(payload(p["checkpoint"])) for p in points}
    references: dict[str, str] = {}
    if full_checkpoint is not None:
        references[_architecture(payload(str(full_checkpoint)))] = str(full_checkpoint)
    for p in points:
        references.setdefault(arch_of[p["checkpoint"]], p["checkpoint"])
    references = {a: c for a, c in references.items() if a in arch_of.values()}
    full_models: dict[str, SplitViT] = {}
    images: dict[str, torch.Tensor] = {}
    full_keys: dict[str, str] = {}
    autocast = None
    for i, (arch, checkpoint) in enumerate(references.items()):
        key = f"full{i}"
        full_keys[arch] = key
        evaluator = CheckpointEvaluator(checkpoint, samples=batch_size, device=device, cache=False, split=split)
        images[key] = evaluator.first_images(batch_size)
        full_models[key] = evaluator.build("full")
        autocast = autocast or evaluator.autocast
    models: dict[tuple[str, str | None], SplitViT] = {}
    for p in points:
        key = (p["checkpoint"], p.get("policy"))
        if key not in models:
            overrides = {"policy": p["policy"]} if p.get("policy") else {}
            models[key] = SplitViT.from_checkpoint(payload(p["checkpoint"]), **overrides).to(dev).eval()

    fns: dict[str, Any] = {}
    sizes = {key: int(x.shape[0]) for key, x in images.items()}  # images per call
    out_points: list[dict[str, Any]] = []
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(autocast())
        for key, model in full_models.items():
            fns[key] = (lambda m, x: lambda: m(x))(model, images[key])
        full_tokens: dict[str, float] = {}
        for key, model in full_models.items():
            full_tokens[key] = float(model(images[key]).tokens.float().mean())
        for i, p in enumerate(points):
            model = models[(p["checkpoint"], p.get("policy"))]
            ref = full_keys[arch_of[p["checkpoint"]]]
            x = images[ref]
            thresholds = [float(t) for t in p["thresholds"]] if p.get("thresholds") is not None else None
            budget = float(p["budget"]) if model.uses_budget and p.get("budget") is not None else None
            out = model(x, thresholds=thresholds, budget=budget)
            tokens = float(out.tokens.float().mean())
            out_points.append(
                {
                    "index": i,
                    "label": p.get("label", f"point{i}"),
                    "checkpoint": p["checkpoint"],
                    "policy": model.policy.name,
                    "thresholds": thresholds,
                    "budget": budget,
                    "full": ref,
                    "tokens_per_image": tokens,
                    "token_ratio": tokens / out.full_tokens,
                }
            )
            fns[f"point{i}"] = functools.partial(model, x, thresholds=thresholds, budget=budget)
            sizes[f"point{i}"] = int(x.shape[0])
        log.info(
            "speed: timing %d operating point(s) against %d full-resolution model(s) on %s, batch %d, "
            "%d warm-up + %d interleaved rounds",
            len(points),
            len(full_models),
            dev,
            batch_size,
            warmup,
            rounds,
        )
        samples, cpu_samples, others = time_beside_others(fns, repeats=rounds, warmup=warmup, sync=synchronizer(dev))
    timings = {name: timing_summary(s, cpu_samples[name], sizes[name]) for name, s in samples.items()}
    full_rows = []
    for arch, key in full_keys.items():
        t = timings[key]
        full_rows.append(
            {
                "key": key,
                "checkpoint": references[arch],
                "policy": "full",
                "median_s": t["median_s"],
                "min_s": t["min_s"],
                "images_per_s": t["images_per_s"],
                "tokens_per_image": full_tokens[key],
                "token_ratio": 1.0,
                "speedup_vs_full": 1.0,
            }
        )
    for point in out_points:
        t, f = timings[f"point{point['index']}"], timings[point["full"]]
        per_round = [a / b for a, b in zip(samples[point["full"]], samples[f"point{point['index']}"])]
        point.update(
            {
                "median_s": t["median_s"],
                "min_s": t["min_s"],
                "images_per_s": t["images_per_s"],
                "full_images_per_s": f["images_per_s"],
                "speedup_vs_full": f["median_s"] / t["median_s"],
                "speedup_vs_full_fastest": f["min_s"] / t["min_s"],
                "speedup_vs_full_per_round": quartiles(per_round),
            }
        )
    machine = machine_info(dev)
    warnings = []
    if others is not None and others > OTHER_LOAD_WARNING:
        warnings.append(
            f"other processes used {others:.2f} of the {machine['cpu_count']} CPUs on average while the "
            "models were timed: the wall-clock figures are noisy"
        )
    n = min(int(x.shape[0]) for x in images.values())
    result = {
        "device": str(dev) + (f" ({machine['device_name']})" if "device_name" in machine else ""),
        "machine": machine,
        "batch_size": n,
        "rounds": rounds,
        "warmup": warmup,
        "precision": "bf16 autocast" if dev.type == "cuda" else "float32",
        "images": f"the first {n} images of the {split or 'validation'} split",
        "method": "interleaved rounds (bench.time_beside_others); speedup_vs_full = median full-resolution seconds / "
        "median point seconds, same run, same batch",
        "full": full_rows,
        "points": out_points,
        "other_processes_cpus": others,
        "warnings": warnings,
        "seconds": time.time() - started,
    }
    for w in warnings:
        log.warning("speed: %s", w)
    return result
