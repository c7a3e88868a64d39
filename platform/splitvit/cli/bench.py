"""``splitvit bench``: SPLIT against full resolution, measured side by side in one run."""

from __future__ import annotations

import argparse

from .options import common_options, number_list
from .output import emit


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit bench`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "bench",
        parents=[
            common_options(
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
    p.set_defaults(func=run)


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


def _shrunk(args: argparse.Namespace) -> dict:
    return {
        k: v
        for k, v in (("embed_dim", args.embed_dim), ("depth", args.depth), ("num_heads", args.heads))
        if v is not None
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.kind`` names, print its report, hand its figures to the envelope."""
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
    from ..bench.forward import ForwardSettings, format_report, run_forward_benchmark

    # an option left out (or given as 0 / empty) keeps ForwardSettings' default
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


def _bench_bf16(args: argparse.Namespace) -> bool:
    return args.device.startswith("cuda") if args.bf16 is None else args.bf16


def _run_bench_train(args: argparse.Namespace) -> int:
    from ..bench.training import benchmark_config, format_train_report, run_train_benchmark

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


def _run_bench_data(args: argparse.Namespace) -> int:
    from ..bench.data import DataBenchSettings, format_data_report, run_data_benchmark

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
