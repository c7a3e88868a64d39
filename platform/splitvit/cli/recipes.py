"""``splitvit recipes``: the named, versioned SPLIT settings, with the evidence that proved each;
``splitvit recipes show NAME``: one recipe's settings."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..jsontypes import JsonObject
from .options import common_options
from .output import emit, print_table, yaml_text

if TYPE_CHECKING:
    from ..recipes import EvidencePoint, Recipe


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit recipes`` (and ``recipes show NAME``) to the subcommands ``sub``."""
    p = sub.add_parser(
        "recipes",
        parents=[common_options(None)],
        help="list the recipes (the proven settings, by task and version) with their evidence; `show NAME`: one",
    )
    p.add_argument("action", nargs="?", choices=["show"], help="show one recipe's settings and evidence")
    p.add_argument("name", nargs="?", help="a recipe (classification-v1 ...) or a task (its current recipe)")
    p.add_argument("--json", help="write the recipes (or the one shown) to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """List every recipe, or show one (``show NAME``)."""
    from ..recipes import load_recipe, recipe_names

    if args.action is None and args.name is not None:
        raise ValueError(f"recipes: unexpected {args.name!r}; to see one recipe: splitvit recipes show {args.name}")
    if args.action == "show":
        if args.name is None:
            raise ValueError(f"recipes show: name a recipe: {', '.join(recipe_names())}")
        recipe = load_recipe(args.name)
        _show(recipe)
        emit(args, _record(recipe))
        return 0
    recipes = [load_recipe(name) for name in recipe_names()]
    rows = [_row(recipe) for recipe in recipes]
    print_table(rows, list(rows[0]))
    print(
        "vs control: the recipe's quality minus the full-resolution control's, points (mean ± std over seeds, "
        "seed by seed), at <= 70% / 50% of the tokens; speed: images/s over full resolution's, side by side "
        "(detection: whole detector, backbone); fine-tune pace: training images/s over the control's, seed by seed"
    )
    print("default: what a learned policy runs when its config names no recipe (recipe: none for the library's)")
    emit(args, {"recipes": [_record(recipe) for recipe in recipes]})
    return 0


def _row(recipe: Recipe) -> dict[str, str]:
    """One line of the listing: the recipe and its figures at 70% and 50% of the tokens."""
    row = {"recipe": recipe.name, "task": recipe.task, "default": "yes" if recipe.current else ""}
    evidence = recipe.evidence
    for share in (0.7, 0.5):
        point = evidence.at(share) if evidence else None
        label = f"{round(share * 100)}%"
        row[f"vs control @{label}"] = (
            f"{point.vs_control_points:+.2f} ± {point.spread_points:.2f}" if point is not None else "-"
        )
        row[f"speed @{label}"] = _speed(point)
    row["fine-tune pace"] = _pace(evidence.pace if evidence else None)
    row["proven by"] = f"{evidence.study} ({evidence.date}, {evidence.commit})" if evidence else "-"
    return row


def _speed(point: EvidencePoint | None) -> str:
    if point is None or point.speed is None:
        return "-"
    backbone = f", {point.backbone_speed:.2f}x" if point.backbone_speed is not None else ""
    return f"{point.speed:.2f}x{backbone}"


def _pace(pace: tuple[float, ...] | None) -> str:
    return "-" if pace is None else ", ".join(f"{ratio:.2f}x" for ratio in pace)


def _show(recipe: Recipe) -> None:
    """One recipe: what it is, its settings (as a config's keys), and its evidence."""
    print(f"{recipe.name} ({recipe.task}, version {recipe.version}{', the default' if recipe.current else ''})")
    print(f"  {recipe.summary}")
    print("settings (over the library's defaults; a config's own keys win):")
    width = max(len(key) for key in recipe.settings)
    for key, value in recipe.settings.items():
        print(f"  {key.ljust(width)}  {yaml_text(value)}")
    evidence = recipe.evidence
    if evidence is None:
        print("evidence: none recorded")
        return
    print(
        f"evidence: {evidence.study}, method {evidence.method}, {evidence.seeds} seeds, "
        f"{evidence.date} at commit {evidence.commit}; figures from {evidence.result}"
    )
    print(f"  control (full resolution): {evidence.metric} {evidence.control:.4f}")
    for point in evidence.points:
        print(
            f"  at <= {point.share:.0%} of the tokens ({point.token_ratio:.2%} measured): {evidence.metric} "
            f"{point.quality:.4f}, {point.vs_control_points:+.2f} ± {point.spread_points:.2f} points vs the control, "
            f"speed {_speed(point)}"
        )
    if evidence.pace is not None:
        trained = f"; trained side by side in {evidence.pace_result}" if evidence.pace_result else ""
        print(f"  fine-tuning pace: {_pace(evidence.pace)} the control's images/s (seed by seed{trained})")


def _record(recipe: Recipe) -> JsonObject:
    """A recipe as the JSON envelope carries it."""
    evidence = asdict(recipe.evidence) if recipe.evidence else None
    return {
        "name": recipe.name,
        "task": recipe.task,
        "version": recipe.version,
        "default": recipe.current,
        "summary": recipe.summary,
        "settings": recipe.settings,
        "evidence": evidence,
    }
