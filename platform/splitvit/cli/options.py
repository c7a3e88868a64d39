"""Parser pieces the subcommands share: ``-v`` and ``--tracking-uri`` (a parent parser),
``--set`` overrides, the comma-separated lists and numbers some options take, and the
checks of options that run before torch, Ray and MLflow load (a tracking store that
does not answer, a Ray address of the wrong form, a policy name)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
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
    """``"0.4,0.6"`` -> ``[0.4, 0.6]``; a clear error for anything else (a value outside [0, 1] too)."""
    if text is None:
        return None
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        # bad input: exit 2 with one line, and the envelope written, as for any other bad option
        raise ValueError(f"--thresholds: expected comma-separated numbers in [0, 1], got {text!r}") from None
    for i, value in enumerate(values):
        if not 0.0 <= value <= 1.0:  # NaN too
            raise ValueError(f"--thresholds: thresholds[{i}] = {value} is outside [0, 1]")
    return values


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
    resolved = resolve_model_uri(source, checked_tracking_uri(args))
    print(f"{source}: run {resolved.run_id}, checkpoint {resolved.checkpoint}")
    return resolved.checkpoint, thresholds if thresholds is not None else resolved.thresholds


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``; anything else is bad input, said at
    once, before anything loads."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


#: ``--count 0``, ``--samples -3``: a whole number >= 1
positive_int = int_at_least(1)
#: ``--workers -2``: a whole number >= 0
non_negative_int = int_at_least(0)


def folder_name(text: str) -> str:
    """An argparse type: a name that is one folder under the storage path (``--name`` of
    a sweep or a study): no ``/``, not ``.`` or ``..``, so that it cannot reach outside
    it or make a tree of folders."""
    if not text.strip() or "/" in text or "\\" in text or text in (".", "..") or not text.isprintable():
        raise argparse.ArgumentTypeError(
            f"must be one folder name (letters, digits, '-', '_', '.'; no '/', not '.' or '..'), got {text!r}"
        )
    return text


def check_policy(option: str, name: str | None) -> None:
    """A ``--policy`` that names no split policy: one line before torch loads."""
    from ..model.names import POLICY_NAMES

    if name is not None and name not in POLICY_NAMES:
        raise ValueError(f"{option}: unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")


#: ``--device`` values torch takes here: the CPU, a CUDA GPU (by index), Apple's GPU.
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps")


def check_device(device: str) -> None:
    """A ``--device`` torch would refuse (``gpu``, ``cuda:x``): one line before it loads."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"--device: expected cpu, cuda, cuda:N or mps, got {device!r}")


def check_address(args: argparse.Namespace) -> None:
    """``--address`` (else ``$RAY_ADDRESS``) has the form of a Ray cluster's address:
    said before torch and Ray load; whether the cluster answers is the preflight's."""
    from ..cluster.preflight import check_ray_address_form, resolve_ray_address

    address, source = resolve_ray_address(getattr(args, "address", None))
    if address:
        check_ray_address_form(address, source)


def check_run_settings(config, *, tracked: bool | None = None) -> None:
    """What a run's settings and files alone show, before torch loads: where it writes,
    its annotation files, its tracking URI's scheme
    (:func:`~splitvit.train.names.check_locations`), and an MLflow server that does not
    answer (one request, seconds; the preflight asks again once torch has loaded).
    ``tracked``: whether the command logs to the config's store (default: its
    ``tracking.enabled``; a study's parent run logs where its runs do not)."""
    from ..cluster.preflight import check_tracking
    from ..train.names import check_locations, tracking_key

    check_locations(config)
    if config.tracking.enabled if tracked is None else tracked:
        # the scheme (again, when enabled); a server: one request
        check_tracking(config.tracking_uri(), tracking_key(config), write=False)


def checked_tracking_uri(args: argparse.Namespace) -> str:
    """The MLflow store a command that reads MLflow uses (``--tracking-uri``, else
    ``$MLFLOW_TRACKING_URI``, else the default config's), checked before MLflow loads:
    its scheme is one MLflow has a store for, and a server answers within seconds (one
    request, no retries: MLflow's own client retries for minutes). A local store's
    existence is the caller's to check (:func:`splitvit.tracking.runs.missing_store`).
    Raises ``ValueError`` naming the setting."""
    from ..cluster.preflight import check_tracking
    from ..config import ExperimentConfig

    uri = args.tracking_uri or ExperimentConfig().tracking_uri()
    key = "--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI"
    if not args.tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI"):
        key = "the default MLflow store"
    check_tracking(uri, key, write=False)  # the scheme; a server: one request, seconds
    return uri
