"""A finished sweep's frontier chosen again on more validation images: how much of its
gap to the recipe is the noise of selecting on few.

    python scripts/reselect_frontier.py SWEEP.json --val-samples 5000 --json OUT.json [--jobs 2]
    python scripts/sweep_vs_recipe.py OUT.json --recipe-points RECIPE.json --space SPACE.yaml

Every searched point of SWEEP.json (a trial's own point and its stage-two points, not
the baselines) is evaluated again at its thresholds on the first ``--val-samples``
validation images of its checkpoint's data; the frontier is chosen on those figures
(quality up, token ratio down), and its points are evaluated once on the held-out split
(``--test-samples``), where SWEEP.json has no such figure for them yet. OUT.json is
SWEEP.json with that frontier and without its other points, in the form
``sweep_vs_recipe.py`` reads. The checkpoints
must still be where the sweep wrote them.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def _evaluate(job: tuple[str, str, int, list[list[float]]]) -> list[tuple[float, float, float]]:
    """(quality, token ratio, tokens per image) of one checkpoint at each thresholds, on ``split``."""
    import torch

    from splitvit.train.evaluation import CheckpointEvaluator

    checkpoint, split, samples, all_thresholds = job
    torch.set_num_threads(1)
    evaluator = CheckpointEvaluator(checkpoint, split=split, samples=samples)
    out = []
    for thresholds in all_thresholds:
        point = evaluator.evaluate(thresholds)
        out.append((point.quality, point.token_ratio, point.tokens_per_image))
    return out


def _run(points: list[dict], split: str, samples: int, jobs: int) -> list[tuple[float, float, float]]:
    """Every point evaluated on ``split``, in ``points``' order (each checkpoint loaded once)."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault(p["checkpoint"], []).append(i)
    work = [(checkpoint, split, samples, [points[i]["thresholds"] for i in idx]) for checkpoint, idx in groups.items()]
    figures: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * len(points)
    with ProcessPoolExecutor(jobs) as pool:
        for idx, results in zip(groups.values(), pool.map(_evaluate, work)):
            for i, result in zip(idx, results):
                figures[i] = result
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--val-samples", type=int, default=5000)
    parser.add_argument("--test-samples", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    for name in ("val_samples", "test_samples", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    from splitvit.tune.pareto import pareto_indices

    sweep = json.loads(args.sweep.read_text())
    metric = sweep["metric"]
    points = [p for p in sweep.get("points") or [] if p.get("checkpoint") and p.get("thresholds")]
    if not points:
        raise SystemExit(
            f"{args.sweep}: no point with a checkpoint and thresholds (a sweep's JSON, as the CLI wrote it?)"
        )
    val = _run(points, "val", args.val_samples, args.jobs)
    front = [points[i] for i in pareto_indices([(q, r) for q, r, _ in val])]
    figures = {id(p): v for p, v in zip(points, val)}
    missing = [p for p in front if f"test_{metric}" not in (p.get("extras") or {})]
    for p, (q, r, t) in zip(missing, _run(missing, "test", args.test_samples, args.jobs)):
        p.setdefault("extras", {}).update({f"test_{metric}": q, "test_token_ratio": r, "test_tokens_per_image": t})
    rows = []
    for p in sorted(front, key=lambda p: figures[id(p)][1]):
        q, r, t = figures[id(p)]
        rows.append({**p, metric: q, "token_ratio": r, "tokens_per_image": t, "on_frontier": True})
        print(
            f"{p['trial_id']} {p['kind']:9s} val {q:.4f} at {r:.4f}  test {p['extras'][f'test_{metric}']:.4f} "
            f"at {p['extras']['test_token_ratio']:.4f}  (chosen on {sweep['name']}'s validation: {p[metric]:.4f})"
        )
    # every point's figures stay in SWEEP.json; OUT.json holds the new frontier
    out = {k: v for k, v in sweep.items() if k != "points"}
    out.update(name=f"{sweep['name']} (frontier on {args.val_samples} validation images)", frontier=rows)
    args.json.write_text(json.dumps(out, indent=2, sort_keys=True))
    print(f"{len(rows)} of {len(points)} points on the frontier chosen on {args.val_samples} validation images")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
