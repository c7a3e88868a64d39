"""The dataset registry: :func:`build_dataset` builds a built-in dataset
(:data:`~splitvit.data.names.DATASET_NAMES`) for a split, by name and options."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .cluttered import ClutteredFashionMNIST, ClutteredFashionMNISTSeg, fashion_mnist_split
from .coco import CocoDetection
from .common import SkippingDataset, pil_resample
from .fashion_det import FashionDetection
from .folders import ADE20KDataset, ImageFolderDataset
from .names import DATASET_NAMES
from .parquet import ParquetShards
from .synthetic import SyntheticObjects

_SPLIT_SEED = {"train": 0, "val": 1, "test": 2}
#: The options that find Fashion-MNIST's files and cut its val split (every dataset drawn from it).
_FASHION_MNIST_OPTIONS = {"root", "download", "val_size"}


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


def _fashion_mnist_pool(opts: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's images and labels of ``split``, found as ``opts`` say (its
    :data:`_FASHION_MNIST_OPTIONS` popped from them)."""
    # download: None = only without root (a root that lacks the files is an error, not a fallback)
    root, download = opts.pop("root", None), opts.pop("download", None)
    download = None if download is None else bool(download)
    return fashion_mnist_split(split, root, val_size=int(opts.pop("val_size", 5000)), download=download)


def _coco(opts: dict[str, Any], split: str, image_size: int, interpolation: str) -> CocoDetection:
    """COCO instances of ``split`` from its ``<split>_annotations`` file and ``<split>_images``
    folder, letterboxed onto the ``image_size`` canvas."""
    paths = {}
    for kind, what in (("annotations", "FILE"), ("images", "FOLDER")):
        key = f"{split}_{kind}"
        if not opts.get(key):
            raise ValueError(f"dataset 'coco' needs option {key}={what} for the {split} split")
        paths[kind] = str(opts[key])
    return CocoDetection(
        paths["annotations"],
        paths["images"],
        image_size=image_size,
        interpolation=interpolation,
        strict=bool(opts.get("strict", False)),
    )


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
    procedural ones draw at ``image_size`` and need none. ``coco`` letterboxes its images
    onto the ``image_size`` square, boxes and masks with them.

    Splits of a procedural dataset differ by seed, so they never share images;
    Fashion-MNIST's val split is a fixed held-out slice of its train files. Raises
    ``ValueError`` for an unknown name, split or option (or a missing one: ``coco``
    needs ``<split>_annotations`` and ``<split>_images``), ``FileNotFoundError`` (with
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
    if name in ("cluttered-fashion-mnist", "cluttered-fashion-mnist-seg", "fashion-det"):
        cls = {
            "cluttered-fashion-mnist": ClutteredFashionMNIST,
            "cluttered-fashion-mnist-seg": ClutteredFashionMNISTSeg,
            "fashion-det": FashionDetection,
        }[name]
        allowed = (_kwargs_of(cls) - {"image_size", "num_samples", "seed"}) | _FASHION_MNIST_OPTIONS
        _check_options(name, opts, allowed)
        images, labels = _fashion_mnist_pool(opts, split)
        return cls(images, labels, image_size=image_size, num_samples=samples, seed=split_seed, **opts)
    if name == "coco":
        splits = [f"{s}_{kind}" for s in _SPLIT_SEED for kind in ("annotations", "images")]
        _check_options(name, opts, {*splits, "strict", "verify"})
        return _file_backed(_coco(opts, split, image_size, interpolation), samples, bool(opts.get("verify", False)))
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
