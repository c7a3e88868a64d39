"""A study's tables as markdown, from the JSON `splitvit study --json` wrote.

    python scripts/study_tables.py [STUDY_JSON ...] [--at 0.5,0.7]

Default: the three default studies' committed JSON (classification, dense and
detection, each run from scratch in one invocation). Printed per file: the quality of every thresholded
method at every token ratio (mean ± std over seeds, in %; a companion quality such as
a detector's mask AP in a table of its own); the unthresholded methods
(full resolution, all-coarse) with each seed's value; the lever table the study
stored (each lever's gap to the control at the goal ratios); each SPLIT method's gap
to the control seed by seed at the ``--at`` ratios, as calibrated (the point the
study measured, at the token share it reached) and read at exactly that share
(each seed's quality interpolated linearly between its two points around it); and
the goal lines. Gaps are SPLIT minus the control, in points: negative is below.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements"
DEFAULT_STUDIES = (  # each default recipe's evidence, then the v1 defaults' from-scratch studies
    MEASUREMENTS / "cpu-2026-12-07-cls-v2" / "study_fashion_v2_side.json",  # classification-v2
    MEASUREMENTS / "cpu-2026-12-05-seg-speed" / "study_fashion_seg_t2_side.json",  # dense-v2
    MEASUREMENTS / "cpu-2026-12-05-det-ref28" / "study_fashion_det.json",  # detection-v1
    MEASUREMENTS / "cpu-2026-12-02-scratch10" / "study_fashion_scratch10.json",  # classification-v1
    MEASUREMENTS / "cpu-2026-12-05-seg-speed" / "study_fashion_seg.json",  # dense-v1
)


def cell(row: dict[str, Any] | None, metric: str) -> str:
    """``mean ± std`` of a row's metric in %, or ``-`` where the study has no such row."""
    if row is None:
        return "-"
    return f"{row[metric] * 100:.1f} ± {row[metric + '_std'] * 100:.1f}"


def spread(values: list[float]) -> str:
    """``mean ± std`` of per-seed values (the mean alone for one seed)."""
    if len(values) < 2:
        return f"{statistics.fmean(values):+.2f}"
    return f"{statistics.fmean(values):+.2f} ± {statistics.stdev(values):.2f}"


def control_per_seed(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The full-resolution control's quality per seed (keys as in the JSON: ``"0"``, ``"1"``)."""
    full = next((r for r in rows if r["target_ratio"] is None and r["method"] == "full"), None)
    return None if full is None else full["per_seed"]


def quality_at(points: list[dict[str, Any]], share: float) -> float | None:
    """One run's quality at exactly ``share`` of the tokens: linear between the two evaluated
    points around it (None when the run has no point on either side)."""
    measured = sorted((p["token_ratio"], p["quality"]) for p in points if p.get("target_ratio") is not None)
    for (low_share, low_quality), (high_share, high_quality) in zip(measured, measured[1:]):
        if low_share <= share <= high_share:
            weight = (share - low_share) / (high_share - low_share)
            return low_quality + weight * (high_quality - low_quality)
    return None


def seed_gaps(data: dict[str, Any], ratios: list[float]) -> list[str]:
    """Each SPLIT method's gap to the control, seed by seed, at each ratio: as calibrated
    (the study's point) and at exactly that share of the tokens (interpolated)."""
    rows = data["rows"]
    control = control_per_seed(rows)
    if control is None:
        return []
    lines = []
    by = {(r["method"], r["target_ratio"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"].startswith("split")))
    runs = {(run["method"], str(run["seed"])): run for run in data.get("runs", []) if run.get("method")}
    for method in methods:
        for ratio in ratios:
            row = by.get((method, ratio))
            if row is None:
                continue
            seeds = sorted(set(control) & set(row["per_seed"]))
            gaps = [(row["per_seed"][s] - control[s]) * 100 for s in seeds]
            line = f"{method} at {ratio:.0%}: {', '.join(f'{g:+.2f}' for g in gaps)} ({spread(gaps)}) as calibrated"
            exact = [quality_at(runs[(method, s)]["points"], ratio) for s in seeds if (method, s) in runs]
            if len(exact) == len(seeds) and None not in exact:
                exact_gaps = [(q - control[s]) * 100 for q, s in zip(exact, seeds)]
                line += f"; at exactly {ratio:.0%}: {', '.join(f'{g:+.2f}' for g in exact_gaps)} ({spread(exact_gaps)})"
            lines.append(line)
    return lines


def timed_speedups(data: dict[str, Any]) -> dict[tuple[str, float | None], float]:
    """(method, target ratio) -> the speed step's measured speed-up over the control: the
    rows' own (``speedup_vs_full``), else the study's ``point_speed`` (older JSON)."""
    found = {(r["method"], r["target_ratio"]): r["speedup_vs_full"] for r in data["rows"] if "speedup_vs_full" in r}
    for point in (data.get("point_speed") or {}).get("points", []):
        found.setdefault((point["method"], point["target_ratio"]), point["speedup_vs_full"])
    return found


def speed_lines(data: dict[str, Any]) -> list[str]:
    """The quality table's speed twin: each timed point's images/s ratio to the control,
    measured side by side by the study's speed step (one seed; ``-``: not timed)."""
    timed = timed_speedups(data)
    record = data.get("point_speed") or {}
    if not timed or not record:
        return []
    rows = data["rows"]
    thresholded = list(dict.fromkeys(r["method"] for r in rows if r["target_ratio"] is not None))
    targets = sorted({r["target_ratio"] for r in rows if r["target_ratio"] is not None})
    full = record["full"][0]
    lines = [
        f"Speed-up over the control (its {full['images_per_s']:.0f} images/s), measured side by side: "
        f"seed {record['seed']}, batch {record['batch_size']}, {record['rounds']} interleaved rounds "
        f"on {record['device']}, {record['machine'].get('torch_threads', '?')} threads",
        "",
        "| token ratio | " + " | ".join(thresholded) + " |",
        "| --- |" + " --- |" * len(thresholded),
    ]
    backbone = backbone_speedups(data)
    for target in targets:
        cells = [
            f"{timed[(m, target)]:.2f}x"
            + (f" (backbone {backbone[(m, target)]:.2f}x)" if (m, target) in backbone else "")
            if (m, target) in timed
            else "-"
            for m in thresholded
        ]
        lines.append(f"| {target:.2f} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def backbone_speedups(data: dict[str, Any]) -> dict[tuple[str, float | None], float]:
    """(method, target ratio) -> a detector's backbone alone against the control's."""
    return {
        (r["method"], r["target_ratio"]): r["backbone_speedup_vs_full"]
        for r in data["rows"]
        if r.get("backbone_speedup_vs_full") is not None
    }


def quality_table(rows: list[dict[str, Any]], metric: str) -> list[str]:
    """Every thresholded method's ``metric`` at every token ratio (mean ± std in %)."""
    thresholded = list(dict.fromkeys(r["method"] for r in rows if r["target_ratio"] is not None))
    targets = sorted({r["target_ratio"] for r in rows if r["target_ratio"] is not None})
    by = {(r["method"], r["target_ratio"]): r for r in rows}
    lines = ["| token ratio | " + " | ".join(thresholded) + " |", "| --- |" + " --- |" * len(thresholded)]
    for target in targets:
        lines.append(f"| {target:.2f} | " + " | ".join(cell(by.get((m, target)), metric) for m in thresholded) + " |")
    return [*lines, ""]


def study_lines(data: dict[str, Any], ratios: list[float]) -> list[str]:
    """Every table of one study JSON, as markdown lines (a companion quality, e.g. a
    detector's mask AP, in a table of its own after the main one)."""
    metric = data["metric"]
    rows = data["rows"]
    companions = [k.removeprefix("per_seed_") for k in rows[0] if k.startswith("per_seed_")] if rows else []
    lines = [f"## {data.get('name', 'study')} ({data.get('source', '?')}), {metric} (%)", ""]
    lines += quality_table(rows, metric)
    for companion in companions:
        lines += [f"{companion} (%):", "", *quality_table(rows, companion)]
    lines += speed_lines(data)
    for r in rows:
        if r["target_ratio"] is None:
            seeds = ", ".join(f"{v * 100:.2f}" for v in r["per_seed"].values())
            also = "".join(f", {c} {cell(r, c)}" for c in companions)
            lines.append(
                f"* {r['method']}: {cell(r, metric)}{also} at {r['tokens_per_image']:.0f} tokens (seeds {seeds})"
            )
    lines.append("")
    levers = data.get("levers") or []
    if levers:
        keys = [k for k in levers[0] if k != "method"]
        header = " | ".join(f"{metric} at {float(k[1:]):.0%} tokens (vs the control)" for k in keys)
        lines += [f"| SPLIT method | {header} |", "| --- |" + " --- |" * len(keys)]
        for lever in levers:
            cells = []
            for k in keys:
                c = lever[k]
                if c is None:
                    cells.append("-")
                    continue
                cells.append(
                    f"{c[metric] * 100:.1f} ± {c['std'] * 100:.1f} ({-c['gap_points']:+.2f}) at {c['token_ratio']:.1%}"
                )
            lines.append(f"| {lever['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    gaps = seed_gaps(data, ratios)
    if gaps:
        lines += ["Gap to the control, seed by seed (points, SPLIT minus control):", ""]
        lines += [f"* {g}" for g in gaps] + [""]
    for name, goal in data.get("goals", {}).items():
        lines.append(f"goal {name}: {json.dumps(goal, default=str)[:400]}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", type=Path, default=list(DEFAULT_STUDIES), help="study JSON files")
    parser.add_argument("--at", default="0.5,0.7", help="token ratios for the seed-by-seed gaps (comma-separated)")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.at.split(",")]
    for path in args.studies:
        print("\n".join(study_lines(json.loads(path.read_text()), ratios)))
        print()


if __name__ == "__main__":
    main()
