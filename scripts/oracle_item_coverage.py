"""How many tokens an oracle needs to see every item at full resolution, on a study's canvases.

    .venv/bin/python scripts/oracle_item_coverage.py [STUDY] [--samples 5000]

STUDY (default ``studies/study_fashion.yaml``) names the canvases: its runs' dataset,
options, canvas size, patch size and quadtree levels, and its evaluation split (seed 0).
The classification study's are 64 px with one 28-px Fashion-MNIST item among clutter;
the detection study's hold 1-3 items. The quadtree's coarse cells are the finest patch
times ``2 ** (levels - 1)``; full resolution is every finest patch a token. For each
canvas this counts the fewest tokens of a quadtree in which every finest patch an item
touches is a leaf (every other cell as coarse as the tree allows): what a policy that
knew exactly where the items are would need for the model to see all of them as full
resolution does (``object_coverage`` 1.0). Printed, for the items' pixels and for their
boxes: the mean, quartiles and range of that share of the full token count, the share
of the oracle's fine tokens on the items (what ``fine_on_object`` would be), and the
share of canvases that fit within each token budget. A study whose parity goal sits
below what the oracle needs asks more than any policy can give.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))  # this checkout's splitvit

from splitvit.data import build_dataset  # noqa: E402
from splitvit.study.spec import load_study  # noqa: E402


def oracle_tokens(mask: np.ndarray, fine: int = 8, levels: int = 3) -> tuple[int, int]:
    """Tokens, and fine tokens, of the coarsest quadtree (finest patch ``fine`` px,
    ``levels`` levels) whose finest level covers every ``True`` pixel of ``mask``."""

    def cell(y: int, x: int, side: int) -> tuple[int, int]:
        if side == fine:
            return 1, 1
        if not mask[y : y + side, x : x + side].any():
            return 1, 0
        half = side // 2
        parts = [cell(y + dy, x + dx, half) for dy in (0, half) for dx in (0, half)]
        return sum(t for t, _ in parts), sum(f for _, f in parts)

    coarse = fine * 2 ** (levels - 1)
    size = mask.shape[0]
    cells = [cell(y, x, coarse) for y in range(0, size, coarse) for x in range(0, size, coarse)]
    return sum(t for t, _ in cells), sum(f for _, f in cells)


def object_cells(mask: np.ndarray, fine: int = 8) -> int:
    """Finest cells that ``mask`` touches: the oracle's fine tokens on the objects."""
    size = mask.shape[0]
    return int(mask.reshape(size // fine, fine, size // fine, fine).any(axis=(1, 3)).sum())


def canvas_shares(study: str | Path, samples: int) -> tuple[str, dict[str, list[tuple[float, int, int]]]]:
    """A line naming ``study``'s canvases, and for ``item pixels`` and ``item boxes`` each
    canvas's oracle token share, its fine cells on the items and the oracle's fine tokens."""
    spec = load_study(study, settings_only=True)
    config = spec.run_config(spec.seeds[0], next(iter(spec.methods)), "oracle", settings_only=True)
    fine = int(config.model.timm_kwargs.get("patch_size", 16))
    levels, size = config.model.levels, config.model.image_size
    options = {**config.data.options, f"{spec.split}_samples": samples}
    data = build_dataset(config.data.name, spec.split, image_size=size, seed=0, **options)
    full = (size // fine) ** 2
    header = (
        f"{study}: {config.data.name} {spec.split} canvases of {size} px, "
        f"{fine}-px finest patches, {levels} levels ({full} tokens at full resolution)"
    )
    shares: dict[str, list[tuple[float, int, int]]] = {"item pixels": [], "item boxes": []}
    for i in range(len(data)):
        canvas = data.render(i)
        items = canvas.item_masks.any(axis=0)
        boxes = np.zeros_like(items)
        for y, x, h, w in canvas.boxes:
            boxes[y : y + h, x : x + w] = True
        for what, mask in (("item pixels", items), ("item boxes", boxes)):
            tokens, fine_tokens = oracle_tokens(mask, fine, levels)
            shares[what].append((tokens / full, object_cells(items, fine), fine_tokens))
    return header, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", default=str(ROOT / "studies" / "study_fashion.yaml"))
    parser.add_argument("--samples", type=int, default=5000, help="canvases of the study's evaluation split")
    args = parser.parse_args()
    header, by_what = canvas_shares(args.study, args.samples)
    print(header)
    for what, rows in by_what.items():
        shares = [share for share, _, _ in rows]
        q1, median, q3 = statistics.quantiles(shares, n=4)
        print(
            f"{what}: {len(shares)} canvases, oracle token share mean {statistics.mean(shares):.3f}, "
            f"quartiles {q1:.3f} / {median:.3f} / {q3:.3f}, range {min(shares):.3f}-{max(shares):.3f}; "
            f"its fine tokens on the items (fine_on_object) "
            f"{sum(c for _, c, _ in rows) / max(1, sum(f for _, _, f in rows)):.3f}"
        )
        for budget in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
            fits = float(np.mean(np.array(shares) <= budget))
            print(f"  canvases whose items fit in {budget:.0%} of the tokens: {fits:.1%}")


if __name__ == "__main__":
    main()
