"""Fine-patch aggregation into coarse tokens (APT's zero-initialised patch aggregation).

A coarse token is the patch embedding of an area-resized image: a full-resolution
reference never saw its scale. :class:`FineAggregation` lets a coarse token also
carry what the reference's own patch embedding says about the fine patches it
covers: 2x2 stride-2 convolutions fold the finest grid of patch embeddings up the
quadtree, one level at a time, and a zero-initialised projection adds the result
to each level's tokens. At initialisation it adds nothing, so a model fine-tuned
from a reference starts where the reference is and learns how much to use.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class FineAggregation(nn.Module):
    """Per non-finest level, an embedding of the fine patches under each node.

    Args:
        embed_dim: the ViT's token width ``D``.
        levels: quadtree levels ``L`` (``L - 1`` coarse levels get an aggregation).
    """

    def __init__(self, embed_dim: int, levels: int) -> None:
        super().__init__()
        if levels < 2:
            raise ValueError(f"fine aggregation needs at least 2 quadtree levels, got {levels}")
        coarse = levels - 1
        # down[l] folds level l + 1's grid into level l's (a node's 4 children)
        self.down = nn.ModuleList(nn.Conv2d(embed_dim, embed_dim, 2, stride=2) for _ in range(coarse))
        self.norm = nn.ModuleList(nn.LayerNorm(embed_dim) for _ in range(coarse))
        self.proj = nn.ModuleList(nn.Linear(embed_dim, embed_dim) for _ in range(coarse))
        for proj in self.proj:
            nn.init.zeros_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, fine_patches: torch.Tensor) -> list[torch.Tensor]:
        """``(B, H, W, D)`` finest patch embeddings -> one ``(B, H_l, W_l, D)`` term per
        coarse level ``l = 0 .. L-2``, to add to that level's tokens."""
        x = fine_patches.permute(0, 3, 1, 2)
        terms = []  # from the level above the finest up to the coarsest
        for level in reversed(range(len(self.down))):
            x = self.down[level](x)
            terms.append(self.proj[level](self.norm[level](x.permute(0, 2, 3, 1))))
        return terms[::-1]
