"""A recipe's evidence, read from the study JSON that proved it.

    python scripts/recipe_evidence.py RECIPE            # the evidence block, from its result JSON
    python scripts/recipe_evidence.py RECIPE --check    # exit 1 where the recipe file says otherwise
    python scripts/recipe_evidence.py --from STUDY.json --method M   # a new recipe's block, from its study

The figures a recipe file carries (``evidence.points``: quality, token share, the gap to
the full-resolution control and its spread over seeds, the speed-up measured by the
study's speed step) are this script's reading of the committed JSON the file names
(``evidence.result``); ``tests/test_recipes.py`` checks every shipped recipe with
:func:`evidence_points`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "platform"))

from study_tables import backbone_speedups, timed_speedups  # noqa: E402

from splitvit.recipes import Recipe, load_recipe  # noqa: E402
from splitvit.study.report import fine_tune_pace  # noqa: E402
from splitvit.study.runs import MethodRun  # noqa: E402

#: the token shares a recipe's evidence is quoted at (the studies' parity goals)
SHARES = (0.7, 0.5)


def evidence_points(data: dict[str, Any], method: str) -> list[dict[str, Any]]:
    """``method``'s figures at each of :data:`SHARES` in a study's JSON: the lever row
    the study stored (means over seeds, the gap as control minus method) turned into
    the recipe's terms (quality and gap in points, positive: above the control), with
    the speed step's speed-ups (rounded as the tables print them)."""
    metric = data["metric"]
    row = next(r for r in data["levers"] if r["method"] == method)
    whole, backbone = timed_speedups(data), backbone_speedups(data)
    points = []
    for share in SHARES:
        cell = row[f"r{share}"]
        point = {
            "share": share,
            "quality": round(cell[metric], 4),
            "token_ratio": round(cell["token_ratio"], 4),
            "vs_control_points": round(-cell["gap_points"], 2),
            "spread_points": round(cell["gap_std_points"], 2),
            "speed": _rounded(whole.get((method, share))),
        }
        if (method, share) in backbone:
            point["backbone_speed"] = _rounded(backbone[(method, share)])
        points.append(point)
    return points


def evidence_pace(data: dict[str, Any], method: str, trained_in: dict[str, Any] | None = None) -> list[float] | None:
    """``method``'s fine-tuning pace over the control's, seed by seed (the study's pace
    line, rounded as it prints it); None where the JSON's runs cannot give one for every
    seed, or where a run was trained by an earlier invocation (beside other runs: its
    pace is not a side-by-side figure). ``trained_in``: that earlier invocation's JSON
    (a recipe's ``evidence.pace_result``), where the runs were trained side by side;
    the pace is read there, and its runs of the method and the control must be the
    ones ``data`` reused, epoch for epoch."""
    if trained_in is not None:
        if _histories(trained_in, method) != _histories(data, method):
            raise ValueError(f"the {method} and full-resolution runs of the two JSONs differ: not the same runs")
        data = trained_in
    runs = [MethodRun.from_dict(run) for run in data["runs"]]
    paces = [p for p in fine_tune_pace(runs) if p.method == method]
    if len(paces) != len(data["seeds"]) or any(p.reused for p in paces):
        return None
    return [round(p.ratio, 2) for p in paces]


def _histories(data: dict[str, Any], method: str) -> dict[tuple[str, int], Any]:
    """The epoch histories of ``method``'s and the control's runs, by method and seed."""
    return {(r["method"], r["seed"]): r["history"] for r in data["runs"] if r["method"] in (method, "full")}


def pace_json(recipe: Recipe) -> dict[str, Any] | None:
    """The JSON of the invocation that trained the recipe's runs side by side, where its
    evidence names one apart from its result (``evidence.pace_result``)."""
    if recipe.evidence is None or recipe.evidence.pace_result is None:
        return None
    return json.loads((ROOT / recipe.evidence.pace_result).read_text())


def control_quality(data: dict[str, Any]) -> float:
    """The full-resolution control's quality, mean over seeds."""
    return round(next(r for r in data["rows"] if r["method"] == "full")[data["metric"]], 4)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def measured_figures(data: dict[str, Any], method: str, trained_in: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a study's JSON says of ``method`` in a recipe file's terms: the control's
    quality, the pace where the runs give one (:func:`evidence_pace`, ``trained_in`` as
    there) and the points, each without the figures it lacks."""
    figures: dict[str, Any] = {"control": control_quality(data)}
    pace = evidence_pace(data, method, trained_in)
    if pace is not None:
        figures["pace"] = pace
    figures["points"] = [{k: v for k, v in p.items() if v is not None} for p in evidence_points(data, method)]
    return figures


def new_evidence(path: Path, method: str) -> dict[str, Any]:
    """The evidence block of a recipe not written yet: what the study JSON at ``path``
    says of ``method`` (its study file, the JSON, metric, seeds, the control, its points
    and pace); its ``date`` and ``commit`` are the person's to fill in."""
    data = json.loads(path.read_text())
    if not any(r["method"] == method for r in data["levers"]):
        methods = sorted({r["method"] for r in data["levers"]})
        raise SystemExit(f"{path}: no method {method!r} in its lever rows; it has {methods}")
    resolved = path.resolve()
    return {
        "study": data["source"],
        "method": method,
        "result": str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path),
        "metric": data["metric"],
        "seeds": len(data["seeds"]),
        **measured_figures(data, method),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", help="a recipe name (classification-v1 ...)")
    parser.add_argument("--check", action="store_true", help="exit 1 where the recipe file's figures differ")
    parser.add_argument("--from", dest="study_json", type=Path, help="a study's JSON: a new recipe's evidence block")
    parser.add_argument("--method", help="with --from: the study's method the new recipe is")
    args = parser.parse_args(argv)
    if args.study_json is not None or args.method is not None:
        if args.recipe or args.check or args.study_json is None or args.method is None:
            parser.error("--from and --method go together, without a recipe name or --check")
        evidence = {"evidence": new_evidence(args.study_json, args.method)}
        print(yaml.safe_dump(evidence, sort_keys=False, default_flow_style=None), end="")
        return 0
    if not args.recipe:
        parser.error("give a recipe name, or --from STUDY.json --method M")
    recipe = load_recipe(args.recipe)
    if recipe.evidence is None:
        print(f"{recipe.name} carries no evidence")
        return 1
    data = json.loads((ROOT / recipe.evidence.result).read_text())
    try:
        measured = measured_figures(data, recipe.evidence.method, pace_json(recipe))
    except ValueError as exc:
        print(f"{recipe.name}: {recipe.evidence.pace_result} and {recipe.evidence.result}: {exc}")
        return 1
    if not args.check:
        print(yaml.safe_dump(measured, sort_keys=False, default_flow_style=None), end="")
        return 0
    stated = {
        "control": recipe.evidence.control,
        "points": [{k: v for k, v in vars(p).items() if v is not None} for p in recipe.evidence.points],
    }
    if recipe.evidence.pace is not None:
        stated["pace"] = list(recipe.evidence.pace)
    if stated != measured:
        print(f"{recipe.name}: the file says {stated}, {recipe.evidence.result} says {measured}")
        return 1
    print(f"{recipe.name}: the evidence matches {recipe.evidence.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
