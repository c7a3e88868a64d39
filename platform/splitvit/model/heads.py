"""Output heads: masked pooling for classification, and a light dense decoder."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def masked_pool(features: torch.Tensor, valid: torch.Tensor | None, pool: str, num_prefix: int) -> torch.Tensor:
    """Pool ``(B, prefix + S, D)`` features: the class token, or the mean of the
    valid (non-padding) image tokens."""
    if pool == "token":
        return features[:, 0]
    tokens = features[:, num_prefix:]
    if valid is None:
        return tokens.mean(1)
    w = valid.to(tokens.dtype).unsqueeze(-1)
    return (tokens * w).sum(1) / w.sum(1).clamp_min(1)


class DenseHead(nn.Module):
    """Per-pixel logits from leaf features laid on the finest grid.

    Each leaf's feature fills the fine cells it covers (done by the model); this
    decoder smooths across leaf borders with a 3x3 conv, classifies each cell, and
    upsamples to the image size.
    """

    def __init__(self, embed_dim: int, num_classes: int, patch_size: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden = hidden_dim or max(embed_dim // 2, 32)
        self.decoder = nn.Sequential(
            nn.Conv2d(embed_dim, hidden, 3, padding=1),
            nn.BatchNorm2d(hidden),
            nn.GELU(),
            nn.Conv2d(hidden, num_classes, 1),
        )
        self.patch_size = patch_size

    def forward(self, fine_features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        logits = self.decoder(fine_features)
        return F.interpolate(logits, size=image_size, mode="bilinear", align_corners=False)
