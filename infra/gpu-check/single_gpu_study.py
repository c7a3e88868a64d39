"""Run a study file (``search_spaces/study_*.yaml``) on one machine's GPU, without Ray
or MLflow: for a lent GPU machine that has PyTorch and timm but not the platform's
cluster stack (see ``infra/gpu-check/run.sh``).

The study is the one ``splitvit study`` runs: the same file, scale and overrides
(:func:`splitvit.tune.study.load_study`), the same per-run configs, the same
evaluation at matched token ratios on the held-out split, the same aggregation,
goals and speed comparison. Only the executor differs: instead of Ray Tune trials
running Ray Train, each run is trained here by ``splitvit.train.local.fit_local``
with the config's schedule (bf16 autocast, AdamW, warm-up + cosine, gradient
clipping, auto thresholds calibrated each epoch), in a pool of processes that
share the GPU.
Its JSON has the shape of ``splitvit study --json`` plus per-run training curves.

    python infra/gpu-check/single_gpu_study.py search_spaces/study_fashion.yaml --scale one-gpu \
        --out /tmp/study --json /tmp/study/study.json [--backbone-epochs N --method-epochs M] [--workers P]
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import logging
import math
import multiprocessing
import os
import platform as _platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("single_gpu_study")


def _spec(args: argparse.Namespace):
    from splitvit.tune.study import load_study

    spec = load_study(args.study, scale=args.scale, overrides=args.set)
    if args.backbone_epochs is not None:  # the backbone is all warm-up curriculum
        spec.backbone.update({"train.epochs": args.backbone_epochs, "train.warmup_epochs": args.backbone_epochs})
    if args.method_epochs is not None:
        spec.method["train.epochs"] = args.method_epochs
    if args.eval_samples is not None:
        spec.samples = args.eval_samples
    spec.fixed["data.options.cache_dir"] = str(Path(args.out) / "canvas-cache")
    return spec


def train_run(config, device: str) -> dict[str, Any]:
    """Train ``config`` in this process (:func:`splitvit.train.local.fit_local` with the
    config's schedule, bf16 and auto thresholds); returns its checkpoint and per-epoch
    metrics. A finished run (its ``model.pt`` and history present) is reused."""
    import torch
    from torch.utils.data import DataLoader

    from splitvit.config import AUTO_THRESHOLDS
    from splitvit.train.experiment import build_model
    from splitvit.data import build_dataset
    from splitvit.train.checkpoints import init_weights
    from splitvit.train.local import fit_local, validate

    mc, dc, tc = config.model, config.data, config.train
    folder = Path(config.storage.resolved_path()) / config.storage.name
    checkpoint = folder / "model.pt"
    history_file = folder / "history.json"
    if checkpoint.is_file() and history_file.is_file():
        return {"checkpoint": str(checkpoint), **json.loads(history_file.read_text())}
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(dc.seed * 1000)
    model = build_model(mc)
    if mc.init_from:
        init_weights(model, mc.init_from)
    model.to(device)
    train_set = build_dataset(dc.name, "train", image_size=mc.image_size, seed=dc.seed, **dc.options)
    val_set = build_dataset(dc.name, dc.val_split, image_size=mc.image_size, seed=dc.seed, **dc.options)
    val_loader = DataLoader(val_set, batch_size=dc.eval_batch_size or dc.batch_size, num_workers=dc.num_workers)
    steps_per_epoch = len(train_set) // dc.batch_size
    auto = mc.thresholds == AUTO_THRESHOLDS and model.policy.thresholded
    history: list[dict[str, Any]] = []

    def after_epoch(epoch: int, stats: dict[str, float]) -> None:
        metrics = {f"train_{k}": v for k, v in stats.items() if k != "epoch"}
        metrics.update(validate(model, val_set, val_loader, num_classes=mc.num_classes, amp=tc.amp,
                                calibrate_to=tc.target_ratio if auto else None,
                                calibration_images=dc.eval_batch_size or dc.batch_size))
        history.append({**metrics, "epoch": epoch})
        log.info("%s epoch %d: %s", config.storage.name, epoch,
                 {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})

    started = time.time()
    warmup = tc.lr_warmup_steps if tc.lr_warmup_steps is not None else round(tc.lr_warmup_epochs * steps_per_epoch)
    fit_local(model, train_set, tc.loss_config(), epochs=tc.epochs, batch_size=dc.batch_size, lr=tc.lr,
              weight_decay=tc.weight_decay, grad_clip=tc.grad_clip if tc.grad_clip > 0 else math.inf, seed=dc.seed,
              on_epoch=after_epoch, amp=tc.amp, warmup_steps=warmup, num_workers=dc.num_workers)
    model.save(checkpoint, extra={"epoch": tc.epochs - 1, "metrics": history[-1], "config": config.to_dict(redact=True)})
    record = {"history": history, "train_seconds": time.time() - started, "steps": tc.epochs * steps_per_epoch}
    history_file.write_text(json.dumps(record, default=float))
    return {"checkpoint": str(checkpoint), **record}


def _job(args: argparse.Namespace, spec, seed: int, method: str | None, backbone: str | None) -> dict[str, Any]:
    """One run in a pool process: a seed's backbone (``method=None``), or a method
    trained from ``backbone`` and evaluated at every matched token ratio."""
    import torch

    from splitvit.tune.study import THRESHOLDED, evaluate_points

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(2)
    name = f"backbone-s{seed}" if method is None else f"{method}-s{seed}"
    storage = str(Path(args.out) / "train")
    config = spec.run_config(seed, method, name, storage, init_from=backbone)
    trained = train_run(config, args.device)
    result = {"seed": seed, "method": method, **trained}
    if method is None:
        return result
    started = time.time()
    policy = spec.policy(method)
    result.update({
        "policy": policy, "config": config.flat(),
        "train_metrics": trained["history"][-1],
        "points": evaluate_points(trained["checkpoint"], policy=policy,
                                  ratios=spec.ratios if policy in THRESHOLDED else [], split=spec.split,
                                  samples=spec.samples, calibration_samples=spec.calibration_samples, seed=seed,
                                  device=args.device),
    })
    result["eval_seconds"] = time.time() - started
    return result


def plan_epochs(smoke: dict[str, Any], spec, budget_s: float, workers: int, fixed_s: float = 60.0) -> dict[str, Any]:
    """Epochs for ``spec`` that fit ``budget_s`` on the machine ``smoke`` (this script's
    JSON from a smaller run, same workers) ran on: training time from each run's
    measured images/s, evaluation scaled by the evaluated images, the method runs spread
    over ``workers``; ``fixed_s`` covers rendering, start-up and the speed comparison."""
    train_images = len(_dataset(spec, "train"))
    test_images = len(_dataset(spec, spec.split, spec.samples))
    smoke_test = smoke["runs"][0]["points"][0]["images"]
    backbone_ips = min(statistics.fmean(h["train_images_per_s"] for h in b["history"]) for b in smoke["backbones"])
    method_s_per_epoch = sum(train_images / statistics.fmean(h["train_images_per_s"] for h in r["history"])
                             for r in smoke["runs"]) * len(spec.seeds) / len(smoke["seeds"])
    eval_s = sum(r["eval_seconds"] for r in smoke["runs"]) * test_images / smoke_test * len(spec.seeds) / len(smoke["seeds"])
    best = None
    for method_epochs in range(1, 101):
        backbone_s = 2 * method_epochs * train_images / backbone_ips
        methods_s = (method_epochs * method_s_per_epoch + eval_s) / workers * 1.15  # imperfect packing
        if fixed_s + backbone_s + methods_s > budget_s:
            break
        best = {"backbone_epochs": 2 * method_epochs, "method_epochs": method_epochs,
                "estimated_s": round(fixed_s + backbone_s + methods_s), "train_images": train_images}
    if best is None:
        raise SystemExit(f"not even one method epoch fits {budget_s} s")
    return best


def _dataset(spec, split: str, samples: int | None = None):
    from splitvit.data import build_dataset

    config = spec.run_config(spec.seeds[0], next(iter(spec.methods)), "plan")
    options = {k: v for k, v in config.data.options.items() if k != "cache_dir"}
    if samples is not None:
        options[f"{split}_samples"] = samples
    return build_dataset(config.data.name, split, image_size=config.model.image_size, seed=0, **options)


def _prerender(spec) -> None:
    """Every seed's canvases into the cache, before any process touches CUDA (the
    renderer forks)."""
    from splitvit.data import build_dataset

    for seed in spec.seeds:
        config = spec.run_config(seed, next(iter(spec.methods)), "render")
        dc = config.data
        for split in dict.fromkeys(("train", dc.val_split, "val", spec.split)):
            options = dict(dc.options)
            if split == spec.split and spec.samples is not None:
                options[f"{split}_samples"] = spec.samples
            started = time.time()
            data = build_dataset(dc.name, split, image_size=config.model.image_size, seed=dc.seed, **options)
            log.info("seed %d %s: %d canvases ready in %.1f s", seed, split, len(data), time.time() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study")
    parser.add_argument("--scale")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True, help="folder for checkpoints, the canvas cache and the figure")
    parser.add_argument("--json", help="write the result table here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workers", type=int, default=4, help="runs trained at once on the GPU")
    parser.add_argument("--backbone-epochs", type=int)
    parser.add_argument("--method-epochs", type=int)
    parser.add_argument("--eval-samples", type=int, help="evaluate on this many held-out images (default: the study's)")
    parser.add_argument("--plan", metavar="SMOKE_JSON",
                        help="print the largest epochs (backbone twice the methods') whose training fits --budget-s, "
                             "from a smaller run's measured images/s and evaluation times, and exit")
    parser.add_argument("--budget-s", type=float, help="with --plan: seconds the study may take")
    args = parser.parse_args(argv)
    if args.plan and args.budget_s is None:
        parser.error("--plan needs --budget-s (the seconds the study may take)")
    if args.plan:
        print(json.dumps(plan_epochs(json.loads(Path(args.plan).read_text()), _spec(args), args.budget_s, args.workers)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    started = time.time()

    from splitvit.tune.study import aggregate, check_goals, matched_speed, study_figure

    spec = _spec(args)  # bad input stops here
    Path(args.out).mkdir(parents=True, exist_ok=True)
    _prerender(spec)
    render_seconds = time.time() - started
    context = multiprocessing.get_context("spawn")  # CUDA in every worker
    failed: list[str] = []
    with futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        jobs = {pool.submit(_job, args, spec, seed, None, None): seed for seed in spec.seeds}
        backbones = {}
        for job in futures.as_completed(jobs):
            try:
                backbones[jobs[job]] = job.result()
            except Exception as exc:  # noqa: BLE001 - reported, the other seeds go on
                failed.append(f"backbone seed {jobs[job]}: {exc!r}")
        backbone_seconds = time.time() - started - render_seconds
        order = sorted(spec.methods, key=lambda m: (spec.policy(m) != "learned", spec.policy(m) != "full"))
        jobs = {pool.submit(_job, args, spec, seed, method, backbones[seed]["checkpoint"]): (seed, method)
                for method in order for seed in sorted(backbones)}
        runs = []
        for job in futures.as_completed(jobs):
            try:
                runs.append(job.result())
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{jobs[job][1]} seed {jobs[job][0]}: {exc!r}")
    metric = spec.metric
    rows = aggregate(runs, metric)
    goals = check_goals(rows, spec.goals, metric)
    speed = matched_speed(spec, rows, runs, metric, run=lambda fn, *a, **kw: fn(*a, device=args.device, **kw))
    import torch

    machine = {"python": _platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
               "device": args.device}
    if args.device.startswith("cuda"):
        machine["device_name"] = torch.cuda.get_device_name()
    result = {
        "name": Path(args.study).stem + (f"-{args.scale}" if args.scale else ""), "source": spec.source,
        "executor": "single process pool on one machine (infra/gpu-check/single_gpu_study.py): no Ray, no MLflow",
        "machine": machine, "metric": metric, "seeds": spec.seeds, "rows": rows, "goals": goals, "speed": speed,
        "failed": failed, "seconds": time.time() - started, "render_seconds": render_seconds,
        "backbone_seconds": backbone_seconds,
        "backbone_epochs": spec.backbone.get("train.epochs"), "method_epochs": spec.method.get("train.epochs"),
        "backbones": [{k: v for k, v in b.items() if k != "checkpoint"} for b in backbones.values()],
        "runs": [{k: v for k, v in r.items() if k not in ("config", "checkpoint")} for r in runs],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float) + "\n")
    if rows:
        fig = study_figure(rows, metric, title=f"{result['name']}: {metric} vs tokens ({len(spec.seeds)} seeds, one GPU)")
        fig.savefig(Path(args.out) / "study.png")
    _print_table(result)
    return 1 if failed else 0


def _print_table(result: dict[str, Any]) -> None:
    from splitvit.tune.study import summary_lines

    metric = result["metric"]
    print(f"\n{result['name']} on {result['machine'].get('device_name', result['machine']['device'])}: "
          f"{len(result['seeds'])} seeds, backbone {result['backbone_epochs']} + method {result['method_epochs']} epochs, "
          f"{result['seconds']:.0f} s")
    print(f"{'method':<12}{'ratio':>7}{'tokens':>8}{metric:>10}{'std':>7}{'min':>7}{'max':>7}")
    for r in result["rows"]:
        ratio = "-" if r["target_ratio"] is None else f"{r['target_ratio']:.2f}"
        print(f"{r['method']:<12}{ratio:>7}{r['tokens_per_image']:>8.1f}{100 * r[metric]:>10.1f}"
              f"{100 * r[metric + '_std']:>7.1f}{100 * r[metric + '_min']:>7.1f}{100 * r[metric + '_max']:>7.1f}")
    for line in summary_lines(result["goals"], result["speed"], result["failed"]):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
