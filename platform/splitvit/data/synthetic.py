"""Procedural datasets made on the fly: deterministic given a seed, no files.

``SyntheticObjects`` is the task SPLIT is built for: the label depends on one small
object whose classes differ only at the finest scale (1-pixel stripe and checker
textures that average to the same colour at any coarser scale), placed on a flat
canvas among high-entropy noise rectangles that carry no label information. Pixel
entropy is high on the clutter and low on the object, so entropy splitting looks
in the wrong place; a model that knows the task should split the object.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

NUM_GLYPHS = 4
#: A dataset whose items fit in this many bytes keeps each item once drawn: an epoch
#: after the first reads them back instead of drawing again (~0.5 ms an item).
CACHE_BYTES = 256 * 2**20


def _glyph(label: int, size: int) -> np.ndarray:
    """A ``size x size`` binary texture whose class shows only at 1-pixel scale."""
    yy, xx = np.mgrid[0:size, 0:size]
    if label == 0:
        g = yy % 2 == 0  # horizontal stripes
    elif label == 1:
        g = xx % 2 == 0  # vertical stripes
    elif label == 2:
        g = (yy + xx) % 2 == 0  # checkerboard
    else:
        g = (yy // 2 + xx // 2) % 2 == 0  # 2-pixel checkerboard
    return g.astype(np.float32)


class SyntheticObjects(Dataset):
    """One small textured object among noise clutter; label = the object's texture.

    Each item is ``(image (3, H, W) float in [0, 1], label, object_mask (H, W) bool)``.

    Args:
        num_samples: dataset length.
        image_size: canvas side in pixels.
        object_size: glyph side in pixels.
        clutter_fraction: share of the canvas covered by noise rectangles (roughly).
        num_classes: 2 to 4 texture classes.
        seed: items depend only on ``(seed, index)``.

    Items are drawn on first access; a dataset of at most :data:`CACHE_BYTES` keeps
    them (in each process that reads it), so later epochs cost no drawing.
    """

    def __init__(
        self,
        num_samples: int = 1024,
        image_size: int = 64,
        object_size: int = 8,
        clutter_fraction: float = 0.4,
        num_classes: int = NUM_GLYPHS,
        seed: int = 0,
    ) -> None:
        if not 2 <= num_classes <= NUM_GLYPHS:
            raise ValueError(f"num_classes must be in [2, {NUM_GLYPHS}], got {num_classes}")
        if object_size > image_size:
            raise ValueError(f"object_size {object_size} exceeds image_size {image_size}")
        if not 0.0 <= clutter_fraction < 1.0:
            raise ValueError(f"clutter_fraction must be in [0, 1), got {clutter_fraction}")
        self.num_samples = num_samples
        self.image_size = image_size
        self.object_size = object_size
        self.clutter_fraction = clutter_fraction
        self.num_classes = num_classes
        self.seed = seed
        self.glyphs = [_glyph(c, object_size) for c in range(num_classes)]
        item_bytes = (3 * 4 + 1) * image_size * image_size  # float32 image, bool mask
        self._items: dict[int, tuple[torch.Tensor, int, torch.Tensor]] | None = (
            {} if num_samples * item_bytes <= CACHE_BYTES else None
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        if self._items is None:
            return self._draw(index)
        if index not in self._items:
            self._items[index] = self._draw(index)
        image, label, mask = self._items[index]
        return image.clone(), label, mask.clone()  # a caller may change its copy in place

    def _draw(self, index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Item ``index``, drawn from its own generator."""
        rng = np.random.default_rng((self.seed, index))
        size, obj = self.image_size, self.object_size
        label = int(rng.integers(self.num_classes))
        background = rng.uniform(0.3, 0.7, size=3).astype(np.float32)
        image = np.broadcast_to(background[:, None, None], (3, size, size)).copy()
        oy, ox = rng.integers(0, size - obj + 1, size=2)
        object_mask = np.zeros((size, size), dtype=bool)
        object_mask[oy : oy + obj, ox : ox + obj] = True
        # clutter: noise rectangles kept off the object, until the target coverage
        clutter = np.zeros((size, size), dtype=bool)
        keep_out = _dilate(object_mask, 2)
        target = self.clutter_fraction * size * size
        for _ in range(64):
            if clutter.sum() >= target:
                break
            h, w = rng.integers(size // 8, size // 3 + 1, size=2)
            y, x = rng.integers(0, size - h + 1), rng.integers(0, size - w + 1)
            box = np.zeros_like(clutter)
            box[y : y + h, x : x + w] = True
            box &= ~keep_out
            image[:, box] = rng.uniform(0, 1, size=(3, int(box.sum()))).astype(np.float32)
            clutter |= box
        # red-on-black texture: the class is in the pattern, which any pooling to a
        # coarser scale averages to the same dark red. The colour says *where* the
        # object is at every scale; only fine patches say *which* it is.
        image[:, oy : oy + obj, ox : ox + obj] = 0.0
        image[0, oy : oy + obj, ox : ox + obj] = self.glyphs[label]
        return torch.from_numpy(image), label, torch.from_numpy(object_mask)


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    out = mask.copy()
    ys, xs = np.nonzero(mask)
    if len(ys):
        out[max(ys.min() - radius, 0) : ys.max() + radius + 1, max(xs.min() - radius, 0) : xs.max() + radius + 1] = True
    return out
