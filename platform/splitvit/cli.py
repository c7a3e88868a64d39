"""The ``splitvit`` command.

Each subcommand parses its arguments, calls the library, prints its figures and,
with ``--json PATH``, writes them as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("splitvit")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write a command's figures to ``path`` (no-op when ``path`` is None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


# ---------------------------------------------------------------------- demo
def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train a tiny SPLIT model and a full-resolution ViT on synthetic data, compare them")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo's)")
    p.add_argument("--samples", type=int, default=None, help="training images (default: the demo's)")
    p.add_argument("--target-ratio", type=float, default=0.3, help="SPLIT's token budget as a fraction of full resolution")
    p.add_argument("--out", default="runs/demo", help="folder for checkpoints and split maps")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from .demo import run_demo

    result = run_demo(out_dir=args.out, epochs=args.epochs, samples=args.samples, target_ratio=args.target_ratio)
    _print_table(result["rows"], ["method", "accuracy", "tokens_per_image", "token_ratio", "fine_on_object"])
    print(f"split maps: {result['split_map']}")
    write_json(args.json, result)
    return 0


# ---------------------------------------------------------------------- viz
def _add_viz(sub) -> None:
    p = sub.add_parser("viz", help="draw the quadtree a policy chooses over images into a PNG")
    p.add_argument("--checkpoint", help="a SplitViT checkpoint (SplitViT.save); without it a fresh model is built")
    p.add_argument("--policy", help="policy to draw (default: the checkpoint's, or entropy)")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
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
        raise SystemExit(f"--thresholds: expected comma-separated numbers in [0, 1], got {text!r}") from None


def _run_viz(args) -> int:
    import torch

    from .data.synthetic import SyntheticObjects
    from .demo import build_demo_model
    from .model import SplitViT
    from .viz import split_map_grid

    if args.checkpoint:
        overrides = {"policy": args.policy} if args.policy else {}
        model = SplitViT.load(args.checkpoint, **overrides)
    else:
        model = build_demo_model(args.policy or "entropy")
    model.eval()
    size = model.geometry.image_size[0]
    data = SyntheticObjects(args.count, image_size=size, seed=args.seed)
    images = torch.stack([data[i][0] for i in range(args.count)])
    with torch.no_grad():
        out = model(images, thresholds=parse_thresholds(args.thresholds))
    captions = [f"{int(t)} tok" for t in out.tokens]
    split_map_grid(images, out.decisions, model.geometry, captions).save(args.out)
    print(f"wrote {args.out}: {model.policy.name} policy, mean {out.tokens.float().mean():.1f} of {out.full_tokens} tokens")
    write_json(args.json, {"png": args.out, "policy": model.policy.name, "tokens": out.tokens.tolist(), "full_tokens": out.full_tokens})
    return 0


# ---------------------------------------------------------------------- bench
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="SPLIT vs full-resolution ViT: forward speed, overhead, memory (side by side)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed forward passes per model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from .bench import format_report, run_forward_benchmark

    result = run_forward_benchmark(
        batch_size=args.batch_size, image_size=args.image_size, patch_size=args.patch_size,
        levels=args.levels, repeats=args.repeats, device=args.device,
    )
    print(format_report(result))
    write_json(args.json, result)
    return 0


COMMANDS: list[Callable] = [_add_demo, _add_viz, _add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitvit", description="SPLIT: learned hierarchical patch splitting for ViTs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"splitvit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
