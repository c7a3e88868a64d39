"""How many tokens an oracle needs to see the item at full resolution, on the study's canvases.

    .venv/bin/python scripts/oracle_item_coverage.py [--samples 5000]

The study's canvases (64 px, one 28-px Fashion-MNIST item among clutter; the test
split, seed 0) are tokenised by a 3-level quadtree: 4 coarse cells of 32 px, each
splittable into 4 cells of 16 px, each into 4 fine patches of 8 px (64 fine tokens is
full resolution). For each canvas this counts the fewest tokens of a quadtree in which
every fine patch the item touches is a leaf (every other cell as coarse as the tree
allows): what a policy that knew exactly where the item is would need for the model
to see all of it as full resolution does (``object_coverage`` 1.0). Printed: the
mean, quartiles and range of that share of 64, the share of the oracle's fine tokens
on the item (what ``fine_on_object`` would be), and the share of canvases that fit
within each token budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.data import build_dataset  # noqa: E402

FINE, MID, COARSE = 8, 16, 32


def oracle_tokens(mask: np.ndarray) -> tuple[int, int]:
    """Tokens, and fine tokens, of the coarsest quadtree whose fine level covers every
    ``True`` pixel of ``mask``."""
    size = mask.shape[0]
    tokens = fine = 0
    for cy in range(0, size, COARSE):
        for cx in range(0, size, COARSE):
            if not mask[cy : cy + COARSE, cx : cx + COARSE].any():
                tokens += 1
                continue
            for my in range(cy, cy + COARSE, MID):
                for mx in range(cx, cx + COARSE, MID):
                    split = bool(mask[my : my + MID, mx : mx + MID].any())
                    tokens += 4 if split else 1
                    fine += 4 if split else 0
    return tokens, fine


def object_cells(mask: np.ndarray) -> int:
    """Fine cells (8 px) that ``mask`` touches: the oracle's fine tokens on the object."""
    size = mask.shape[0]
    return int(mask.reshape(size // FINE, FINE, size // FINE, FINE).any(axis=(1, 3)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5000, help="test canvases (the study evaluates 5,000)")
    args = parser.parse_args()
    data = build_dataset(
        "cluttered-fashion-mnist", "test", image_size=64, seed=0, clutter_fraction=0.4, test_samples=args.samples
    )
    full = (64 // FINE) ** 2
    for what in ("item pixels", "item box"):
        shares, on_object = [], []
        for i in range(len(data)):
            canvas = data.render(i)
            if what == "item pixels":
                mask = canvas.item_masks.any(axis=0)
            else:
                mask = np.zeros(canvas.clutter_mask.shape, dtype=bool)
                for y, x, h, w in canvas.boxes:
                    mask[y : y + h, x : x + w] = True
            tokens, fine = oracle_tokens(mask)
            shares.append(tokens / full)
            on_object.append((object_cells(canvas.item_masks.any(axis=0)), fine))
        q1, median, q3 = statistics.quantiles(shares, n=4)
        print(
            f"{what}: {len(shares)} canvases, oracle token share mean {statistics.mean(shares):.3f}, "
            f"quartiles {q1:.3f} / {median:.3f} / {q3:.3f}, range {min(shares):.3f}-{max(shares):.3f}; "
            f"its fine tokens on the item (fine_on_object) "
            f"{sum(c for c, _ in on_object) / sum(f for _, f in on_object):.3f}"
        )
        for budget in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
            fits = float(np.mean(np.array(shares) <= budget))
            print(f"  canvases whose item fits in {budget:.0%} of the tokens: {fits:.1%}")


if __name__ == "__main__":
    main()
