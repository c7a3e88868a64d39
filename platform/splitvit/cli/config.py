"""``splitvit config``: the effective config of an experiment file (or of one run of a
study), every key with the layer that set it: library defaults < recipe < experiment file <
study ``config:`` < study stage < method entry < ``--set``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .options import add_set_option, common_options
from .output import emit, print_table, yaml_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit config`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "config",
        parents=[common_options(None)],
        help="print the effective config (experiment file, or a study's run) with the layer that set each key",
    )
    p.add_argument("config", nargs="?", help="experiment YAML (with --study: optional, the study's base)")
    add_set_option(p, "a dotted config override, as train and study take it")
    p.add_argument("--study", help="a study file: show one of its runs (with --method)")
    p.add_argument("--method", help="the study's method or lever (or 'reference': the full-resolution reference)")
    p.add_argument("--scale", help="with --study: apply the study file's scales.<SCALE> section")
    p.add_argument("--seed", type=int, help="with --study: the run of this seed (default: the study's first)")
    p.add_argument("--changed", action="store_true", help="only the keys a layer set (not the library's defaults)")
    p.add_argument("--json", help="write the effective config and each key's layer to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config's layers (files only: no torch), print each key's value and layer."""
    from ..config import config_layers

    config = _resolve(args)
    resolved = config_layers(config)
    rows = [
        {"key": key, "value": yaml_text(entry["value"]), "set by": entry["layer"]}
        for key, entry in resolved["keys"].items()
        if not (args.changed and entry["layer"] == "default")
    ]
    print(f"recipe: {_recipe_line(config)}")
    print_table(rows, ["key", "value", "set by"])
    emit(args, {**resolved, "config": config.to_dict(redact=True)})
    return 0


def _resolve(args: argparse.Namespace) -> Any:
    from ..config import load_config

    if args.study is None:
        for option in ("method", "scale", "seed"):
            if getattr(args, option) is not None:
                raise ValueError(f"--{option} needs --study")
        if args.config is None:
            raise ValueError("name an experiment file (e.g. jobs/configs/smoke.yaml) or a study (--study)")
        return load_config(args.config, args.overrides)
    from ..study.spec import load_study

    if args.method is None:
        raise ValueError("--study needs --method: one of the study's methods or levers, or reference")
    spec = load_study(args.study, scale=args.scale, overrides=args.overrides, settings_only=True)
    if args.method != "reference" and args.method not in spec.methods:  # a lever: beside the headline
        methods = [*spec.methods, args.method]
        spec = load_study(args.study, scale=args.scale, overrides=args.overrides, methods=methods, settings_only=True)
    if args.config is not None and Path(args.config).resolve() != spec.base.resolve():
        raise ValueError(f"{args.config} is not {args.study}'s base ({spec.base}); give one or the other")
    seed = spec.seeds[0] if args.seed is None else args.seed
    if seed not in spec.seeds:
        raise ValueError(f"--seed {seed}: the study's seeds are {', '.join(map(str, spec.seeds))}")
    method = None if args.method == "reference" else args.method
    return spec.run_config(seed, method, f"{args.method}-s{seed}", settings_only=True)


def _recipe_line(config: Any) -> str:
    if config.recipe != "none":
        return f"{config.recipe} (under every layer below; `splitvit recipes show {config.recipe}`)"
    if config.model.policy.kind != "learned":
        return f"none (model.policy.kind is {config.model.policy.kind}: recipes are the learned policy's)"
    return "none (the library's defaults)"
