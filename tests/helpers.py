"""Small helpers shared by test modules."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

#: timm arguments of the tests' tiny ViT: 4-px patches, width 32, 2 blocks.
TINY_TIMM = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)


def tiny_model(policy: str = "learned", **kwargs: Any):
    """A 32-pixel, 3-level SplitViT (coarse 16 px, 8 px, fine 4 px) on a 2-block ViT
    of width 32, built from timm's name (so that it saves with its spec); seeded.
    ``kwargs`` that name a field of the policy's section (``width``,
    ``budget_conditioned``...: :class:`~splitvit.config.PolicyConfig`) go there, its
    ``depth`` 1 unless given; the others to :meth:`SplitViT.from_timm`."""
    import dataclasses

    import torch

    from splitvit.config import PolicyConfig
    from splitvit.model import SplitViT

    torch.manual_seed(0)
    fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    settings = {"depth": 1, **{k: kwargs.pop(k) for k in list(kwargs) if k in fields}}
    return SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=3,
        policy=PolicyConfig(kind=policy, **settings),
        image_size=32,
        num_classes=5,
        timm_kwargs=TINY_TIMM,
        **kwargs,
    )


def walk_numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON-like structure, with its path (``.a.b[2]``); booleans skipped."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk_numbers(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk_numbers(v, f"{path}[{i}]")


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """A script of ``scripts/`` as a module (its ``main`` not run), registered in
    ``sys.modules`` as ``scripts_<stem>`` (its dataclasses need their module there)."""
    module_name = f"scripts_{Path(name).stem}"
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """Write ``array`` (uint8) in the idx format Fashion-MNIST ships in."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)
    if gz:
        path.rename(path.with_name(path.name + ".gz"))


def fake_items(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Item-like 28x28 images: a bright textured blob on black, one shape per class."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    yy, xx = np.mgrid[0:28, 0:28]
    images = np.zeros((n, 28, 28), np.uint8)
    for i, k in enumerate(labels.astype(int)):
        r = 6 + k
        blob = ((yy - 14) ** 2 / r**2 + (xx - 14) ** 2 / (16 - k) ** 2) < 1
        images[i][blob] = rng.integers(120, 256, size=int(blob.sum()))
    return images, labels


def write_fake_fashion_mnist(root: Path, train: int, test: int) -> Path:
    """Fashion-MNIST's four files in ``root`` (made), holding ``train`` and ``test``
    :func:`fake_items` (seeds 1 and 2; its validation slice is the training files' last
    ``val_size`` items)."""
    root.mkdir(parents=True, exist_ok=True)
    for part, (images, labels) in {"train": fake_items(train, seed=1), "t10k": fake_items(test, seed=2)}.items():
        write_idx(root / f"{part}-images-idx3-ubyte", images, gz=False)
        write_idx(root / f"{part}-labels-idx1-ubyte", labels, gz=False)
    return root


def run_cli(argv: list[str]) -> int:
    """``splitvit ARGV`` in this process; the logging handler main() installs (on
    pytest's captured stream of the moment) is removed afterwards."""
    import logging

    from splitvit.cli import main

    root = logging.getLogger()
    before = list(root.handlers)
    try:
        return main(argv)
    finally:
        root.handlers[:] = before
