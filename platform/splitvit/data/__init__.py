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
  folder or ``s3://`` prefix (option ``uri`` or ``root``).

File-backed datasets take ``strict`` (raise on a corrupt file instead of skipping
and counting it) and ``verify`` (decode everything up front, dropping corrupt items).
Every dataset takes ``num_samples`` / ``<split>_samples`` (length, or a limit for
file-backed data).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .cluttered import Canvas, ClutteredFashionMNIST, ClutteredFashionMNISTSeg, fashion_mnist_split
from .common import CorruptDataError, SkippingDataset, first_images, pil_resample
from .fashion_mnist import FashionMNISTNotFound, find_fashion_mnist, load_fashion_mnist
from .folders import ADE20KDataset, ImageFolderDataset
from .parquet import ParquetShards
from .shards import ShardWriteResult, write_shards
from .synthetic import SyntheticObjects

DATASET_NAMES = (
    "synthetic",
    "cluttered-fashion-mnist",
    "cluttered-fashion-mnist-seg",
    "imagefolder",
    "ade20k",
    "parquet",
)

__all__ = [
    "ADE20KDataset",
    "Canvas",
    "ClutteredFashionMNIST",
    "ClutteredFashionMNISTSeg",
    "CorruptDataError",
    "DATASET_NAMES",
    "FashionMNISTNotFound",
    "ImageFolderDataset",
    "ParquetShards",
    "ShardWriteResult",
    "SkippingDataset",
    "SyntheticObjects",
    "build_dataset",
    "fashion_mnist_split",
    "find_fashion_mnist",
    "first_images",
    "load_fashion_mnist",
    "write_shards",
]

_SPLIT_SEED = {"train": 0, "val": 1, "test": 2}


def _take_samples(opts: dict[str, Any], split: str) -> int | None:
    """Pop ``num_samples`` / ``<split>_samples``; other splits' ``*_samples`` are dropped."""
    samples = opts.pop("num_samples", None) or opts.pop(f"{split}_samples", None)
    for key in [k for k in opts if k.endswith("_samples")]:
        del opts[key]
    return int(samples) if samples else None


def _check_options(name: str, opts: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(opts) - allowed)
    if unknown:
        raise ValueError(
            f"dataset {name!r}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}"
        )


def _kwargs_of(cls: type) -> set[str]:
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "images", "labels")}


def _file_backed(ds: SkippingDataset, samples: int | None, verify: bool) -> SkippingDataset:
    if samples is not None:
        ds._keep = np.arange(min(samples, ds.raw_len()), dtype=np.int64)
    if verify:
        ds.verify()
    return ds


def build_dataset(
    name: str, split: str, *, image_size: int, seed: int = 0, interpolation: str = "bicubic", **options: Any
) -> Dataset:
    """Build dataset ``name`` for ``split`` (``train``/``val``/``test``).

    ``interpolation`` (timm's name, the model's ``data_config["interpolation"]``)
    resizes the images of file-backed datasets (imagefolder, ade20k, parquet);
    procedural ones draw at ``image_size`` and need none.

    Splits of a procedural dataset differ by seed, so they never share images;
    Fashion-MNIST's val split is a fixed held-out slice of its train files. Raises
    ``ValueError`` for an unknown name, split or option, ``FileNotFoundError`` (with
    how to get the data) for missing files.
    """
    if split not in ("train", "val", "test"):
        raise ValueError(f"data split must be train, val or test, got {split!r}")
    pil_resample(interpolation)  # an unknown name fails here, for every dataset
    opts = dict(options)
    samples = _take_samples(opts, split)
    split_seed = seed * 1000 + _SPLIT_SEED[split]
    if name == "synthetic":
        return SyntheticObjects(samples or 1024, image_size=image_size, seed=split_seed, **opts)
    if name in ("cluttered-fashion-mnist", "cluttered-fashion-mnist-seg"):
        cls = ClutteredFashionMNIST if name == "cluttered-fashion-mnist" else ClutteredFashionMNISTSeg
        allowed = (_kwargs_of(cls) - {"image_size", "num_samples", "seed"}) | {"root", "download", "val_size"}
        _check_options(name, opts, allowed)
        # download: None = only without root (a root that lacks the files is an error, not a fallback)
        root, download = opts.pop("root", None), opts.pop("download", None)
        download = None if download is None else bool(download)
        images, labels = fashion_mnist_split(split, root, val_size=int(opts.pop("val_size", 5000)), download=download)
        return cls(images, labels, image_size=image_size, num_samples=samples, seed=split_seed, **opts)
    if name in ("imagefolder", "ade20k"):
        _check_options(name, opts, {"root", "strict", "verify"})
        if not opts.get("root"):
            raise ValueError(f"dataset {name!r} needs option root=FOLDER")
        cls = ImageFolderDataset if name == "imagefolder" else ADE20KDataset
        ds = cls(
            opts["root"],
            split,
            image_size=image_size,
            strict=bool(opts.get("strict", False)),
            interpolation=interpolation,
        )
        return _file_backed(ds, samples, bool(opts.get("verify", False)))
    if name == "parquet":
        _check_options(name, opts, {"uri", "root", "strict", "verify", "cache_row_groups"})
        uri = opts.get("uri") or opts.get("root")
        if not uri:
            raise ValueError("dataset 'parquet' needs option uri=FOLDER_OR_S3_URI (or root=)")
        ds = ParquetShards(
            str(uri),
            split,
            image_size=image_size,
            strict=bool(opts.get("strict", False)),
            cache_row_groups=int(opts.get("cache_row_groups", 4)),
            interpolation=interpolation,
        )
        return _file_backed(ds, samples, bool(opts.get("verify", False)))
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)}")
