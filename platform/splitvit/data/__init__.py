"""Datasets and loaders. Every dataset is deterministic given its seed.

Items are ``(image, target)`` — ``image`` a float tensor ``(3, H, W)`` in ``[0, 1]``,
``target`` a class index (classification) or a long ``(H, W)`` mask (dense, 255 =
ignore) — optionally followed by extras (``SyntheticObjects`` adds its object mask).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from .synthetic import SyntheticObjects

DATASET_NAMES = ("synthetic",)


def build_dataset(name: str, split: str, *, image_size: int, seed: int = 0, **options: Any) -> Dataset:
    """Build dataset ``name`` for ``split`` (``train``/``val``/``test``).

    Splits of a procedural dataset differ by seed, so they never share images.
    """
    if split not in ("train", "val", "test"):
        raise ValueError(f"data split must be train, val or test, got {split!r}")
    if name == "synthetic":
        split_seed = {"train": 0, "val": 1, "test": 2}[split]
        opts = dict(options)
        samples = opts.pop("num_samples", None) or (opts.pop(f"{split}_samples", None) or 1024)
        opts = {k: v for k, v in opts.items() if not k.endswith("_samples")}
        return SyntheticObjects(samples, image_size=image_size, seed=seed * 1000 + split_seed, **opts)
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)}")
