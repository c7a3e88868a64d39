"""Parser pieces the subcommands share: ``-v`` and ``--tracking-uri`` (a parent parser),
``--set`` overrides, and the comma-separated lists some options take."""

from __future__ import annotations

import argparse
from pathlib import Path


def common_options(mlflow: str | None) -> argparse.ArgumentParser:
    """``-v`` and ``--tracking-uri``, for every subcommand (after its name).

    Their defaults are suppressed so that a subcommand's parser does not overwrite
    a ``-v`` given before the subcommand. ``mlflow`` says what the URI is for; None:
    the command does not use MLflow, and its help says the option is ignored.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress at INFO level"
    )
    common.add_argument(
        "--tracking-uri",
        default=argparse.SUPPRESS,
        metavar="URI",
        help=mlflow or "ignored: this command does not use MLflow (accepted, as on every command, for scripts)",
    )
    # the envelope names the store only for commands that use one
    common.set_defaults(uses_mlflow=mlflow is not None)
    return common


def add_set_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE``, repeatable, into ``args.overrides`` (what each command
    makes of a key is ``help_text``)."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=f"repeatable; {help_text}"
    )


TRACKING_HELP = "MLflow store, over $MLFLOW_TRACKING_URI and the config's tracking.tracking_uri"


def overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides (positional KEY=VALUE first, where a command keeps them as an
    alias), then ``--tracking-uri`` as ``tracking.tracking_uri``, last so that it wins."""
    found = [*getattr(args, "positional_overrides", []), *args.overrides]
    if args.tracking_uri:
        found.append(f"tracking.tracking_uri={args.tracking_uri}")
    return found


def parse_thresholds(text: str | None) -> list[float] | None:
    """``"0.4,0.6"`` -> ``[0.4, 0.6]``; a clear error for anything else."""
    if text is None:
        return None
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        # bad input: exit 2 with one line, and the envelope written, as for any other bad option
        raise ValueError(f"--thresholds: expected comma-separated numbers in [0, 1], got {text!r}") from None


def number_list(option: str, text: str | None, kind: type = float) -> tuple | None:
    """``"0.5,0.7"`` -> ``(0.5, 0.7)``; a bad item is an error naming the option."""
    if text is None:
        return None
    try:
        return tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def model_source(args: argparse.Namespace, source: str | None) -> tuple[str | None, list[float] | None]:
    """``(checkpoint, thresholds)`` for a command that takes a checkpoint: a path or
    ``s3://`` URI as it is; an MLflow ``models:/`` or ``runs:/`` URI resolved to its
    run's checkpoint and the thresholds its model was recorded with (``--thresholds``
    given on the command line win). Only a URI makes the command use MLflow: otherwise
    its envelope names no store."""
    from ..tracking.model_uris import is_model_uri, resolve_model_uri

    thresholds = parse_thresholds(args.thresholds)
    if source is None or not is_model_uri(source):
        args.report.mlflow = {}
        local = source[len("file://") :] if source and source.startswith("file://") else source
        if local and "://" not in local and not Path(local).expanduser().exists():
            # before torch loads: a mistyped path is one line in a second
            raise FileNotFoundError(f"no checkpoint at {source} (a checkpoint folder holding model.pt, or the file)")
        return source, thresholds
    from ..config import ExperimentConfig

    resolved = resolve_model_uri(source, args.tracking_uri or ExperimentConfig().tracking_uri())
    print(f"{source}: run {resolved.run_id}, checkpoint {resolved.checkpoint}")
    return resolved.checkpoint, thresholds if thresholds is not None else resolved.thresholds


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--count 0`` is bad input, said at once)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
