"""The ``splitvit`` command.

Each subcommand parses its arguments, calls the library, prints its figures and,
with ``--json PATH``, writes them as JSON for scripts: one envelope for every
command (:func:`envelope`), written on failure too. Every subcommand takes ``-v``
and ``--tracking-uri`` (:func:`_common`); those that take config overrides take
them as ``--set KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("splitvit")

#: the envelope's MLflow block; every key is there, None where the command has no such thing
MLFLOW_KEYS = ("tracking_uri", "experiment_id", "run_id", "url")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (no-op when ``path`` is None); commands hand their
    figures to :func:`emit` instead, which puts them in the envelope."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


@dataclass
class Report:
    """What one command run reports: its figures, its MLflow ids and its error line.
    ``main`` creates it (``args.report``) and writes it as the envelope at the end."""

    command: str
    payload: dict[str, Any] = field(default_factory=dict)
    mlflow: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def emit(
    args: argparse.Namespace,
    payload: dict[str, Any],
    *,
    tracking_uri: str | None = None,
    experiment_id: str | None = None,
    run_id: str | None = None,
) -> None:
    """Hand a command's figures (top-level keys of the envelope) and its MLflow ids
    to the envelope ``main`` writes with ``--json``."""
    report: Report = args.report
    report.payload = dict(payload)
    given = {"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run_id}
    report.mlflow.update({k: v for k, v in given.items() if v is not None})


def fail(args: argparse.Namespace, message: str, code: int = 1) -> int:
    """Print ``splitvit COMMAND: error: MESSAGE``, keep it as the envelope's error, return ``code``."""
    args.report.error = message
    print(f"splitvit {args.report.command}: error: {message}", file=sys.stderr)
    return code


def outcome(code: int) -> str:
    """The envelope's ``status`` for an exit status: ok, interrupted (130/143) or failed."""
    if code == 0:
        return "ok"
    return "interrupted" if code in (130, 143) else "failed"


def mlflow_url(tracking_uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's (else the experiment's) page on an http(s) tracking server; None for a
    local store (a SQLite file or a folder has no page until someone runs ``mlflow ui``)."""
    from .config import redact_uri

    if not tracking_uri or not tracking_uri.startswith(("http://", "https://")) or not experiment_id:
        return None
    base = f"{redact_uri(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}"
    return f"{base}/runs/{run_id}" if run_id else base


def _mlflow_block(ids: dict[str, Any]) -> dict[str, Any]:
    """The envelope's ``mlflow``: every key of :data:`MLFLOW_KEYS`, the URI redacted."""
    from .config import redact_uri

    block = {k: ids.get(k) for k in MLFLOW_KEYS}
    if block["run_id"] and not block["experiment_id"] and block["tracking_uri"]:
        # the run knows its experiment: one look-up, no retries, 5 s at most (a server that
        # stopped answering must not hold the command's exit); the envelope is written anyway
        quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
        with contextlib.suppress(Exception), _environment(quick):
            import mlflow

            block["experiment_id"] = (
                mlflow.MlflowClient(block["tracking_uri"]).get_run(block["run_id"]).info.experiment_id
            )
    block["url"] = block["url"] or mlflow_url(block["tracking_uri"], block["experiment_id"], block["run_id"])
    if block["tracking_uri"]:
        block["tracking_uri"] = redact_uri(block["tracking_uri"])
    return block


def envelope(report: Report, code: int, wall_time_s: float) -> dict[str, Any]:
    """The JSON every ``--json`` writes: ``command``, ``status`` (:func:`outcome`),
    ``error`` (None, or the one line printed after ``error:``), ``mlflow`` (the keys
    of :data:`MLFLOW_KEYS`, plus a command's own, e.g. the sweep's ``ui``),
    ``wall_time_s`` (the whole command), and the command's figures at the top level.
    The envelope's keys win over a figure of the same name."""
    body = dict(report.payload)
    own = body.pop("mlflow", None) or {}
    status = outcome(code)
    return {
        **body,
        "command": report.command,
        "status": status,
        "error": None if status == "ok" else (report.error or f"exit status {code}"),
        # a command's own url (the sweep's: a local `mlflow ui` page) gives way to the rule above
        "mlflow": {**own, **_mlflow_block({**{k: v for k, v in own.items() if k != "url"}, **report.mlflow})},
        "wall_time_s": round(wall_time_s, 3),
    }


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set while the block runs, restored after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tracking_env(uri: str | None) -> contextlib.AbstractContextManager[None]:
    """``--tracking-uri`` as ``$MLFLOW_TRACKING_URI`` while the command runs, for what
    reads the store from the environment (``bench train --tracking``, the default
    config); commands with a config also get it as an override, which beats the file."""
    return _environment({"MLFLOW_TRACKING_URI": uri}) if uri else contextlib.nullcontext()


def _common(mlflow: str | None) -> argparse.ArgumentParser:
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


_TRACKING = "MLflow store, over $MLFLOW_TRACKING_URI and the config's tracking.tracking_uri"


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides (positional KEY=VALUE first, where a command keeps them as an
    alias), then ``--tracking-uri`` as ``tracking.tracking_uri``, last so that it wins."""
    found = [*getattr(args, "positional_overrides", []), *args.overrides]
    if args.tracking_uri:
        found.append(f"tracking.tracking_uri={args.tracking_uri}")
    return found


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


# ---------------------------------------------------------------------- demo
def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        parents=[_common(None)],
        help="train a tiny SPLIT model and a full-resolution ViT on synthetic data, compare them",
    )
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo's)")
    p.add_argument("--samples", type=int, default=None, help="training images (default: the demo's)")
    p.add_argument(
        "--target-ratio", type=float, default=0.3, help="SPLIT's token budget as a fraction of full resolution"
    )
    p.add_argument("--out", default="runs/demo", help="folder for checkpoints and split maps")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from .train.demo import run_demo

    result = run_demo(out_dir=args.out, epochs=args.epochs, samples=args.samples, target_ratio=args.target_ratio)
    _print_table(result["rows"], ["method", "accuracy", "tokens_per_image", "token_ratio", "fine_on_object"])
    print(f"split maps: {result['split_map']}")
    emit(args, result)
    return 0


# ---------------------------------------------------------------------- viz
def _add_viz(sub) -> None:
    p = sub.add_parser("viz", parents=[_common(None)], help="draw the quadtree a policy chooses over images into a PNG")
    p.add_argument("--checkpoint", help="a SplitViT checkpoint (SplitViT.save); without it a fresh model is built")
    p.add_argument("--policy", help="policy to draw (default: the checkpoint's, or entropy)")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
    p.add_argument("--dataset", default="synthetic", help="dataset the images come from (its val split)")
    p.add_argument("--root", help="dataset folder or shard URI, for datasets read from files")
    p.add_argument("--count", type=int, default=8, help="number of images")
    p.add_argument("--seed", type=int, default=1, help="dataset seed of the images drawn")
    p.add_argument("--out", default="split_maps.png", help="PNG to write")
    p.add_argument("--json", help="write tokens per image to this JSON file")
    p.set_defaults(func=_run_viz)


def parse_thresholds(text: str | None) -> list[float] | None:
    """``"0.4,0.6"`` -> ``[0.4, 0.6]``; a clear error for anything else."""
    if text is None:
        return None
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        # bad input: exit 2 with one line, and the envelope written, as for any other bad option
        raise ValueError(f"--thresholds: expected comma-separated numbers in [0, 1], got {text!r}") from None


def _run_viz(args) -> int:
    import torch

    from .data import build_dataset
    from .tracking.split_maps import split_map_grid
    from .train.checkpoints import load_payload, model_from_payload
    from .train.demo import build_demo_model

    if args.checkpoint:
        overrides = {"policy": args.policy} if args.policy else {}
        # a missing, truncated or foreign file is one error line naming it
        model = model_from_payload(load_payload(args.checkpoint), args.checkpoint, **overrides)
    else:
        model = build_demo_model(args.policy or "entropy")
    model.eval()
    size = model.geometry.image_size[0]
    options = {"num_samples": args.count} if args.dataset == "synthetic" else {}
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    interpolation = model.data_config["interpolation"]
    data = build_dataset(args.dataset, "val", image_size=size, interpolation=interpolation, seed=args.seed, **options)
    count = min(args.count, len(data))
    images = torch.stack([data[i][0] for i in range(count)])
    with torch.no_grad():
        out = model(images, thresholds=parse_thresholds(args.thresholds))
    captions = [f"{int(t)} tok" for t in out.tokens]
    split_map_grid(images, out.decisions, model.geometry, captions).save(args.out)
    print(
        f"wrote {args.out}: {model.policy.name} policy, "
        f"mean {out.tokens.float().mean():.1f} of {out.full_tokens} tokens"
    )
    emit(
        args,
        {"png": args.out, "policy": model.policy.name, "tokens": out.tokens.tolist(), "full_tokens": out.full_tokens},
    )
    return 0


# ---------------------------------------------------------------------- bench
def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        parents=[
            _common(
                "MLflow store of `bench train --tracking` (default: a temporary one); "
                "bench forward and bench data ignore it"
            )
        ],
        help="SPLIT vs full resolution, side by side: forward speed, overhead, memory "
        "(bench forward), training-step throughput and Ray Train's overhead (bench train), "
        "or parquet on S3 against local copies: bytes read per epoch and images/s (bench data)",
    )
    p.add_argument(
        "kind",
        nargs="?",
        choices=("forward", "train", "data"),
        default="forward",
        help="forward (default): the forward benchmark; train: the training benchmark; data: the data benchmark",
    )
    # shared options; defaults differ by benchmark (None: the benchmark's own)
    p.add_argument(
        "--model", help="timm ViT name (default vit_base_patch16_224 (forward), vit_tiny_patch16_224 (train))"
    )
    p.add_argument("--image-size", type=int, help="input side (default: the model's (forward), 96 (train))")
    p.add_argument("--patch-size", type=int, help="finest patch (default: the model's (forward), 8 (train))")
    p.add_argument(
        "--levels",
        type=int,
        help="quadtree levels (default: the deepest of 3 or 2 that divides the image (forward), 3 (train))",
    )
    p.add_argument("--embed-dim", type=int, help="shrink the ViT: embedding width")
    p.add_argument("--depth", type=int, help="shrink the ViT: blocks")
    p.add_argument("--heads", type=int, help="shrink the ViT: attention heads")
    p.add_argument("--policy-depth", type=int, help="blocks the learned policy runs (default 2)")
    p.add_argument(
        "--policy-width",
        type=int,
        help="the learned policy's own blocks' width (default 192 (forward); train: none, the ViT's blocks)",
    )
    p.add_argument("--batch-size", type=int, help="default 8 (forward), 32 (train)")
    p.add_argument("--repeats", type=int, help="timed interleaved rounds: default 10 (forward), 6 (train)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast for every model (default: on for CUDA, as training uses it; off on the CPU)",
    )
    p.add_argument("--json", help="write the figures to this JSON file")
    forward = p.add_argument_group("bench forward only")
    forward.add_argument("--ratios", help="token ratios to time every policy at (default 0.5,0.7)")
    forward.add_argument("--policies", help="comma-separated, of learned, learned_shared, entropy (default: all)")
    forward.add_argument(
        "--buckets", help="also time the padded path with these length_buckets, e.g. 1,4 (default: none)"
    )
    forward.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=None, help="peak memory per model (default: on)"
    )
    forward.add_argument(
        "--fine-aggregation",
        action="store_true",
        default=None,
        help="the split policies' models add their fine patches' aggregation to coarse tokens "
        "(model.fine_aggregation), to time its cost",
    )
    forward.add_argument(
        "--level-context",
        action="store_true",
        default=None,
        help="the learned policies score every finer level in context (model.policy_level_context: "
        "their blocks also run on all of a finer level's nodes), to time its cost; needs 3 levels",
    )
    forward.add_argument(
        "--token-buckets",
        type=int,
        help="round the split policies' packed token counts up to this many fixed sizes (default 0: exact)",
    )
    forward.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile timm's ViT and the split policies' packed encoders (CUDA graphs on a GPU); "
        "use with --token-buckets",
    )
    train = p.add_argument_group("bench train only")
    train.add_argument("--epochs", type=int, help="epochs of the plain and Ray runs (default 3)")
    train.add_argument("--samples", type=int, help="training images of the plain and Ray runs (default 192)")
    train.add_argument("--val-samples", type=int, help="validation images (default 64)")
    train.add_argument("--threads", type=int, help="CPU threads of every run (default: torch's default here)")
    train.add_argument("--ray-rounds", type=int, help="plain/Ray pairs, alternating order (default 1)")
    train.add_argument("--skip-epochs", type=int, help="leading epochs left out of steady-state images/s (default 1)")
    train.add_argument("--parts", help="steps, ray or steps,ray (default)")
    train.add_argument("--tracking", action="store_true", default=None, help="MLflow logging in the Ray run")
    train.add_argument("--storage", help="Ray storage path (default: a temporary folder)")
    train.add_argument(
        "--teacher", choices=("gradient", "attention"), help="the policy's relevance teacher (default gradient)"
    )
    train.add_argument("--teacher-every", type=int, help="the relevance teacher on every k-th policy step (default 1)")
    data = p.add_argument_group("bench data only (also --samples (default 2048), --image-size (64), --batch-size (32))")
    data.add_argument(
        "--data-uri", help="s3://bucket/prefix to push the shards under (default: a moto S3 server started here)"
    )
    data.add_argument("--data-dir", help="folder for the local copies (default: a temporary folder)")
    data.add_argument("--rows-per-shard", type=int, help="rows per parquet file (default 512)")
    data.add_argument("--row-group-size", type=int, help="rows per row group (default 16)")
    data.add_argument("--num-workers", type=int, help="DataLoader worker processes (default 0)")
    data.add_argument("--cache-row-groups", type=int, help="row groups cached per process = shuffle window (default 4)")
    data.add_argument(
        "--global-shuffle",
        action="store_true",
        default=None,
        help="also read S3 in a global shuffle (the old path: a row-group read per item)",
    )
    data.add_argument(
        "--imagefolder",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also read the images as a local image folder (default: on)",
    )
    p.set_defaults(func=_run_bench)


_TRAIN_ONLY = (
    "epochs",
    "samples",
    "val_samples",
    "threads",
    "ray_rounds",
    "skip_epochs",
    "parts",
    "tracking",
    "storage",
    "teacher",
    "teacher_every",
)
_FORWARD_ONLY = (
    "ratios",
    "policies",
    "buckets",
    "memory",
    "token_buckets",
    "compile",
    "fine_aggregation",
    "level_context",
)
_DATA_ONLY = (
    "data_uri",
    "data_dir",
    "rows_per_shard",
    "row_group_size",
    "num_workers",
    "cache_row_groups",
    "global_shuffle",
    "imagefolder",
)
# the model's options: the data benchmark has no model
_MODEL_OPTIONS = (
    "model",
    "patch_size",
    "levels",
    "embed_dim",
    "depth",
    "heads",
    "policy_depth",
    "policy_width",
    "repeats",
    "bf16",
)


def _number_list(option: str, text: str | None, kind: type = float) -> tuple | None:
    """``"0.5,0.7"`` -> ``(0.5, 0.7)``; a bad item is an error naming the option."""
    if text is None:
        return None
    try:
        return tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def _shrunk(args) -> dict:
    return {
        k: v
        for k, v in (("embed_dim", args.embed_dim), ("depth", args.depth), ("num_heads", args.heads))
        if v is not None
    }


def _run_bench(args) -> int:
    if args.kind == "data":
        return _run_bench_data(args)
    given = [f"--{k.replace('_', '-')}" for k in _DATA_ONLY if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: options of 'splitvit bench data' only")
    only, other = (_TRAIN_ONLY, "train") if args.kind == "forward" else (_FORWARD_ONLY, "forward")
    given = [f"--{k.replace('_', '-')}" for k in only if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: options of 'splitvit bench {other}' only")
    if args.kind == "train":
        return _run_bench_train(args)
    from .bench.forward import ForwardSettings, format_report, run_forward_benchmark

    # an option left out (or given as 0 / empty) keeps ForwardSettings' default
    options = {
        "model_name": args.model,
        "batch_size": args.batch_size,
        "ratios": _number_list("--ratios", args.ratios),
        "policy_width": args.policy_width,
        "buckets": _number_list("--buckets", args.buckets, int),
        "token_buckets": args.token_buckets,
        "repeats": args.repeats,
    }
    options = {k: v for k, v in options.items() if v}
    if args.policies:  # "," is no policy at all: an error, not the default
        options["policies"] = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if args.policy_depth is not None:
        options["policy_depth"] = args.policy_depth
    settings = ForwardSettings(
        image_size=args.image_size,
        patch_size=args.patch_size,
        levels=args.levels,
        compile=bool(args.compile),
        fine_aggregation=bool(args.fine_aggregation),
        level_context=bool(args.level_context),
        device=args.device,
        autocast_bf16=_bench_bf16(args),
        memory=None if args.memory in (None, True) else (),
        timm_kwargs=_shrunk(args),
        **options,
    )
    result = run_forward_benchmark(settings)
    print(format_report(result))
    emit(args, result)
    return 0


def _bench_bf16(args) -> bool:
    return args.device.startswith("cuda") if args.bf16 is None else args.bf16


def _run_bench_train(args) -> int:
    from .bench.training import benchmark_config, format_train_report, run_train_benchmark

    config = benchmark_config(
        model_name=args.model or "vit_tiny_patch16_224",
        timm_kwargs=_shrunk(args),
        image_size=args.image_size or 96,
        patch_size=args.patch_size or 8,
        levels=args.levels or 3,
        batch_size=args.batch_size or 32,
        **{
            k: v
            for k, v in (
                ("policy_depth", args.policy_depth),
                ("policy_width", args.policy_width),
                ("teacher", args.teacher),
                ("teacher_every", args.teacher_every),
                ("epochs", args.epochs),
                ("train_samples", args.samples),
                ("val_samples", args.val_samples),
            )
            if v is not None
        },
    )
    parts = tuple(p.strip() for p in (args.parts or "steps,ray").split(",") if p.strip())
    result = run_train_benchmark(
        config,
        parts=parts,
        device=args.device,
        rounds=args.repeats or 6,
        ray_rounds=args.ray_rounds or 1,
        threads=args.threads,
        skip_epochs=1 if args.skip_epochs is None else args.skip_epochs,
        tracking=bool(args.tracking),
        storage=args.storage,
        autocast_bf16=_bench_bf16(args),
    )
    print(format_train_report(result))
    emit(args, result)
    return 0


def _run_bench_data(args) -> int:
    from .bench.data import DataBenchSettings, format_data_report, run_data_benchmark

    unused = (*_FORWARD_ONLY, *_MODEL_OPTIONS, *(k for k in _TRAIN_ONLY if k != "samples"))
    given = [f"--{k.replace('_', '-')}" for k in unused if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: not options of 'splitvit bench data'")
    options = {
        "s3_uri": args.data_uri,
        "local_dir": args.data_dir,
        "samples": args.samples,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "rows_per_shard": args.rows_per_shard,
        "row_group_size": args.row_group_size,
        "num_workers": args.num_workers,
        "cache_row_groups": args.cache_row_groups,
        "global_shuffle": args.global_shuffle,
        "imagefolder": args.imagefolder,
    }
    result = run_data_benchmark(DataBenchSettings(**{k: v for k, v in options.items() if v is not None}))
    print(format_data_report(result))
    emit(args, result.as_dict())
    return 0


# ---------------------------------------------------------------------- data
def _add_data(sub) -> None:
    p = sub.add_parser("data", parents=[_common(None)], help="convert datasets to parquet shards and push them to S3")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prep = dsub.add_parser(
        "prepare",
        parents=[_common(None)],
        help="write a dataset split as parquet shards to a folder or s3://bucket/prefix",
    )
    prep.add_argument("dataset", help="dataset name (see splitvit.data.DATASET_NAMES)")
    prep.add_argument("--split", default="train", choices=["train", "val", "test"])
    prep.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    prep.add_argument("--image-size", type=int, default=64, help="side of the stored images")
    prep.add_argument("--seed", type=int, default=0, help="dataset seed")
    prep.add_argument("--root", help="dataset folder (imagefolder, ade20k, Fashion-MNIST files) or shard URI (parquet)")
    prep.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra dataset option, repeatable (e.g. clutter_fraction=0.5)",
    )
    prep.add_argument("--limit", type=int, help="write only the first N items")
    prep.add_argument("--rows-per-shard", type=int, default=1000)
    prep.add_argument("--workers", type=int, default=0, help="DataLoader workers that decode items in parallel")
    prep.add_argument("--strict", action="store_true", help="stop at a corrupt file instead of skipping it")
    prep.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    prep.add_argument("--json", help="write the figures to this JSON file")
    prep.set_defaults(func=_run_data_prepare)
    push = dsub.add_parser(
        "push",
        parents=[_common(None)],
        help="upload a local folder (e.g. prepared shards) to s3://bucket/prefix with boto3",
    )
    push.add_argument("source", help="local folder")
    push.add_argument("destination", help="s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL)")
    push.add_argument("--workers", type=int, default=8, help="files uploaded at once (default 8)")
    push.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress on stderr: a bar on a terminal, else a line every 100 files (default: on)",
    )
    push.add_argument("--json", help="write the figures to this JSON file")
    push.set_defaults(func=_run_data_push)


def _run_data_prepare(args) -> int:
    from .data import build_dataset, write_shards

    options: dict[str, Any] = {}
    for text in args.option:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ValueError(f"--option: expected KEY=VALUE, got {text!r}")
        try:
            options[key] = json.loads(value)  # numbers, true/false, null
        except json.JSONDecodeError:
            options[key] = value
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    if args.strict and args.dataset in ("imagefolder", "ade20k", "parquet"):
        options["strict"] = True
    dataset = build_dataset(args.dataset, args.split, image_size=args.image_size, seed=args.seed, **options)
    result = write_shards(
        dataset,
        args.out,
        args.rows_per_shard,
        limit=args.limit,
        strict=args.strict,
        overwrite=args.overwrite,
        num_workers=args.workers,
        progress=sys.stderr.isatty(),
        metadata={"dataset": args.dataset, "split": args.split, "seed": args.seed, "options": options},
    )
    payload = {"dataset": args.dataset, "split": args.split, **result.as_dict()}
    payload.pop("extra", None)
    print(
        f"wrote {result.rows} rows ({result.task}) in {len(result.shards)} shards, {result.bytes} bytes, "
        f"to {result.uri} in {result.seconds:.1f}s; skipped {result.skipped} corrupt"
    )
    for path in result.skipped_files:
        print(f"  skipped: {path}")
    print(f"manifest: {result.manifest}")
    emit(args, payload)
    return 0


def _run_data_push(args) -> int:
    from .storage import is_s3, upload_dir

    if not is_s3(args.destination):
        raise ValueError(f"destination must be s3://bucket/prefix, got {args.destination!r}")
    if args.progress:  # off a terminal, progress is logged: shown without -v
        logging.getLogger("splitvit.storage").setLevel(logging.INFO)
    result = upload_dir(args.source, args.destination, workers=args.workers, progress=args.progress)
    print(
        f"pushed {result.files} files, {result.bytes} bytes, from {result.source} to {result.destination} "
        f"in {result.seconds:.1f}s"
    )
    emit(args, result.as_dict())
    return 0


# ---------------------------------------------------------------------- train / eval
def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        parents=[_common(_TRACKING)],
        help="train an experiment with Ray Train (config YAML + --set KEY=VALUE overrides), tracked in MLflow",
    )
    p.add_argument("config", help="experiment YAML (e.g. jobs/configs/smoke.yaml)")
    p.add_argument(
        "positional_overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the same as --set KEY=VALUE (kept as an alias)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="repeatable; a dotted config override, e.g. --set train.epochs=3 --set storage.name=run1",
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", help="write final metrics, checkpoint URI and MLflow run id to this JSON file")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from .train.experiment import load_experiment
    from .train.ray_trainer import run_training

    config = load_experiment(args.config, _overrides(args))  # a ConfigError stops here, before Ray
    print(f"run {config.storage.name}: storage {config.storage.run_uri()}")
    from .cluster.preflight import preflight

    # what only fails once Ray runs (capacity, Ray, MLflow, storage, data): seconds, a PreflightError
    print(preflight(config, ray_address=args.address).data_line)  # which data, from which folder
    # a TrainingError (a worker's error, unwrapped) or Ctrl-C/SIGTERM: main() prints one line
    result = run_training(config, ray_address=args.address)
    keys = [
        k
        for k in ("accuracy", "miou", "tokens_per_image", "token_ratio", "images_per_s", "train_loss")
        if k in result.metrics
    ]
    if keys:
        _print_table([{"metric": k, "value": result.metrics[k]} for k in keys], ["metric", "value"])
    else:
        print("no epoch completed: no metrics")
    print(f"status: {result.status}")
    print(f"checkpoint: {result.checkpoint_uri or 'none (no epoch completed)'}")
    if result.mlflow_run_id:
        print(f"mlflow run: {result.mlflow_run_id} ({result.tracking_uri})")
    if result.mlflow_model_uri:
        print(f"mlflow model: {result.mlflow_model_uri}")
    data = result.to_dict()
    data["run_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    emit(args, data, tracking_uri=result.tracking_uri, run_id=result.mlflow_run_id)
    if result.status != "completed":
        kept = (
            f"last good checkpoint {result.checkpoint_uri}"
            if result.checkpoint_uri
            else "no epoch completed, so no checkpoint was kept"
        )
        return fail(args, f"run {result.status}: {result.message}; {kept}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        parents=[_common(None)],
        help="evaluate a training checkpoint (local or s3://): accuracy or mIoU, tokens, images/s",
    )
    p.add_argument("checkpoint", help="checkpoint folder or its model.pt, local or s3://bucket/...")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
    p.add_argument("--policy", help="evaluate with this split policy instead of the checkpoint's")
    p.add_argument("--split", default="val", choices=["val", "test"], help="data split of the experiment's dataset")
    p.add_argument("--batch-size", type=int, help="evaluation batch size (default: the experiment's)")
    p.add_argument("--samples", type=int, help="number of images (default: the experiment's split size)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    from .cluster.preflight import preflight_eval
    from .train.evaluation import evaluate_checkpoint

    preflight_eval(args.checkpoint, args.device)  # the device, an s3:// checkpoint's endpoint: seconds
    result = evaluate_checkpoint(
        args.checkpoint,
        thresholds=parse_thresholds(args.thresholds),
        policy=args.policy,
        split=args.split,
        batch_size=args.batch_size,
        samples=args.samples,
        device=args.device,
    )
    quality = "miou" if "miou" in result else "accuracy"
    _print_table(
        [
            {"metric": k, "value": result[k]}
            for k in (quality, "tokens_per_image", "token_ratio", "images_per_s", "fine_on_object", "object_coverage")
            if k in result  # the object figures: on data with object masks
        ],
        ["metric", "value"],
    )
    print(f"policy {result['policy']}, thresholds {result['thresholds']}, {result['images']} {args.split} images")
    emit(args, result)
    return 0


# ---------------------------------------------------------------------- sweep / pareto
def _add_sweep(sub) -> None:
    p = sub.add_parser(
        "sweep",
        parents=[_common(_TRACKING)],
        help="multi-objective sweep (Ray Tune + Optuna): accuracy up, tokens down; frontier in MLflow",
    )
    p.add_argument("space", help="search space YAML (e.g. search_spaces/smoke.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="repeatable; a config key fixes that value (train.epochs=1), any other key sets the space's "
        "settings (search.num_samples=3, stage_two.points=2)",
    )
    p.add_argument(
        "--name",
        help="the sweep's folder under the storage path (default: the space's name and a timestamp; "
        "with --resume, the latest sweep of this space)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted sweep (Tuner.restore): finished trials "
        "are not run again, MLflow runs are not duplicated",
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--json", help="write every point, the frontier, the hypervolume and the MLflow ids to this JSON file"
    )
    p.set_defaults(func=_run_sweep)


def _frontier_table(points: list[dict[str, Any]], metric: str) -> None:
    """Frontier points as a table; points that tie exactly (same tokens, same quality)
    are shown once, with how many others share them (the JSON lists them all)."""
    params = list(dict.fromkeys(k for p in points for k in (p.get("params") or {})))
    shown: dict[tuple[float, float], dict[str, Any]] = {}
    ties: dict[tuple[float, float], int] = {}
    for p in points:
        key = (p["tokens_per_image"], p[metric])
        if key in shown:
            ties[key] += 1
            continue
        shown[key], ties[key] = p, 0
    rows = []
    for key, p in shown.items():
        row = {
            "tokens/image": p["tokens_per_image"],
            metric: p[metric],
            "token ratio": p["token_ratio"],
            "kind": p["kind"],
            "trial": p["trial_id"],
            "eval thresholds": ",".join(f"{t:.3f}" for t in p.get("thresholds") or []),
        }
        row.update({k: v for k, v in (p.get("params") or {}).items()})
        row["ties"] = f"+{ties[key]}" if ties[key] else ""
        speedup = (p.get("extras") or {}).get("speedup_vs_full")
        row["speed-up"] = f"{speedup:.2f}x" if speedup is not None else "-"
        rows.append(row)
    timed = any((p.get("extras") or {}).get("speedup_vs_full") is not None for p in points)
    columns = [
        "tokens/image",
        metric,
        "token ratio",
        *(["speed-up"] if timed else []),
        "kind",
        "trial",
        "eval thresholds",
        *params,
    ]
    _print_table(rows, columns + (["ties"] if any(ties.values()) else []))


def _run_sweep(args) -> int:
    import ray

    from .tune import SweepError, run_sweep
    from .tune.console import show_ray_output

    # progress of the sweep (trials starting, epochs, trials finishing) is shown by
    # default, as the project's lines; Ray Tune's own console only with -v
    logging.getLogger("splitvit.tune").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    show_ray_output(args.verbose)
    ours = not ray.is_initialized()
    try:
        result = run_sweep(args.space, _overrides(args), name=args.name, resume=args.resume, ray_address=args.address)
    except SweepError as exc:
        return fail(args, str(exc))
    finally:
        if ours and ray.is_initialized():
            # Ray forwards the workers' last log lines late; ending it here keeps them
            # above the summary, which is the last thing the command prints
            ray.shutdown()
    data = result.to_dict()
    metric = result.metric
    counts: dict[str, int] = {}
    for trial in result.trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    print()
    print(
        f"sweep {result.name}: {len(result.trials)} trials "
        f"({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
        f"{len(result.points)} points, {len(data['frontier'])} on the Pareto frontier"
    )
    print(
        f"hypervolume {result.hypervolume:.4f} (reference point: {metric} {result.reference_point['quality']:g}, "
        f"token ratio {result.reference_point['token_ratio']:g})"
    )
    print(f"\nPareto frontier ({metric} vs tokens per image; searched parameters as columns):")
    if data["frontier"]:
        _frontier_table(data["frontier"], metric)
    else:
        print("  (empty: no trial completed)")
    if result.baselines:
        trial = result.baselines[0].get("trial_id", "?")
        print(f"\nbaselines on trial {trial}'s backbone, same data:")
        _print_table(
            [
                {
                    "baseline": b["label"],
                    "tokens/image": b["tokens_per_image"],
                    metric: b["quality"],
                    "token ratio": b["token_ratio"],
                }
                for b in result.baselines
            ],
            ["baseline", "tokens/image", metric, "token ratio"],
        )
    for trial in result.trials:
        if trial.status in ("failed", "diverged"):
            last = trial.error.strip().splitlines()[-1] if trial.error.strip() else ""
            print(f"trial {trial.trial_id} {trial.status}: {last[:200]}")
    print()
    print(f"plot:           {result.plot}")
    if result.split_map:
        print(f"split maps:     {result.split_map}")
    print(f"frontier table: {result.frontier_csv}")
    print(
        f"MLflow:         experiment {result.experiment!r} (id {result.experiment_id}), "
        f"parent run {result.parent_run_id}"
    )
    command = result.mlflow_ui_command()
    if command.startswith("mlflow ui"):
        print(f"open the UI:    {command}")
        print(f"                then {result.mlflow_url()}")
    else:
        print(f"open the UI:    {result.mlflow_url()}")
    print(f"wall time:      {result.wall_time_s:.0f} s")
    data["sweep_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    data.pop("wall_time_s", None)  # the envelope's wall_time_s: the whole command
    emit(args, data, tracking_uri=result.tracking_uri, experiment_id=result.experiment_id, run_id=result.parent_run_id)
    if result.status != "completed":
        return fail(args, "no trial completed, so there is no frontier")
    return 0


def _add_study(sub) -> None:
    p = sub.add_parser(
        "study",
        parents=[_common(_TRACKING)],
        help="the evidence study: SPLIT vs full resolution, all-coarse, entropy and random "
        "splitting, trained alike, at matched token budgets, over seeds",
    )
    p.add_argument("study", help="study YAML (e.g. search_spaces/study_fashion.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="repeatable; a config setting for every run (train.epochs=1, data.options.train_samples=512)",
    )
    p.add_argument("--scale", help="apply the study file's scales.<SCALE> section (e.g. gpu: more data, epochs, GPUs)")
    p.add_argument(
        "--methods",
        type=lambda value: [m.strip() for m in value.split(",") if m.strip()],
        metavar="NAME,NAME",
        help="run these of the file's methods and levers instead of its headline (a lever beside the "
        "control, or a study cut to fit a machine); it still needs a full-resolution and a learned one",
    )
    p.add_argument(
        "--name",
        help="the study's folder under the storage path (default: study-<file>); an existing "
        "study of this name is finished, not repeated",
    )
    p.add_argument(
        "--references-from",
        metavar="NAME",
        help="fine-tune from the finished references (backbones) of the study NAME under the same "
        "storage path instead of training them (e.g. the default study's, for --scale long-finetune, "
        "which only changes the fine-tune); their settings must match this study's",
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--json",
        help="write the table (per method and token ratio: mean, std, min, max over seeds), the "
        "per-run points, the goals and the speed comparison to this JSON file",
    )
    p.set_defaults(func=_run_study)


def _run_study(args) -> int:
    import ray

    from .study.ray_executor import run_study
    from .study.report import lever_lines, reuse_phrase, summary_lines
    from .tune.console import show_ray_output

    for logger in ("splitvit.study", "splitvit.tune"):
        logging.getLogger(logger).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    show_ray_output(args.verbose)
    ours = not ray.is_initialized()
    try:
        result = run_study(
            args.study,
            _overrides(args),
            scale=args.scale,
            name=args.name,
            ray_address=args.address,
            methods=args.methods,
            references_from=args.references_from,
        )
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()
    metric = result.metric
    print(
        f"\nstudy {result.name}: {len(result.seeds)} seeds, {len(result.runs)} runs"
        f"{reuse_phrase(result.runs)}, {result.seconds / 60:.1f} min"
        + (f"; references from {result.references_dir}" if result.references_dir else "")
    )
    _print_table(
        [
            {
                "method": r.method,
                "target ratio": r.target_ratio if r.target_ratio is not None else "-",
                "token ratio": r.token_ratio,
                "tokens/image": r.tokens_per_image,
                metric: f"{r.quality:.4f} ± {r.quality_std:.4f}",
                "min": r.quality_min,
                "max": r.quality_max,
                "images/s": r.images_per_s,
            }
            for r in result.rows
        ],
        ["method", "target ratio", "token ratio", "tokens/image", metric, "min", "max", "images/s"],
    )
    print()
    for line in lever_lines(result.levers, metric):
        print(line)
    for line in summary_lines(result.goals, result.speed, result.failed, result.point_speed):
        print(line)
    print(f"MLflow: experiment run {result.mlflow_run_id} in {result.tracking_uri}")
    emit(args, result.to_dict(), tracking_uri=result.tracking_uri, run_id=result.mlflow_run_id)
    if result.failed and not result.runs:
        return fail(args, f"no run finished: {result.failed[0]}")
    return 0


def _add_pareto(sub) -> None:
    p = sub.add_parser(
        "pareto",
        parents=[_common("MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")],
        help="print the Pareto frontier (accuracy vs tokens) of an MLflow experiment's latest sweep (or all of them)",
    )
    p.add_argument("experiment", help="MLflow experiment name (e.g. smoke-sweep)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sweep", help="only this sweep (its parent run id); default: the experiment's latest sweep")
    which.add_argument(
        "--all", dest="all_sweeps", action="store_true", help="merge every sweep of the experiment into one frontier"
    )
    p.add_argument("--plot", metavar="PATH", help="also draw the frontier into this image (PNG)")
    p.add_argument("--json", help="write the points, the frontier and the hypervolume to this JSON file")
    p.set_defaults(func=_run_pareto)


def _run_pareto(args) -> int:
    from .tune import frontier_from_mlflow

    data = frontier_from_mlflow(args.experiment, args.tracking_uri, args.sweep, all_sweeps=args.all_sweeps)
    metric = data["metric"]
    print(
        f"experiment {data['experiment']!r} (id {data['experiment_id']}, {data['tracking_uri']}): "
        f"{len(data['sweeps'])} sweep(s), {len(data['points'])} points, {len(data['frontier'])} on the frontier, "
        f"hypervolume {data['hypervolume']:.4f}"
    )
    if data["frontier"]:
        _frontier_table(data["frontier"], metric)
        for speed in data.get("speed") or []:
            print(
                f"speed-up: measured against the full-resolution model in the same run, on {speed['device']} "
                f"({speed['timing']}; sweep run {speed['sweep']})"
            )
        if not any((p.get("extras") or {}).get("speedup_vs_full") is not None for p in data["frontier"]):
            print(
                "speed-up: not recorded: the sweep(s) did not time their frontier (sweeps before frontier timing, "
                "or speed.enabled: false)"
            )
    if args.plot:
        from .tune.plot import save_frontier_plot

        data["plot"] = str(save_frontier_plot(data, args.plot))
        print(f"plot: {data['plot']}")
    sweeps = data.get("sweeps") or []
    emit(
        args,
        data,
        tracking_uri=data.get("tracking_uri"),
        experiment_id=data.get("experiment_id"),
        # one sweep read: its parent run; several merged: no single run
        run_id=_sweep_run_id(sweeps[0]) if len(sweeps) == 1 else None,
    )
    return 0


def _sweep_run_id(sweep: Any) -> str | None:
    """A sweep entry of :func:`frontier_from_mlflow`: its parent run id (an id, or a dict holding one)."""
    if isinstance(sweep, dict):
        return sweep.get("run_id") or sweep.get("parent_run_id")
    return sweep if isinstance(sweep, str) else None


# ---------------------------------------------------------------------- submit / stack
def _add_submit(sub) -> None:
    from .cluster.submit import ENTRYPOINTS

    p = sub.add_parser(
        "submit",
        parents=[
            _common(
                "MLflow server the job logs to (default: $MLFLOW_TRACKING_URI, else the local stack's when submitting "
                "there)"
            )
        ],
        help="run train/sweep/eval as a Ray job (JobSubmissionClient): upload this checkout, follow the log, "
        "exit with the job's status",
        description="Options before ENTRY belong to submit; after it, the job's arguments, except submit's own "
        "--address, --working-dir, --env, --pip, --tracking-uri, --submission-id, --log-lines and "
        "--no-wait, which may come anywhere. Exit status: 0 succeeded, 1 failed or stopped, "
        "2 not submitted (no cluster, bad arguments).",
    )
    p.add_argument(
        "--address",
        help="Ray dashboard/job server, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, "
        "$RAY_ADDRESS, else the local stack)",
    )
    p.add_argument("--working-dir", default=".", help="the splitvit checkout to upload (default: .)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the job, repeatable; KEY alone copies it from here",
    )
    p.add_argument(
        "--pip", action="append", default=[], metavar="REQ", help="extra pip requirement for the job, repeatable"
    )
    p.add_argument("--submission-id", help="job id to use (default: Ray picks one)")
    p.add_argument("--log-lines", type=int, default=40, help="lines of the job's log shown when it fails")
    p.add_argument("--no-wait", action="store_true", help="submit, print the job id and return")
    p.add_argument("--json", help="write the job id, status and runtime environment to this JSON file")
    p.add_argument("entry", choices=list(ENTRYPOINTS), metavar="ENTRY", help="train, sweep or eval")
    p.add_argument(
        "job_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the job's arguments, as for `splitvit ENTRY` (e.g. jobs/configs/smoke.yaml --set train.epochs=1)",
    )
    p.set_defaults(func=_run_submit)


def _run_submit(args) -> int:
    from .cluster.submit import JobFailed, SubmitError, parse_env, run_job, split_submit_options

    trailing, job_args = split_submit_options(args.job_args)
    for key, value in trailing.items():  # submit's options after the job's arguments
        setattr(args, key, getattr(args, key) + value if key in ("env", "pip") else value)
    try:
        args.log_lines = int(args.log_lines)
    except ValueError:
        raise ValueError(f"--log-lines: expected a number, got {args.log_lines!r}") from None

    if not args.verbose:
        # Ray logs every packaging step of the upload at INFO (its SDK modules set their
        # own level on import, so they are imported first)
        import ray.job_submission  # noqa: F401

        for name in ("ray", "ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk"):
            logging.getLogger(name).setLevel(logging.WARNING)

    def submitted(job_id: str, address: str) -> None:
        if args.no_wait:
            return
        print(
            f"job {job_id} submitted to {address}; following its log (Ctrl-C stops following, not the job)", flush=True
        )

    def sink(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    try:
        result = run_job(
            args.entry,
            job_args,
            address=args.address,
            working_dir=args.working_dir,
            env=parse_env(args.env),
            pip=args.pip,
            tracking_uri=args.tracking_uri,
            submission_id=args.submission_id,
            wait=not args.no_wait,
            sink=sink,
            log_lines=args.log_lines,
            on_submitted=submitted,
        )
    except JobFailed as exc:
        _emit_job(args, exc.result)
        return fail(args, str(exc))
    except SubmitError as exc:
        where = f" (job {exc.job_id})" if exc.job_id else ""
        args.report.error = str(exc)
        print(f"splitvit submit: error{where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        args.report.error = "stopped following; the job keeps running"
        print(
            "\nstopped following; the job keeps running (`ray job status`, `ray job stop` with its id)", file=sys.stderr
        )
        return 130
    if args.no_wait:
        print(f"job {result.job_id} submitted to {result.address}")
        print(f"follow it:  ray job logs -f {result.job_id} --address {result.address}")
    else:
        print(f"job {result.job_id} {result.status} in {result.duration_s:.0f}s")
    if result.tracking_uri:
        print(f"MLflow: {result.to_dict()['tracking_uri']}")
    _emit_job(args, result)
    return 0


def _emit_job(args: argparse.Namespace, result: Any) -> None:
    """A job's outcome into the envelope: Ray's job status as ``job_status``."""
    data = result.to_dict()
    data["job_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    emit(args, data, tracking_uri=result.tracking_uri)


def _add_stack(sub) -> None:
    p = sub.add_parser(
        "stack",
        parents=[_common(None)],
        help="the local stack: a Ray head (dashboard, job server) and an MLflow server on 127.0.0.1",
    )
    ssub = p.add_subparsers(dest="stack_command", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False, parents=[_common(None)])
    common.add_argument("--state-dir", help="the stack's folder (default: $SPLITVIT_STACK_DIR, else ~/.splitvit/stack)")
    common.add_argument("--json", help="write the stack's status to this JSON file")
    upp = ssub.add_parser("up", parents=[common], help="start the stack, wait until it is healthy, write its addresses")
    upp.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: loopback only)")
    upp.add_argument("--dashboard-port", type=int, default=8265)
    upp.add_argument("--mlflow-port", type=int, default=5000)
    upp.add_argument("--ray-port", type=int, default=6379, help="Ray's GCS port")
    upp.add_argument("--client-port", type=int, help="Ray client server port (default: a free one)")
    upp.add_argument("--agent-port", type=int, help="Ray dashboard agent HTTP port (default: a free one)")
    upp.add_argument("--num-cpus", type=int, help="CPUs the Ray head advertises (default: detected)")
    upp.add_argument("--num-gpus", type=int, help="GPUs the Ray head advertises (default: detected)")
    upp.add_argument("--backend-store-uri", help="MLflow backend store (default: SQLite in the state folder)")
    upp.add_argument(
        "--artifacts-destination", help="where MLflow stores artifacts (default: a folder in the state folder)"
    )
    upp.add_argument("--mlflow-workers", type=int, default=2)
    upp.add_argument("--ray-temp-dir", help="Ray's temp folder (default: <state dir>/ray)")
    upp.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each component's health")
    upp.set_defaults(func=_run_stack_up)
    downp = ssub.add_parser("down", parents=[common], help="stop the stack's processes (Ray workers and jobs included)")
    downp.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    downp.set_defaults(func=_run_stack_down)
    statp = ssub.add_parser("status", parents=[common], help="report the stack's health (exit 1 when not healthy)")
    statp.set_defaults(func=_run_stack_status)


def _print_stack(status) -> None:
    for c in status.components:
        print(f"  {c.name:<15} {'ok  ' if c.healthy else 'FAIL'} {c.detail if not c.healthy else c.url}")
    if status.state is not None:
        s = status.state
        print(f"Ray dashboard and job server: {s.dashboard_url}   (GCS {s.gcs_address})")
        print(
            f"MLflow:                       {s.mlflow_url}   "
            f"(store {s.backend_store_uri}, artifacts {s.artifacts_destination})"
        )
        print(f"runs folder:                  {s.storage_path}")
        print(f"logs:                         {s.logs_dir}")
        print(f"for ray job submit / MLflow:  source {Path(status.state_dir) / 'stack.env'}")


def _run_stack_up(args) -> int:
    from .cluster.stack import StackError, StackSettings, up

    settings = StackSettings(
        state_dir=Path(args.state_dir) if args.state_dir else None,
        host=args.host,
        dashboard_port=args.dashboard_port,
        mlflow_port=args.mlflow_port,
        ray_port=args.ray_port,
        client_port=args.client_port,
        agent_port=args.agent_port,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        backend_store_uri=args.backend_store_uri,
        artifacts_destination=args.artifacts_destination,
        mlflow_workers=args.mlflow_workers,
        ray_temp_dir=Path(args.ray_temp_dir) if args.ray_temp_dir else None,
        timeout_s=args.timeout,
    )
    try:
        status = up(settings)
    except StackError as exc:
        return fail(args, str(exc))
    print(
        f"stack {'already running' if status.already_running else 'up'} in {status.state_dir}: "
        f"{'healthy' if status.healthy else 'NOT healthy'}"
    )
    _print_stack(status)
    emit(args, status.to_dict())
    if not status.healthy:
        args.report.error = "the stack is not healthy"
    return 0 if status.healthy else 1


def _run_stack_down(args) -> int:
    from .cluster.stack import StackError, down

    try:
        report = down(args.state_dir, grace_s=args.grace)
    except StackError as exc:
        return fail(args, str(exc))
    if not report.was_running:
        print(f"no stack runs in {report.state_dir}")
    else:
        print(f"stack in {report.state_dir} stopped: {report.stopped} processes ended, {report.killed} killed")
        if report.ports_open:
            fail(args, f"ports still open: {report.ports_open}")
    emit(args, report.to_dict())
    if not report.clean and not args.report.error:
        args.report.error = "the stack did not stop cleanly"
    return 0 if report.clean else 1


def _run_stack_status(args) -> int:
    from .cluster.stack import status as stack_status

    status = stack_status(args.state_dir)
    if status.state is None:
        print(f"no stack runs in {status.state_dir} (start one with `splitvit stack up`)")
    else:
        print(
            f"stack in {status.state_dir}: {'healthy' if status.healthy else 'NOT healthy'}, "
            f"{status.processes} processes"
        )
        _print_stack(status)
    emit(args, status.to_dict())
    if not status.healthy:
        args.report.error = "no stack runs" if status.state is None else "the stack is not healthy"
    return 0 if status.healthy else 1


COMMANDS: list[Callable] = [
    _add_demo,
    _add_viz,
    _add_bench,
    _add_data,
    _add_train,
    _add_eval,
    _add_sweep,
    _add_study,
    _add_pareto,
    _add_submit,
    _add_stack,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitvit", description="SPLIT: learned hierarchical patch splitting for ViTs"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log progress at INFO level (also accepted after the subcommand)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def _exit_status(exc: BaseException) -> int | None:
    """1 for an error that came through Ray (a worker's, a task's) or any of the
    project's own; 2 for bad input found before anything started (ValueError,
    OSError: a bad setting, a missing file, storage); None: a bug, shown in full."""
    from .errors import from_ray, is_project_error

    if from_ray(exc):
        return 1
    if isinstance(exc, (ValueError, OSError)):
        return 2
    return 1 if is_project_error(exc) else None


def _raise_interrupted(signum: int, frame: Any) -> None:
    from .errors import note_signal

    raise note_signal(signum)


def _handle_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise ``errors.Interrupted`` (a KeyboardInterrupt): the same
    cleanup runs for Ctrl-C, ``timeout``, ``ray job stop`` or a scheduler's SIGTERM.
    Returns the handlers replaced (none outside the main thread)."""
    from . import errors

    errors._last_signal.clear()  # a signal noted by an earlier command in this process
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _raise_interrupted)
        except ValueError:  # not the main thread
            break
    return previous


def main(argv: list[str] | None = None) -> int:
    """Run a command. Exit status: 0 done; 1 failed (an error inside Ray is one line,
    its worker's traceback with ``-v``); 2 bad input found before starting; 130/143
    interrupted by SIGINT/SIGTERM (what was kept is said)."""
    from .errors import as_interrupted, error_line, worker_traceback

    args = build_parser().parse_args(argv)
    # the subcommands' -v/--tracking-uri leave no default (one before the subcommand stays)
    args.verbose = getattr(args, "verbose", False)
    args.tracking_uri = getattr(args, "tracking_uri", None)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    name = " ".join(
        filter(None, [args.command, getattr(args, "data_command", None), getattr(args, "stack_command", None)])
    )
    args.report = Report(
        name, mlflow={"tracking_uri": args.tracking_uri} if getattr(args, "uses_mlflow", False) else {}
    )
    started = time.monotonic()
    code = 1
    previous = _handle_signals()
    try:
        with _tracking_env(args.tracking_uri if getattr(args, "uses_mlflow", False) else None):
            code = int(args.func(args) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM
        stopped = as_interrupted(exc)
        sys.stdout.flush()
        print(f"\nsplitvit {name}: {stopped}", file=sys.stderr)
        args.report.error = str(stopped)
        code = stopped.exit_code
    except Exception as exc:  # noqa: BLE001 - bad input, storage, errors from Ray's workers
        status = _exit_status(exc)
        if status is None:  # a bug: the envelope says so, then the traceback in full
            args.report.error = f"{type(exc).__name__}: {exc}"
            _write_envelope(args, 1, time.monotonic() - started)
            raise
        sys.stdout.flush()
        # bad input says what it has to say (as before); errors through Ray: their root, one line
        args.report.error = str(exc) if status == 2 else error_line(exc)
        print(f"splitvit {name}: error: {args.report.error}", file=sys.stderr)
        if args.verbose:
            print(worker_traceback(exc) or "".join(traceback.format_exception(exc)), file=sys.stderr, end="")
        code = status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return _write_envelope(args, code, time.monotonic() - started)


def _write_envelope(args: argparse.Namespace, code: int, wall_time_s: float) -> int:
    """Write the envelope to ``--json`` (when given); returns the exit status, 2 when
    a command that succeeded cannot write its JSON (a bad path: bad input)."""
    path = getattr(args, "json", None)
    if not path:
        return code
    try:
        write_json(path, envelope(args.report, code, wall_time_s))
    except OSError as exc:
        print(f"splitvit {args.report.command}: error: --json {path}: {exc}", file=sys.stderr)
        return code or 2
    return code


if __name__ == "__main__":
    sys.exit(main())
