"""Does a cheaper policy cost accuracy? The demo recipe (synthetic object among
clutter, 48 px, a 4-block ViT of width 64), trained per variant and seed, compared
at 30% of the full-resolution tokens on the held-out images.

Variants: the default (the policy on the ViT's first block, the gradient-saliency
teacher on every step); that teacher on every 4th step (``train.teacher_every``); the
attention teacher (``train.teacher: attention``: a forward pass, no backward); the
policy with one block of its own of width 32 (``model.policy_width``).

    python docs/measurements/cpu-2026-11-30/policy-cost-ablation/ablation.py --seeds 0 1 --json ablation.json
    python docs/measurements/cpu-2026-11-30/policy-cost-ablation/ablation.py --variants attention --json attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from splitvit.train.demo import Recipe, compare_at_budget, held_out_batches, train_recipe

TARGET_RATIO = 0.3


VARIANTS = {
    "default": ("default (shared block, teacher every step)", lambda r: r),
    "every4": ("teacher every 4th step", lambda r: replace(r, loss=replace(r.loss, teacher_every=4))),
    "width32": ("own policy block, width 32", lambda r: replace(r, policy_width=32)),
    "attention": ("attention teacher", lambda r: replace(r, loss=replace(r.loss, teacher="attention"))),
}


def variants(base: Recipe, names: list[str]) -> dict[str, Recipe]:
    return {VARIANTS[n][0]: VARIANTS[n][1](base) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["default", "every4", "width32"])
    parser.add_argument("--json")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, recipe in variants(Recipe(seed=seed), args.variants).items():
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
    print(f"\nat {TARGET_RATIO:.0%} tokens, mean over seeds {args.seeds} (each seed's value in brackets):")
    for name, rows in results.items():
        acc = [r["accuracy"] for r in rows]
        fine = [r["fine_on_object"] for r in rows]
        print(
            f"  {name}: accuracy {statistics.fmean(acc):.3f} ({', '.join(f'{a:.3f}' for a in acc)}), "
            f"fine tokens on the object {statistics.fmean(fine):.1%}, "
            f"train {statistics.fmean(r['train_seconds'] for r in rows):.0f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_ratio": TARGET_RATIO, "seeds": args.seeds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
