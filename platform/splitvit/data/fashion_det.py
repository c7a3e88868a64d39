"""Fashion-MNIST detection: several items per canvas at varied sizes, exact boxes and masks,
with or without label-irrelevant clutter; and a writer to COCO's format.

A canvas (default 128 px) holds 2-6 Fashion-MNIST items resized to 16-56 px, placed
without overlapping (a margin apart). An item's mask is its pixels above
``mask_threshold`` (only those pixels are painted, so the mask is exactly what
differs from the flat background) and its box is tight around the mask. With
``clutter=True`` the rest of the canvas is covered, to ``clutter_fraction``, by the
clutter of :mod:`.cluttered` (noise textures, fragments of other items), kept
``margin`` pixels off the items: hard negatives. ``clutter=False`` draws the same
items at the same places on a plain background (the clutter is drawn last from the
canvas's random stream), so the two variants differ only in the clutter.

Everything about canvas ``i`` depends only on ``(seed, i)``. Pixels are 8-bit
values (``k / 255``), so a canvas written as PNG by :func:`write_coco` reads back
through :class:`~.coco.CocoDetection` bit for bit.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..storage import join_uri, write_bytes
from .cluttered import Canvas, item_intensity, paint_clutter, paint_item, place_tile, tile_with_margin
from .coco import coco_entries, empty_target
from .coco_format import CocoAnnotation, CocoCategory, CocoDocument, CocoImage
from .fashion_mnist import CLASSES


def mask_boxes(masks: np.ndarray) -> np.ndarray:
    """Tight boxes around masks ``(N, H, W)``: float32 ``(N, 4)`` x1, y1, x2, y2 in pixel edges
    (a mask's pixels span ``x1 <= x < x2``, as COCO's ``toBbox`` counts them); every mask non-empty."""
    boxes = np.zeros((len(masks), 4), dtype=np.float32)
    for n, mask in enumerate(masks):
        rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        boxes[n] = (cols[0], rows[0], cols[-1] + 1, rows[-1] + 1)
    return boxes


def _pixels_to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 ``(3, H, W)`` -> float32 in [0, 1], the same arithmetic as ``common.image_to_tensor``."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).float().div_(255.0)


class FashionDetection(Dataset):
    """Detection and instance segmentation on canvases of Fashion-MNIST items.

    Items are ``(image, target)`` in :class:`~.coco.CocoDetection`'s format: ``image``
    float32 ``(3, S, S)``, ``target`` with ``boxes`` (tight, x1 y1 x2 y2), ``labels``
    (the item's Fashion-MNIST class + 1, so 1..10), ``masks`` uint8, ``iscrowd`` (all 0),
    ``area`` (mask pixels) and ``image_id`` (the index).

    Args:
        images, labels: the item pool (uint8 ``(N, 28, 28)`` and ``(N,)``), e.g. from
            ``fashion_mnist_split``; clutter fragments come from the same pool.
        image_size: canvas side.
        num_samples: dataset length (default: the pool size).
        min_items, max_items: items per canvas (drawn uniformly). An item that does not
            fit is drawn smaller, down to ``min_item_size``, else left out (rare).
        min_item_size, max_item_size: item side range (resized from 28 px).
        clutter: cover ``clutter_fraction`` of the canvas with clutter, or leave it plain.
        clutter_fraction: share of the canvas under clutter; items (with margins) never
            take more than the rest, in both variants.
        fragment_prob: chance that a clutter patch carries a fragment of another item;
            a fragment shows at most half an item's side, so it is never a whole item.
        margin: item-free and clutter-free pixels around each item.
        mask_threshold: item intensity above which a pixel belongs to the item.
        seed: canvases depend only on ``(seed, index)``.
    """

    categories = CLASSES
    category_ids = tuple(range(1, len(CLASSES) + 1))
    num_classes = len(CLASSES) + 1  # with the background

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        image_size: int = 128,
        num_samples: int | None = None,
        min_items: int = 2,
        max_items: int = 6,
        min_item_size: int = 16,
        max_item_size: int = 56,
        clutter: bool = True,
        clutter_fraction: float = 0.35,
        fragment_prob: float = 0.5,
        margin: int = 2,
        mask_threshold: float = 0.1,
        seed: int = 0,
    ) -> None:
        if images.ndim != 3 or len(images) != len(labels) or len(images) < max_items + 1:
            raise ValueError(
                f"need more than max_items ({max_items}) items as (N, h, w) images with N labels, "
                f"got {images.shape} and {labels.shape}"
            )
        if not 1 <= min_items <= max_items:
            raise ValueError(f"need 1 <= min_items <= max_items, got {min_items} and {max_items}")
        if not 1 <= min_item_size <= max_item_size <= image_size - 2 * margin:
            raise ValueError(
                f"need 1 <= min_item_size <= max_item_size <= image_size - 2 * margin ({image_size - 2 * margin}), "
                f"got {min_item_size} and {max_item_size}"
            )
        if not 0.0 <= clutter_fraction < 1.0:
            raise ValueError(f"clutter_fraction must be in [0, 1), got {clutter_fraction}")
        if not 0.0 <= fragment_prob <= 1.0:
            raise ValueError(f"fragment_prob must be in [0, 1], got {fragment_prob}")
        if (min_item_size + 2 * margin) ** 2 > (1 - clutter_fraction) * image_size * image_size:
            raise ValueError(
                f"clutter_fraction {clutter_fraction} of a {image_size}x{image_size} canvas leaves no room for an "
                f"item of {min_item_size}px (+{margin}px margin)"
            )
        self.images = images
        self.labels = labels.astype(np.int64)
        self.image_size = image_size
        self.num_samples = len(images) if num_samples is None else int(num_samples)
        self.min_items, self.max_items = min_items, max_items
        self.min_item_size, self.max_item_size = min_item_size, max_item_size
        self.clutter = clutter
        self.clutter_fraction = clutter_fraction
        self.fragment_prob = fragment_prob
        self.margin = margin
        self.mask_threshold = mask_threshold
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def render(self, index: int) -> Canvas:
        """Canvas ``index``: image (float, 8-bit values), item tiles ``(y, x, h, w)``, Fashion-MNIST
        classes (0..9), item masks, clutter mask (all False without clutter), background colour."""
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        rng = np.random.default_rng((self.seed, index))
        size, margin = self.image_size, self.margin
        # 8-bit values throughout: the flat background stays exactly flat in a PNG
        background = (np.round(rng.uniform(0.0, 0.25, size=3) * 255.0) / 255.0).astype(np.float32)
        image = np.broadcast_to(background[:, None, None], (3, size, size)).copy()
        keepout = np.zeros((size, size), dtype=bool)
        room = int((1 - self.clutter_fraction) * size * size)  # items (with margins) leave the clutter its share
        count = int(rng.integers(self.min_items, self.max_items + 1))
        picks = [int(j) for j in rng.choice(len(self.images), size=count, replace=False)]
        sides = sorted(int(s) for s in rng.integers(self.min_item_size, self.max_item_size + 1, size=count))
        tiles, classes, masks = [], [], []
        for j, side in zip(picks, reversed(sides), strict=True):  # largest first: they are the hardest to fit
            while True:
                corner = place_tile(keepout, side, margin, rng)
                if corner is not None and keepout.sum() + keepout[tile_with_margin(*corner, side, margin)].size <= room:
                    break
                if side == self.min_item_size:
                    corner = None
                    break
                side = max(self.min_item_size, side * 3 // 4)
            if corner is None:
                continue
            alpha = item_intensity(self.images[j], side)
            alpha = np.where(alpha > self.mask_threshold, alpha, 0.0).astype(np.float32)
            if not alpha.any():  # a blank item has nothing to detect
                continue
            oy, ox = corner
            keepout[tile_with_margin(oy, ox, side, margin)] = True
            paint_item(image, background, alpha, oy, ox, rng)
            mask = np.zeros((size, size), dtype=bool)
            mask[oy : oy + side, ox : ox + side] = alpha > 0
            tiles.append((oy, ox, side, side))
            classes.append(int(self.labels[j]))
            masks.append(mask)
        clutter = np.zeros((size, size), dtype=bool)
        if self.clutter:
            fragment_size = self.max_item_size
            clutter = paint_clutter(
                image,
                keepout,
                rng,
                pool=self.images,
                exclude=set(picks),
                fragment_item_size=fragment_size,
                clutter_fraction=self.clutter_fraction,
                fragment_prob=self.fragment_prob,
                fragment_max_side=fragment_size // 2,
            )
        return Canvas(
            image=np.round(image * 255.0) / 255.0,
            labels=classes,
            boxes=tiles,
            item_masks=np.stack(masks) if masks else np.zeros((0, size, size), bool),
            clutter_mask=clutter,
            background=background,
        )

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        canvas = self.render(index)
        image = _pixels_to_tensor(np.round(canvas.image * 255.0).astype(np.uint8))
        size = self.image_size
        if not canvas.labels:
            return image, empty_target(index, size, size)
        masks = canvas.item_masks
        return image, {
            "boxes": torch.from_numpy(mask_boxes(masks)),
            "labels": torch.tensor(canvas.labels, dtype=torch.int64) + 1,
            "masks": torch.from_numpy(masks.astype(np.uint8)),
            "iscrowd": torch.zeros(len(masks), dtype=torch.uint8),
            "area": torch.from_numpy(masks.sum(axis=(1, 2)).astype(np.float32)),
            "image_id": torch.tensor(index, dtype=torch.int64),
        }


class CocoFiles(NamedTuple):
    """Where :func:`write_coco` put a split: ``CocoDetection(*files)`` reads it back."""

    annotation_file: str
    image_root: str


def coco_document(dataset: Dataset, on_image: Callable[[int, torch.Tensor], str] | None = None) -> CocoDocument:
    """The COCO instances document of every item of ``dataset`` (in
    :class:`~.coco.CocoDetection`'s format, with ``categories`` and ``category_ids``
    attributes): images, annotations (:func:`~.coco.coco_entries`: bbox x, y, w, h;
    area = mask pixels; segmentation = compressed RLE; ids from 1) and categories. What
    COCO's evaluation compares detections with; ``on_image(image_id, image)`` is called
    with every item's image and returns its ``file_name`` (default ``<image_id>.png``,
    nothing written)."""
    images: list[CocoImage] = []
    annotations: list[CocoAnnotation] = []
    for i in range(len(dataset)):
        image, target = dataset[i]
        name = on_image(int(target["image_id"]), image) if on_image is not None else None
        entry, found = coco_entries(image, target, dataset.category_ids, len(annotations) + 1, name)
        images.append(entry)
        annotations += found
    categories: list[CocoCategory] = [
        {"id": cid, "name": name} for cid, name in zip(dataset.category_ids, dataset.categories, strict=True)
    ]
    return {"images": images, "annotations": annotations, "categories": categories}


def write_coco(dataset: Dataset, folder: str | os.PathLike, split: str) -> CocoFiles:
    """Write every item of ``dataset`` as COCO instances data (:func:`coco_document`),
    local or ``s3://``: ``folder/split/<image_id>.png`` and ``folder/instances_<split>.json``,
    readable by :class:`~.coco.CocoDetection` and ``pycocotools.coco.COCO``.
    """
    folder = str(folder)
    image_root = join_uri(folder, split)

    def write_png(image_id: int, image: torch.Tensor) -> str:
        name = f"{image_id:06d}.png"
        pixels = np.round(image.permute(1, 2, 0).numpy() * 255.0).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        write_bytes(join_uri(image_root, name), buf.getvalue())
        return name

    document = coco_document(dataset, write_png)
    annotation_file = join_uri(folder, f"instances_{split}.json")
    write_bytes(annotation_file, json.dumps(document).encode())
    return CocoFiles(annotation_file, image_root)
