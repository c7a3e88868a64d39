"""Split maps: the quadtree a policy chose, drawn over the images."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..model.quadtree import QuadtreeGeometry, leaf_masks

# one outline colour per level, coarse to fine
LEVEL_COLOURS = [(255, 255, 255), (255, 200, 0), (255, 40, 40), (0, 200, 255), (120, 255, 120)]
#: a detection's box and the tint of its mask: off the levels' colours
DETECTION_COLOUR = (255, 0, 255)
#: detections drawn: those at least this confident (torchvision keeps down to 0.05)
MIN_SCORE = 0.5


def draw_split_map(
    image: torch.Tensor,
    decisions: list[torch.Tensor],
    geometry: QuadtreeGeometry,
    scale: int = 4,
    detections: dict[str, torch.Tensor] | None = None,
    names: list[str] | None = None,
) -> Image.Image:
    """One image ``(C, H, W)`` in ``[0, 1]`` with its leaves outlined, ``scale`` times larger.

    ``decisions`` are the per-level split masks of this image, ``(H_l, W_l)`` each.
    ``detections`` (a detector's, torchvision's format): those scoring at least
    :data:`MIN_SCORE` are drawn over it, masks tinted, boxes outlined and labelled with
    ``names[label - 1]`` (or the label) and the score.
    """
    array = image.detach().float().cpu().clamp(0, 1)
    if array.shape[0] == 1:
        array = array.expand(3, -1, -1)
    pixels = (array[:3].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    kept = None
    if detections is not None:
        kept = detections["scores"].detach().cpu() >= MIN_SCORE
        if "masks" in detections:
            masks = detections["masks"].detach().cpu()[kept]
            covered = (masks.reshape(len(masks), *pixels.shape[:2]) > 0.5).any(0).numpy() if len(masks) else None
            if covered is not None:
                pixels[covered] = (0.5 * pixels[covered] + 0.5 * np.array(DETECTION_COLOUR)).astype(np.uint8)
    h, w = pixels.shape[:2]
    canvas = Image.fromarray(pixels).resize((w * scale, h * scale), Image.NEAREST)
    draw = ImageDraw.Draw(canvas)
    leaves = leaf_masks([d.unsqueeze(0).bool().cpu() for d in decisions])
    for level, mask in enumerate(leaves):
        size = geometry.cell_size(level) * scale
        colour = LEVEL_COLOURS[min(level, len(LEVEL_COLOURS) - 1)]
        for r, c in torch.nonzero(mask[0]).tolist():
            draw.rectangle([c * size, r * size, (c + 1) * size - 1, (r + 1) * size - 1], outline=colour)
    if kept is not None:
        boxes = detections["boxes"].detach().cpu()[kept].tolist()
        labels = detections["labels"].detach().cpu()[kept].tolist()
        scores = detections["scores"].detach().cpu()[kept].tolist()
        for (x0, y0, x1, y1), label, score in zip(boxes, labels, scores):
            draw.rectangle([x0 * scale, y0 * scale, x1 * scale - 1, y1 * scale - 1], outline=DETECTION_COLOUR, width=2)
            name = names[label - 1] if names and 0 < label <= len(names) else str(label)
            draw.text((x0 * scale + 2, y0 * scale + 1), f"{name} {score:.2f}", fill=DETECTION_COLOUR)
    return canvas


def split_map_grid(
    images: torch.Tensor,
    decisions: list[torch.Tensor],
    geometry: QuadtreeGeometry,
    captions: list[str] | None = None,
    columns: int = 8,
    scale: int = 4,
    detections: list[dict[str, torch.Tensor]] | None = None,
    names: list[str] | None = None,
) -> Image.Image:
    """A grid of split maps for a batch, with an optional caption under each and, for a
    detector, its detections over each image (:func:`draw_split_map`)."""
    tiles = [
        draw_split_map(
            images[i], [d[i] for d in decisions], geometry, scale, detections[i] if detections else None, names
        )
        for i in range(images.shape[0])
    ]
    tw, th = tiles[0].size
    caption_h = 14 if captions else 0
    cols = min(columns, len(tiles))
    rows = (len(tiles) + cols - 1) // cols
    grid = Image.new("RGB", (cols * tw, rows * (th + caption_h)), (0, 0, 0))
    draw = ImageDraw.Draw(grid)
    for i, tile in enumerate(tiles):
        x, y = (i % cols) * tw, (i // cols) * (th + caption_h)
        grid.paste(tile, (x, y))
        if captions:
            draw.text((x + 2, y + th + 1), captions[i], fill=(255, 255, 255))
    return grid
