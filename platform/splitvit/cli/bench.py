"""``splitvit bench forward|parts|train|data``: SPLIT against full resolution, measured side by side in one run.

Each benchmark is its own subcommand with only its own options, and the defaults
in its help are argparse's: the benchmark's library defaults (``ForwardSettings``,
``benchmark_config`` and ``run_train_benchmark``, ``DataBenchSettings``), written
out here because those modules import torch, which ``--help`` must not wait for
(``tests/test_bench.py`` checks that the two agree). The options two benchmarks
share are added by the ``_add_*`` helpers, which take each benchmark's defaults.
"""

from __future__ import annotations

import argparse
import os

from .options import add_set_option, checked_tracking_uri, common_options, number_list
from .output import emit

#: the benchmarks, in the order ``splitvit bench --help`` lists them
KINDS = ("forward", "parts", "train", "data")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit bench`` and its benchmarks (``forward``, ``train``, ``data``) to the subcommands ``sub``."""
    p = sub.add_parser(
        "bench",
        parents=[common_options(None)],
        help="SPLIT vs full resolution, side by side: forward speed, overhead, memory (bench forward), "
        "training-step throughput and Ray Train's overhead (bench train), or parquet on S3 against "
        "local copies (bench data)",
        description="Benchmarks measured side by side in one run on one machine. "
        "`splitvit bench KIND --help` lists a benchmark's options and defaults.",
    )
    # no default benchmark: `splitvit bench` alone is a usage error that lists the three
    kinds = p.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(KINDS) + "}")
    _add_forward(kinds)
    _add_parts(kinds)
    _add_train(kinds)
    _add_data(kinds)


# ---------------------------------------------------------------------- options two benchmarks share
def _add_model_options(
    p: argparse.ArgumentParser,
    *,
    model: str,
    image_size: int | None,
    patch_size: int | None,
    levels: int | None,
    levels_default: str,
    policy_width: int | None,
    policy_width_default: str,
) -> None:
    """The workload of ``bench forward`` and ``bench train``: the timm ViT, its size, the
    quadtree and the learned policy; ``levels_default`` and ``policy_width_default`` are
    their help's "(default ...)", which says in words what a None default means."""
    p.add_argument("--model", default=model, help="timm ViT name (default %(default)s)")
    p.add_argument("--image-size", type=int, default=image_size, help=f"input side ({_size_default(image_size)})")
    p.add_argument("--patch-size", type=int, default=patch_size, help=f"finest patch ({_size_default(patch_size)})")
    p.add_argument("--levels", type=int, default=levels, help=f"quadtree levels ({levels_default})")
    p.add_argument("--embed-dim", type=int, help="shrink the ViT: embedding width (default: the model's)")
    p.add_argument("--depth", type=int, help="shrink the ViT: blocks (default: the model's)")
    p.add_argument("--heads", type=int, help="shrink the ViT: attention heads (default: the model's)")
    p.add_argument("--policy-depth", type=int, default=2, help="blocks the learned policy runs (default %(default)s)")
    p.add_argument(
        "--policy-width",
        type=int,
        default=policy_width,
        help=f"width of the learned policy's own blocks ({policy_width_default})",
    )


def _size_default(value: int | None) -> str:
    """A size's default in the help: None is the timm model's own."""
    return "default: the model's" if value is None else f"default {value}"


def _add_timing_options(p: argparse.ArgumentParser, *, batch_size: int, repeats: int) -> None:
    """How ``bench forward`` and ``bench train`` time: batch, rounds, device, precision."""
    p.add_argument("--batch-size", type=int, default=batch_size, help="images per step (default %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed interleaved rounds (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    _add_bf16_option(p)


def _add_bf16_option(p: argparse.ArgumentParser) -> None:
    """``--bf16``/``--no-bf16``; :func:`_bf16` resolves its default from ``--device``."""
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast for every model (default: on for CUDA, as training uses it; off on the CPU)",
    )


def _add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", help="write the figures to this JSON file")


def _shrunk(args: argparse.Namespace) -> dict[str, int]:
    """``--embed-dim``, ``--depth``, ``--heads`` as timm keyword arguments (those given)."""
    return {
        k: v
        for k, v in (("embed_dim", args.embed_dim), ("depth", args.depth), ("num_heads", args.heads))
        if v is not None
    }


def _bf16(args: argparse.Namespace) -> bool:
    """``--bf16``/``--no-bf16``, else on for CUDA and off on the CPU."""
    return args.device.startswith("cuda") if args.bf16 is None else args.bf16


# ---------------------------------------------------------------------- forward
def _add_forward(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "forward",
        parents=[common_options(None)],
        help="forward speed, overhead and peak memory: a timm ViT against SplitViT at matched token ratios, "
        "per policy, and where SPLIT's time goes",
    )
    _add_model_options(
        p,
        model="vit_base_patch16_224",
        image_size=None,
        patch_size=None,
        levels=None,
        levels_default="default: the deepest of 3 or 2 that divides the image",
        policy_width=192,
        policy_width_default="default %(default)s; learned_shared runs on the ViT's blocks",
    )
    _add_timing_options(p, batch_size=8, repeats=10)
    p.add_argument("--ratios", default="0.5,0.7", help="token ratios to time every policy at (default %(default)s)")
    p.add_argument("--policies", help="comma-separated, of learned, learned_shared, entropy (default: all)")
    p.add_argument("--buckets", help="also time the padded path with these length_buckets, e.g. 1,4 (default: none)")
    p.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=True, help="peak memory per model (default: on)"
    )
    p.add_argument(
        "--fine-aggregation",
        action="store_true",
        help="the split policies' models add their fine patches' aggregation to coarse tokens "
        "(model.fine_aggregation), to time its cost",
    )
    p.add_argument(
        "--level-context",
        action="store_true",
        help="the learned policies score every finer level in context (model.policy.level_context: "
        "their blocks also run on all of a finer level's nodes), to time its cost; needs 3 levels",
    )
    p.add_argument(
        "--token-buckets",
        type=int,
        default=0,
        help="round the split policies' packed token counts up to this many fixed sizes (default %(default)s: exact)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile timm's ViT and the split policies' packed encoders (CUDA graphs on a GPU); "
        "use with --token-buckets",
    )
    _add_json_option(p)
    p.set_defaults(func=run_forward)


def run_forward(args: argparse.Namespace) -> int:
    """``bench forward``: time every policy against timm's ViT, print the report."""
    from ..bench.forward import ForwardSettings, format_report, run_forward_benchmark

    # a number given as 0 or a list given empty keeps ForwardSettings' default
    options = {
        "model_name": args.model,
        "batch_size": args.batch_size,
        "ratios": number_list("--ratios", args.ratios),
        "policy_width": args.policy_width,
        "buckets": number_list("--buckets", args.buckets, int),
        "token_buckets": args.token_buckets,
        "repeats": args.repeats,
    }
    options = {k: v for k, v in options.items() if v}
    if args.policies:  # "," is no policy at all: an error, not the default
        options["policies"] = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    settings = ForwardSettings(
        image_size=args.image_size,
        patch_size=args.patch_size,
        levels=args.levels,
        policy_depth=args.policy_depth,
        compile=args.compile,
        fine_aggregation=args.fine_aggregation,
        level_context=args.level_context,
        device=args.device,
        autocast_bf16=_bf16(args),
        memory=None if args.memory else (),  # None: the device's own memory probes
        timm_kwargs=_shrunk(args),
        **options,
    )
    result = run_forward_benchmark(settings)
    print(format_report(result))
    emit(args, result.to_dict())
    return 0


# ---------------------------------------------------------------------- parts
def _add_parts(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "parts",
        parents=[common_options(None)],
        help="where a SPLIT model's forward time goes (embeddings, aggregation, policy, level context, "
        "decisions, gather, packing, blocks, head) beside full resolution, at several batch sizes: "
        "a study's method, an experiment config or a checkpoint (a detector: whole, and its backbone alone)",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--study", help="a study file; its --method's model, with random weights")
    source.add_argument("--config", help="an experiment config file; its model, with random weights")
    source.add_argument("--checkpoint", help="a trained model (model.pt, a checkpoint folder, or s3://)")
    p.add_argument("--method", help="with --study: one of the study's methods or levers")
    p.add_argument("--scale", help="with --study: the study's scale (e.g. gpu)")
    add_set_option(p, "with --study or --config: a config setting of the model (e.g. model.image_size=96)")
    p.add_argument(
        "--batch-sizes", default="1,8,64,256", help="images per forward pass, each timed apart (default %(default)s)"
    )
    p.add_argument("--ratios", default="0.5,0.7", help="token ratios to calibrate the model to (default %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed interleaved rounds per run (default %(default)s)")
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="interleaved runs per batch size; speed-ups are the runs' median, with their spread (default %(default)s)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's default here)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    _add_bf16_option(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every model's encoder blocks, full resolution's too (CUDA graphs on a GPU); "
        "use with --token-buckets",
    )
    p.add_argument(
        "--token-buckets",
        type=int,
        default=0,
        help="with --compile: round the split models' packed token counts up to this many fixed sizes "
        "(default 0: exact)",
    )
    _add_json_option(p)
    p.set_defaults(func=run_parts)


def run_parts(args: argparse.Namespace) -> int:
    """``bench parts``: the model's stages at every batch size and ratio, beside full resolution."""
    if args.study and not args.method:
        raise ValueError("--study needs --method: the study's method (or lever) whose model to time")
    if (args.method or args.scale) and not args.study:
        raise ValueError("--method and --scale go with --study")
    if args.overrides and args.checkpoint:
        raise ValueError("--set changes a config's model; a --checkpoint is timed as it was trained")
    from ..bench.parts import PartsSettings, format_parts_report, run_parts_benchmark

    settings = PartsSettings(  # bad numbers stop here, before the model is built
        batch_sizes=number_list("--batch-sizes", args.batch_sizes, int),
        ratios=number_list("--ratios", args.ratios),
        repeats=args.repeats,
        runs=args.runs,
        threads=args.threads,
        device=args.device,
        bf16=_bf16(args),
        compile=args.compile,
        token_buckets=args.token_buckets,
    )
    model, source = _parts_model(args)
    result = run_parts_benchmark(model, settings, source)
    print(format_parts_report(result))
    emit(args, result.to_dict())
    return 0


def _parts_model(args: argparse.Namespace):
    """The model ``bench parts`` times, and a line saying what it is."""
    from ..model.detection import SplitDetector

    if args.checkpoint:
        from ..train.checkpoints import load_payload, model_from_payload

        model, label = model_from_payload(load_payload(args.checkpoint), args.checkpoint), args.checkpoint
    else:
        if args.study:
            from ..study.spec import load_study

            # the control too: a study is checked with its full-resolution method
            spec = load_study(args.study, scale=args.scale, overrides=args.overrides, methods=_with_control(args))
            config = spec.run_config(0, args.method, "bench")
            label = f"{args.study} method {args.method}" + (f" (scale {args.scale})" if args.scale else "")
        else:
            from ..train.experiment import load_experiment

            config = load_experiment(args.config, args.overrides)
            label = args.config
        from ..train.experiment import build_model

        if args.overrides:
            label += " with " + " ".join(args.overrides)
        # random weights: speed does not depend on them (thresholds are calibrated to each ratio)
        model, label = build_model(config.model, pretrained=False), label + ", random weights"
    if isinstance(model, SplitDetector):
        label += "; a detector: whole, and its backbone alone (:backbone)"
    return model, label


def _with_control(args: argparse.Namespace) -> list[str]:
    """``--method`` and the study's control (``full``), which every study must run."""
    return list(dict.fromkeys([args.method, "full"]))


# ---------------------------------------------------------------------- train
def _add_train(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "train",
        parents=[common_options("MLflow store of --tracking (default: a temporary one)")],
        help="training-step throughput of full resolution and SPLIT, and Ray Train's overhead against "
        "the plain fit_local loop",
    )
    _add_model_options(
        p,
        model="vit_tiny_patch16_224",
        image_size=96,
        patch_size=8,
        levels=3,
        levels_default="default %(default)s",
        policy_width=None,
        policy_width_default="default: none, the policy runs on the ViT's blocks",
    )
    _add_timing_options(p, batch_size=32, repeats=6)
    p.add_argument("--epochs", type=int, default=3, help="epochs of the plain and Ray runs (default %(default)s)")
    p.add_argument(
        "--samples", type=int, default=192, help="training images of the plain and Ray runs (default %(default)s)"
    )
    p.add_argument("--val-samples", type=int, default=64, help="validation images (default %(default)s)")
    p.add_argument("--threads", type=int, help="CPU threads of every run (default: torch's default here)")
    p.add_argument("--ray-rounds", type=int, default=1, help="plain/Ray pairs, alternating order (default %(default)s)")
    p.add_argument(
        "--skip-epochs",
        type=int,
        default=1,
        help="leading epochs left out of steady-state images/s (default %(default)s)",
    )
    p.add_argument(
        "--parts",
        default="steps,ray",
        help="some of steps (A: training steps), ray (B: Ray Train's overhead), allocators (C: the plain "
        "loop under each memory allocator), comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--allocators",
        default="all",
        help="part C's allocators, comma-separated: glibc, glibc-keep, jemalloc, tcmalloc, or all (those "
        "not installed skipped); glibc, the default, always runs (default %(default)s)",
    )
    p.add_argument(
        "--allocator-rounds",
        type=int,
        default=3,
        help="part C's rounds of every allocator and model, alternating order (default %(default)s)",
    )
    p.add_argument("--tracking", action="store_true", help="MLflow logging in the Ray run")
    p.add_argument("--storage", help="Ray storage path (default: a temporary folder)")
    p.add_argument(
        "--teacher",
        choices=("gradient", "attention"),
        default="gradient",
        help="the policy's relevance teacher (default %(default)s)",
    )
    p.add_argument(
        "--teacher-every",
        type=int,
        default=1,
        help="the relevance teacher on every k-th policy step (default %(default)s)",
    )
    p.add_argument(
        "--recipe",
        default="none",
        help="a recipe's settings where the options above leave them (e.g. dense-v1; default %(default)s: "
        "the step the options describe)",
    )
    _add_json_option(p)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """``bench train``: time the training steps (part A), Ray Train against the plain loop (B)
    and the plain loop under each memory allocator (C)."""
    if args.tracking and (args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        checked_tracking_uri(args)  # a server that does not answer: one line in seconds, before torch loads
    from ..bench.training import benchmark_config, format_train_report, run_train_benchmark

    config = benchmark_config(
        model_name=args.model,
        timm_kwargs=_shrunk(args),
        image_size=args.image_size,
        patch_size=args.patch_size,
        levels=args.levels,
        policy_depth=args.policy_depth,
        policy_width=args.policy_width,
        teacher=args.teacher,
        teacher_every=args.teacher_every,
        recipe=args.recipe,
        batch_size=args.batch_size,
        epochs=args.epochs,
        train_samples=args.samples,
        val_samples=args.val_samples,
    )
    result = run_train_benchmark(
        config,
        parts=tuple(p.strip() for p in args.parts.split(",") if p.strip()),
        device=args.device,
        rounds=args.repeats,
        ray_rounds=args.ray_rounds,
        threads=args.threads,
        skip_epochs=args.skip_epochs,
        tracking=args.tracking,
        storage=args.storage,
        autocast_bf16=_bf16(args),
        allocators=tuple(a.strip() for a in args.allocators.split(",") if a.strip()),
        allocator_rounds=args.allocator_rounds,
    )
    print(format_train_report(result))
    emit(args, result.to_dict())
    return 0


# ---------------------------------------------------------------------- data
def _add_data(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "data",
        parents=[common_options(None)],
        help="parquet shards on S3 against local copies: bytes read per epoch and images/s",
    )
    p.add_argument("--samples", type=int, default=2048, help="images written and read (default %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="side of the stored images (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch read (default %(default)s)")
    p.add_argument(
        "--data-uri", help="s3://bucket/prefix to push the shards under (default: a moto S3 server started here)"
    )
    p.add_argument("--data-dir", help="folder for the local copies (default: a temporary folder)")
    p.add_argument("--rows-per-shard", type=int, default=512, help="rows per parquet file (default %(default)s)")
    p.add_argument("--row-group-size", type=int, default=16, help="rows per row group (default %(default)s)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (default %(default)s)")
    p.add_argument(
        "--cache-row-groups",
        type=int,
        default=4,
        help="row groups cached per process = shuffle window (default %(default)s)",
    )
    p.add_argument(
        "--global-shuffle",
        action="store_true",
        help="also read S3 in a global shuffle (the old path: a row-group read per item)",
    )
    p.add_argument(
        "--imagefolder",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also read the images as a local image folder (default: on)",
    )
    _add_json_option(p)
    p.set_defaults(func=run_data)


def run_data(args: argparse.Namespace) -> int:
    """``bench data``: read the same shards from S3 and from local copies, print the ratios."""
    from ..bench.data import DataBenchSettings, format_data_report, run_data_benchmark

    settings = DataBenchSettings(
        s3_uri=args.data_uri,
        local_dir=args.data_dir,
        samples=args.samples,
        image_size=args.image_size,
        batch_size=args.batch_size,
        rows_per_shard=args.rows_per_shard,
        row_group_size=args.row_group_size,
        num_workers=args.num_workers,
        cache_row_groups=args.cache_row_groups,
        global_shuffle=args.global_shuffle,
        imagefolder=args.imagefolder,
    )
    result = run_data_benchmark(settings)
    print(format_data_report(result))
    emit(args, result.to_dict())
    return 0
