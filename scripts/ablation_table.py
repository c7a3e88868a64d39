"""The studies' ablation: each SPLIT lever beside the control it was fine-tuned with, from study JSON.

    python scripts/ablation_table.py                      # classification, the committed runs
    python scripts/ablation_table.py --study dense        # dense prediction, the committed runs
    python scripts/ablation_table.py STUDY_JSON ... [--ratios 0.5,0.7] [--gap-at 0.5,0.7]

Every lever was run as ``splitvit study <study file> [--scale ...] --methods full,<lever>``,
so each JSON holds the lever and its own control, fine-tuned alike from the same
references. One row per (fine-tune, lever): its quality at each ``--ratios`` token
ratio (mean ± std over seeds, in %, as the study prints it) and its gap to that JSON's control at each
``--gap-at`` ratio (SPLIT minus control, seed by seed, then mean ± std: negative is
below); one row per fine-tune for the control itself (with ``--baselines``, and for the
dense study, entropy and random too). The fine-tune's length is read
from the runs' epoch histories. Given files, every SPLIT method in each is listed;
without, the committed runs that make the ablation tables of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements"


class Source(NamedTuple):
    """One study JSON, the SPLIT methods to take from it (None: all) and what its fine-tune changed."""

    path: Path
    methods: tuple[str, ...] | None = None
    note: str = ""


def _m(folder: str, name: str, *methods: str, note: str = "") -> Source:
    return Source(MEASUREMENTS / folder / name, methods or None, note)


# Each lever once, from the run that measured it (a later run that reused it repeats its figures).
CLASSIFICATION = (
    _m("cpu-2026-12-01", "study_fashion.json"),
    _m("cpu-2026-12-01-long", "study_fashion_long.json", "split-0.7"),
    _m("cpu-2026-12-01-long", "study_fashion_long_agg.json", "split-0.7-agg"),
    _m("cpu-2026-12-02", "study_fashion_long_50mixed.json", "split-0.5-agg-mixed"),
    _m("cpu-2026-12-01-long", "study_fashion_long8_agg.json", "split-0.7-agg"),
    _m("cpu-2026-12-02", "study_fashion_long8_headline.json", "split-0.5-agg", "split-0.5-agg-mixed"),
    _m("cpu-2026-12-02-length", "study_fashion_ctx.json", "split-0.5-agg-mixed-ctx"),
    _m("cpu-2026-12-02-rerun", "study_fashion_finetune_lr.json", note="lr 6e-4"),
    _m("cpu-2026-12-02-scratch10", "study_fashion_scratch10.json"),
    _m("cpu-2026-12-02-length", "study_fashion_finetune_12_ctx.json"),
)
DENSE = (
    _m("cpu-2026-12-02-seg", "study_fashion_seg_long8_50pl.json"),
    _m("cpu-2026-12-03-seg", "study_fashion_seg_ctx.json", "split-0.5-agg-mixed-ctx"),
    _m("cpu-2026-12-03-seg", "study_fashion_seg_scratch12.json"),
    _m("cpu-2026-12-05-seg-speed", "study_fashion_seg.json", note="rerun 2026-12-05"),
    _m("cpu-2026-12-05-seg-speed", "study_fashion_seg_t2.json", note="rerun 2026-12-05"),
)
# the committed runs, the quality columns' ratios, and whether entropy and random get rows
STUDIES = {"classification": (CLASSIFICATION, "0.5,0.7", False), "dense": (DENSE, "0.1,0.3,0.5,0.7,0.8", True)}


def _cell(row: dict[str, Any] | None, metric: str) -> str:
    """A study row's ``mean ± std`` in % (as the study prints it), ``-`` where there is none."""
    return "-" if row is None else f"{row[metric] * 100:.1f} ± {row[metric + '_std'] * 100:.1f}"


def _gap(values: list[float]) -> str:
    """Per-seed gaps in points as ``mean ± std``."""
    if len(values) < 2:
        return f"{statistics.fmean(values):+.2f}"
    return f"{statistics.fmean(values):+.2f} ± {statistics.stdev(values):.2f}"


def fine_tune_epochs(data: dict[str, Any], method: str) -> int | None:
    """How many epochs ``method``'s runs fine-tuned (the length of their epoch history)."""
    lengths = {len(run.get("history") or []) for run in data.get("runs", []) if run.get("method") == method}
    return lengths.pop() if len(lengths) == 1 else None


def source_rows(source: Source, ratios: list[float], gap_at: list[float], baselines: bool) -> list[dict[str, Any]]:
    """The control's row and one row per SPLIT method (and entropy and random with
    ``baselines``) of one study JSON."""
    data = json.loads(source.path.read_text())
    metric = data["metric"]
    rows = {(r["method"], r["target_ratio"]): r for r in data["rows"]}
    control_row = rows[("full", None)]
    control = control_row["per_seed"]
    kinds = ("split", "entropy", "random") if baselines else ("split",)
    listed = [m for m, ratio in rows if m.startswith(kinds) and ratio is not None]
    methods = source.methods or tuple(dict.fromkeys(listed))
    label = f"{source.path.parent.name}/{source.path.name}"
    out = [
        {
            "epochs": fine_tune_epochs(data, "full"),
            "note": source.note,
            "method": "full (the control)",
            "cells": [_cell(control_row, metric)] * len(ratios),
            "gaps": [""] * len(gap_at),
            "source": label,
        }
    ]
    for method in methods:
        cells = [_cell(rows.get((method, ratio)), metric) for ratio in ratios]
        gaps = []
        for ratio in gap_at:
            row = rows.get((method, ratio))
            seeds = sorted(set(control) & set(row["per_seed"])) if row else []
            gap = [(row["per_seed"][s] - control[s]) * 100 for s in seeds]
            gaps.append(_gap(gap) if gap else "-")
        out.append(
            {
                "epochs": fine_tune_epochs(data, method),
                "note": source.note,
                "method": method,
                "cells": cells,
                "gaps": gaps,
                "source": label,
            }
        )
    return out


def table_lines(sources: list[Source], ratios: list[float], gap_at: list[float], baselines: bool = False) -> list[str]:
    """The ablation as one markdown table, ordered by fine-tune length; each control once per fine-tune."""
    rows, controls_seen = [], set()
    for source in sources:
        for row in source_rows(source, ratios, gap_at, baselines):
            key = (row["epochs"], row["note"])
            if row["method"].startswith("full"):
                if key in controls_seen:
                    continue
                controls_seen.add(key)
            rows.append(row)
    rows.sort(key=lambda r: (r["epochs"] or 0, r["note"], not r["method"].startswith("full")))
    header = ["fine-tune", "method"] + [f"{r:.0%} tokens" for r in ratios]
    header += [f"vs control at {r:.0%}" for r in gap_at] + ["JSON (docs/measurements/)"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        length = f"{row['epochs']} epochs" + (f", {row['note']}" if row["note"] else "")
        cells = [length, row["method"], *row["cells"], *row["gaps"], row["source"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", type=Path, help="study JSON files (default: the committed runs)")
    parser.add_argument("--study", choices=sorted(STUDIES), default="classification", help="which committed runs")
    parser.add_argument("--ratios", help="token ratios for the quality columns (default per study)")
    parser.add_argument("--gap-at", default="0.5,0.7", help="token ratios for the gap columns")
    parser.add_argument("--baselines", action="store_true", help="entropy and random rows too (dense: always)")
    args = parser.parse_args(argv)
    defaults, default_ratios, baselines = STUDIES[args.study]
    sources = [Source(path) for path in args.studies] or list(defaults)
    ratios = [float(r) for r in (args.ratios or default_ratios).split(",")]
    gap_at = [float(r) for r in args.gap_at.split(",")]
    print("\n".join(table_lines(sources, ratios, gap_at, baselines or args.baselines)))


if __name__ == "__main__":
    main()
