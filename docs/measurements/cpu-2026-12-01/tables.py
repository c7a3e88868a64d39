"""The README's and results.md's study tables, as markdown, from a study JSON.

python docs/measurements/cpu-2026-12-01/tables.py docs/measurements/cpu-2026-12-01/study_fashion.json
"""

from __future__ import annotations

import json
import statistics
import sys


def cell(row: dict | None, metric: str) -> str:
    if row is None:
        return "-"
    return f"{row[metric] * 100:.1f} ± {row[metric + '_std'] * 100:.1f}"


def main(path: str) -> None:
    data = json.loads(open(path).read())
    metric = data["metric"]
    rows = data["rows"]
    thresholded = list(dict.fromkeys(r["method"] for r in rows if r["target_ratio"] is not None))
    ratios = sorted({r["target_ratio"] for r in rows if r["target_ratio"] is not None})
    by = {(r["method"], r["target_ratio"]): r for r in rows}
    print("| token ratio | " + " | ".join(thresholded) + " |")
    print("| --- |" + " --- |" * len(thresholded))
    for ratio in ratios:
        print(f"| {ratio:.2f} | " + " | ".join(cell(by.get((m, ratio)), metric) for m in thresholded) + " |")
    print()
    for r in rows:
        if r["target_ratio"] is None:
            seeds = ", ".join(f"{v * 100:.1f}" for v in r["per_seed"].values())
            print(f"* {r['method']}: {cell(r, metric)} at {r['tokens_per_image']:.0f} tokens (seeds {seeds})")
    print()
    levers = data.get("levers") or []
    if levers:
        keys = [k for k in levers[0] if k != "method"]
        print("| SPLIT method | " + " | ".join(f"{metric} at {float(k[1:]):.0%} tokens (vs full)" for k in keys) + " |")
        print("| --- |" + " --- |" * len(keys))
        for lever in levers:
            cells = []
            for k in keys:
                c = lever[k]
                if c is None:
                    cells.append("-")
                    continue
                gap = f"({-c['gap_points']:+.1f}) at {c['token_ratio']:.1%}"
                cells.append(f"{c[metric] * 100:.1f} ± {c['std'] * 100:.1f} {gap}")
            print(f"| {lever['method']} | " + " | ".join(cells) + " |")
        print()
    # each lever's gap to the control seed by seed (a seed's reference lifts or lowers
    # every method of that seed): the spread that says whether a gap is real
    full = next((r for r in rows if r["target_ratio"] is None and r["method"] == "full"), None)
    if full is not None:
        for r in rows:
            if r["method"] in thresholded and r["target_ratio"] in (0.5, 0.7) and r["method"].startswith("split"):
                seeds = sorted(set(full["per_seed"]) & set(r["per_seed"]))
                gaps = [(full["per_seed"][s] - r["per_seed"][s]) * 100 for s in seeds]
                spread = f" ({statistics.fmean(gaps):.1f} ± {statistics.stdev(gaps):.1f})" if len(gaps) > 1 else ""
                print(f"gap of {r['method']} at {r['target_ratio']:.0%}: {', '.join(f'{g:.1f}' for g in gaps)}{spread}")
        print()
    for name, goal in data["goals"].items():
        print(f"goal {name}: {json.dumps(goal, default=str)[:400]}")


if __name__ == "__main__":
    main(sys.argv[1])
