"""Datasets and loaders. Every dataset is deterministic given its seed.

Items are ``(image, target)`` — ``image`` a float tensor ``(3, H, W)`` in ``[0, 1]``,
``target`` a class index (classification) or a long ``(H, W)`` mask (dense, 255 =
ignore) — optionally followed by extras (``SyntheticObjects`` adds its object mask,
``ClutteredFashionMNIST`` its item mask).

Built in (``DATASET_NAMES``):

- ``synthetic``: procedural glyphs among noise (no files).
- ``cluttered-fashion-mnist`` / ``cluttered-fashion-mnist-seg``: Fashion-MNIST items
  among label-irrelevant, high-entropy clutter (options: ``root``, ``download``,
  ``val_size``, ``clutter_fraction``, ``fragment_prob``, ``margin``, ``item_size``, ...).
  A ``root`` without the files is an error, never a fallback to another copy;
  ``download=true`` downloads into it.
- ``imagefolder``: ``root/{train,val}/CLASS/*.jpg`` (option ``root``).
- ``ade20k``: the ADEChallengeData2016 layout (option ``root``).
- ``parquet``: shards written by ``write_shards`` / ``splitvit data prepare``, in a
  folder or ``s3://`` prefix (option ``uri`` or ``root``); detection shards (from
  ``coco`` or ``fashion-det``) give their source's items and COCO ground truth.
- ``fashion-det``: detection canvases of 2-6 Fashion-MNIST items, with or without
  clutter (``FashionDetection``; options: its keyword arguments, ``root``,
  ``download``, ``val_size``).
- ``coco``: COCO instances files and their images, local or ``s3://``
  (``CocoDetection``; options ``<split>_annotations``, ``<split>_images``); images
  of another size are letterboxed onto the ``image_size`` square.

Detection items are ``(image, target dict)`` with boxes, labels 1..K, masks,
iscrowd, area, image_id; ``detection_collate`` batches them (images stacked, targets
a list). ``CocoDetection`` checks its file up front (``load_coco_index``);
``write_coco`` writes any detection set in COCO's format.

File-backed datasets take ``strict`` (raise on a corrupt file instead of skipping
and counting it) and ``verify`` (decode everything up front, dropping corrupt items).
Every dataset takes ``num_samples`` / ``<split>_samples`` (length, or a limit for
file-backed data).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name loads its module on first use: the names (``splitvit.data.names``) are read
# by checks that run before torch loads, and the datasets need torch.
_WHERE = {
    "ADE20KDataset": "folders",
    "Canvas": "cluttered",
    "ClutteredFashionMNIST": "cluttered",
    "ClutteredFashionMNISTSeg": "cluttered",
    "CocoDetection": "coco",
    "CocoFormatError": "coco",
    "CorruptDataError": "common",
    "DATASET_NAMES": "names",
    "FashionDetection": "fashion_det",
    "FashionMNISTNotFound": "fashion_mnist",
    "ImageFolderDataset": "folders",
    "ParquetShards": "parquet",
    "ShardWriteResult": "shards",
    "SkippingDataset": "common",
    "SyntheticObjects": "synthetic",
    "build_dataset": "registry",
    "fashion_mnist_split": "cluttered",
    "detection_collate": "common",
    "find_fashion_mnist": "fashion_mnist",
    "first_images": "common",
    "load_coco_index": "coco",
    "load_fashion_mnist": "fashion_mnist",
    "write_coco": "fashion_det",
    "write_shards": "shards",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
