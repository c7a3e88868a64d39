"""Quadtree geometry of hierarchical patch splitting.

Level 0 is the coarse grid (patch side ``P = p * 2**(L-1)``); level ``L-1`` is the
finest grid (patch side ``p``). A node at level ``l < L-1`` is either a leaf (one
token) or splits into its four children; finest nodes are always leaves.

Decisions and scores are kept as one tensor per non-finest level, shaped
``(B, H_l, W_l)`` on that level's grid, so every operation here is a pooling or an
upsampling on a grid rather than a walk over a tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class GeometryError(ValueError):
    """Image size, patch size or level count that cannot form a quadtree."""


@dataclass(frozen=True)
class QuadtreeGeometry:
    """Sizes of a quadtree of patches over an ``image_size`` image.

    Args:
        image_size: ``(H, W)`` in pixels; each side a multiple of the coarsest patch.
        patch_size: side ``p`` of the finest (base) patch.
        levels: number of levels ``L >= 2``.
    """

    image_size: tuple[int, int]
    patch_size: int
    levels: int

    def __post_init__(self) -> None:
        if isinstance(self.image_size, int):
            object.__setattr__(self, "image_size", (self.image_size, self.image_size))
        object.__setattr__(self, "image_size", tuple(int(s) for s in self.image_size))
        if int(self.patch_size) < 1:
            raise GeometryError(f"patch_size must be >= 1, got {self.patch_size}")
        if int(self.levels) < 2:
            raise GeometryError(f"levels must be >= 2 (one coarse and one fine level), got {self.levels}")
        h, w = self.image_size
        big = self.coarse_patch_size
        if h <= 0 or w <= 0 or h % big or w % big:
            raise GeometryError(
                f"image size {h}x{w} is not a multiple of the coarsest patch {big} "
                f"(patch_size {self.patch_size} * 2**(levels-1) with levels={self.levels}); "
                f"use an image side that is a multiple of {big}"
            )

    @property
    def coarse_patch_size(self) -> int:
        """Side ``P`` of a level-0 patch."""
        return self.patch_size * 2 ** (self.levels - 1)

    def cell_size(self, level: int) -> int:
        """Side in pixels of a node at ``level``."""
        return self.coarse_patch_size // 2**level

    def grid(self, level: int) -> tuple[int, int]:
        """``(rows, cols)`` of the node grid at ``level``."""
        s = self.cell_size(level)
        return self.image_size[0] // s, self.image_size[1] // s

    def num_nodes(self, level: int) -> int:
        gh, gw = self.grid(level)
        return gh * gw

    @property
    def full_tokens(self) -> int:
        """``N_full``: tokens at full (finest) resolution."""
        return self.num_nodes(self.levels - 1)

    @property
    def min_tokens(self) -> int:
        """``N_min``: tokens when nothing splits."""
        return self.num_nodes(0)

    @property
    def total_nodes(self) -> int:
        """Nodes over all levels: the length of the all-levels token layout."""
        return sum(self.num_nodes(level) for level in range(self.levels))


def repeat_cells(x: torch.Tensor, factor: int, dim: int = -2) -> torch.Tensor:
    """Repeat every cell of the grid on dims ``dim, dim + 1`` into ``factor x factor``
    cells: ``(..., h, w, ...) -> (..., factor * h, factor * w, ...)``.

    One expand and one copy: ``repeat_interleave`` twice is an indexed copy per dim,
    several times slower on the CPU (and far slower on a permuted, strided grid).
    """
    d = dim % x.dim()
    lead, (h, w), tail = x.shape[:d], x.shape[d : d + 2], x.shape[d + 2 :]
    cells = x.reshape(*lead, h, 1, w, 1, *tail).expand(*lead, h, factor, w, factor, *tail)
    return cells.reshape(*lead, h * factor, w * factor, *tail)


def upsample_to_children(x: torch.Tensor) -> torch.Tensor:
    """Repeat each node's value onto its four children: ``(B, h, w) -> (B, 2h, 2w)``."""
    return repeat_cells(x, 2)


def sum_children(x: torch.Tensor) -> torch.Tensor:
    """Sum each node's four children: ``(B, 2h, 2w) -> (B, h, w)``."""
    return F.avg_pool2d(x.unsqueeze(1), 2).squeeze(1) * 4


def top_down_decisions(split: list[torch.Tensor]) -> list[torch.Tensor]:
    """Make raw per-node split wishes hierarchical: a node splits only if its parent did.

    Args:
        split: one bool tensor ``(B, H_l, W_l)`` per non-finest level.
    Returns:
        The same shapes, with every node whose ancestor did not split set to False.
    """
    out: list[torch.Tensor] = []
    active = None
    for wish in split:
        decided = wish if active is None else wish & active
        out.append(decided)
        active = upsample_to_children(decided)
    return out


def leaf_masks(decisions: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves per level (``L`` masks) from hierarchical decisions (``L-1`` masks)."""
    masks: list[torch.Tensor] = []
    active = torch.ones_like(decisions[0])
    for decided in decisions:
        masks.append(active & ~decided)
        active = upsample_to_children(active & decided)
    masks.append(active)
    return masks


def leaf_counts_per_level(leaves: list[torch.Tensor]) -> torch.Tensor:
    """Each image's leaves at each level, from :func:`leaf_masks`: ``(L, B)`` long."""
    return torch.stack([m.flatten(1).sum(1) for m in leaves])


def token_counts(decisions: list[torch.Tensor]) -> torch.Tensor:
    """Tokens per image implied by hierarchical decisions: ``(B,)`` long."""
    return leaf_counts_per_level(leaf_masks(decisions)).sum(0)


def expected_tokens(split_probs: list[torch.Tensor]) -> torch.Tensor:
    """Differentiable expected tokens per image, ``(B,)``.

    ``E[n(node)] = (1 - q) + q * sum(E[n(child)])`` with finest nodes counting 1.
    """
    finest = split_probs[-1]
    expected = torch.ones(
        finest.shape[0], finest.shape[1] * 2, finest.shape[2] * 2, dtype=finest.dtype, device=finest.device
    )
    for q in reversed(split_probs):
        expected = (1 - q) + q * sum_children(expected)
    return expected.flatten(1).sum(1)


def nodes_mass(fine_map: torch.Tensor, geometry: QuadtreeGeometry) -> list[torch.Tensor]:
    """Sum a per-finest-cell map ``(B, H_{L-1}, W_{L-1})`` into every non-finest level."""
    out: list[torch.Tensor] = []
    for level in range(geometry.levels - 1):
        factor = 2 ** (geometry.levels - 1 - level)
        out.append(F.avg_pool2d(fine_map.unsqueeze(1), factor).squeeze(1) * factor * factor)
    return out


def fine_cell_level(decisions: list[torch.Tensor]) -> torch.Tensor:
    """For each finest cell, the level of the leaf that covers it: ``(B, H_{L-1}, W_{L-1})`` long.

    Enough to draw the quadtree and to measure where fine tokens fall.
    """
    masks = leaf_masks(decisions)
    levels = len(masks)
    out = torch.zeros_like(masks[-1], dtype=torch.long)
    for level, mask in enumerate(masks):
        m = mask
        for _ in range(levels - 1 - level):
            m = upsample_to_children(m)
        out = torch.where(m, torch.full_like(out, level), out)
    return out
