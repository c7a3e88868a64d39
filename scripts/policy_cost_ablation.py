"""Does a cheaper policy cost accuracy? The demo recipe per variant and seed, at 30% of the tokens.

    python scripts/policy_cost_ablation.py run --seeds 0 1 --json ablation.json
    python scripts/policy_cost_ablation.py run --variants attention --json attention.json
    python scripts/policy_cost_ablation.py table [ABLATION_JSON ...]

``run`` trains the demo recipe (synthetic object among clutter, 48 px, a 4-block ViT
of width 64) once per variant and seed and compares each at 30% of the
full-resolution tokens on the held-out images. Variants: the default (the policy on
the ViT's first block, the gradient-saliency teacher on every step); that teacher on
every 4th step (``train.teacher.every``); the attention teacher (``train.teacher.kind:
attention``: a forward pass, no backward); the policy with one block of its own of
width 32 (``model.policy.width``). ``table`` prints the markdown table of docs/results.md
from ``run``'s JSON (default: the committed runs in
docs/measurements/cpu-2026-11-30/policy-cost-ablation/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))  # this checkout's splitvit, not another install's

MEASURED = ROOT / "docs" / "measurements" / "cpu-2026-11-30" / "policy-cost-ablation"
DEFAULT_JSON = (MEASURED / "ablation.json", MEASURED / "attention.json")
TARGET_RATIO = 0.3

VARIANTS = {
    "default": ("default (shared block, teacher every step)", lambda r: r),
    "every4": (
        "teacher every 4th step",
        lambda r: replace(r, loss=replace(r.loss, teacher=replace(r.loss.teacher, every=4))),
    ),
    "width32": ("own policy block, width 32", lambda r: replace(r, policy=replace(r.policy, width=32))),
    "attention": (
        "attention teacher",
        lambda r: replace(r, loss=replace(r.loss, teacher=replace(r.loss.teacher, kind="attention"))),
    ),
}


def variants(base: Any, names: list[str]) -> dict[str, Any]:
    """The demo ``Recipe`` of each named variant, keyed by its description."""
    return {VARIANTS[n][0]: VARIANTS[n][1](base) for n in names}


def run(seeds: list[int], names: list[str], json_path: str | None) -> None:
    """Train every variant for every seed, print each result and the means, write the JSON."""
    from splitvit.train.demo import Recipe, compare_at_budget, held_out_batches, train_recipe

    results: dict[str, list[dict]] = {}
    for seed in seeds:
        for name, recipe in variants(Recipe(seed=seed), names).items():
            start = time.perf_counter()
            model, _ = train_recipe("learned", recipe)
            seconds = time.perf_counter() - start
            metrics = compare_at_budget(model, held_out_batches(recipe), TARGET_RATIO)
            learned, entropy = metrics["learned"], metrics["entropy"]
            row = {
                "seed": seed,
                "train_seconds": seconds,
                "accuracy": learned["accuracy"],
                "token_ratio": learned["token_ratio"],
                "fine_on_object": learned["fine_on_object"],
                "entropy_accuracy": entropy["accuracy"],
                "full_same_backbone": metrics["full"]["accuracy"],
            }
            results.setdefault(name, []).append(row)
            print(f"seed {seed} {name}: {row}", flush=True)
    print(f"\nat {TARGET_RATIO:.0%} tokens, mean over seeds {seeds} (each seed's value in brackets):")
    for name, rows in results.items():
        acc = [r["accuracy"] for r in rows]
        fine = [r["fine_on_object"] for r in rows]
        print(
            f"  {name}: accuracy {statistics.fmean(acc):.3f} ({', '.join(f'{a:.3f}' for a in acc)}), "
            f"fine tokens on the object {statistics.fmean(fine):.1%}, "
            f"train {statistics.fmean(r['train_seconds'] for r in rows):.0f} s"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"target_ratio": TARGET_RATIO, "seeds": seeds, "results": results}, f, indent=2)


def table_lines(paths: list[Path]) -> list[str]:
    """The variants of every ``run`` JSON as one markdown table: mean accuracy (each seed's)
    and the mean share of fine tokens on the object."""
    lines = [
        "| variant | accuracy (seeds in brackets) | fine tokens on the object |",
        "| --- | --- | --- |",
    ]
    for path in paths:
        for name, rows in json.loads(path.read_text())["results"].items():
            accuracy = [r["accuracy"] * 100 for r in rows]
            seeds = ", ".join(f"{a:.1f}" for a in accuracy)
            fine = statistics.fmean(r["fine_on_object"] for r in rows)
            lines.append(f"| {name} | {statistics.fmean(accuracy):.1f}% ({seeds}) | {fine:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("run", help="train the variants and compare them")
    train.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    train.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["default", "every4", "width32"])
    train.add_argument("--json", help="write the results here")
    table = commands.add_parser("table", help="the markdown table from run's JSON")
    table.add_argument("json", nargs="*", type=Path, default=list(DEFAULT_JSON), help="run's JSON files")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.seeds, args.variants, args.json)
    else:
        print("\n".join(table_lines(args.json)))


if __name__ == "__main__":
    main()
