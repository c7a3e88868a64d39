"""Finding and reading Fashion-MNIST's idx files, offline first.

With ``root`` (an option) only ``root`` is searched: a ``root`` that does not exist
or lacks the files is an error, never a reason to read another copy; with
``download=True`` the files are downloaded into it. Without ``root`` the search
order is: the folder in ``$SPLITVIT_DATA_DIR``, Debian's ``dataset-fashion-mnist``
package (``/usr/share/datasets/fashion-mnist``), an earlier download in
``~/.cache/splitvit``, then (unless ``download=False``) a download with
torchvision where the internet is reachable (into ``$SPLITVIT_DATA_DIR`` or
``~/.cache/splitvit``). Each folder may hold the files directly, in
``fashion-mnist/`` or in torchvision's ``FashionMNIST/raw/``; files may be
gzipped. The folder used is logged (INFO).
"""

from __future__ import annotations

import functools
import gzip
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

log = logging.getLogger(__name__)

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
DATA_DIR_ENV = "SPLITVIT_DATA_DIR"
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
PARTS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
ITEM_SIZE = 28


class FashionMNISTNotFound(FileNotFoundError):
    """Fashion-MNIST is in none of the searched places and could not be downloaded."""


def _file(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _complete(folder: Path) -> bool:
    return all(_file(folder, stem) for pair in PARTS.values() for stem in pair)


def candidate_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Folders searched for the idx files, in order (with ``root``: in ``root`` only)."""
    if root:
        base = Path(root).expanduser()
        return [base, base / "fashion-mnist", base / "FashionMNIST" / "raw"]
    bases = [Path(b).expanduser() for b in (os.environ.get(DATA_DIR_ENV),) if b]
    dirs = [d for b in bases for d in (b, b / "fashion-mnist", b / "FashionMNIST" / "raw")]
    dirs.append(DEBIAN_DIR)
    dirs.append(_download_dir(None) / "FashionMNIST" / "raw")  # where an earlier download without root went
    return dirs


def _download_dir(root: str | os.PathLike | None) -> Path:
    base = root or os.environ.get(DATA_DIR_ENV) or Path.home() / ".cache" / "splitvit"
    return Path(base).expanduser()


def download_fashion_mnist(dest: str | os.PathLike) -> Path:
    """Download with torchvision into ``dest``; returns the folder holding the files.

    Checks first, with a short timeout, that a mirror answers, so an offline machine
    fails in seconds rather than after torchvision's retries.
    """
    from torchvision.datasets import FashionMNIST

    host = urlparse(FashionMNIST.mirrors[0]).hostname or ""
    try:
        socket.create_connection((host, 80), timeout=3).close()
    except OSError as exc:
        raise OSError(f"{host} is not reachable ({exc})") from None
    FashionMNIST(str(dest), train=True, download=True)
    FashionMNIST(str(dest), train=False, download=True)
    return Path(dest) / "FashionMNIST" / "raw"


def find_fashion_mnist(root: str | os.PathLike | None = None, *, download: bool | None = None) -> Path:
    """The folder holding all four Fashion-MNIST idx files (see the module doc for the order).

    ``download``: ``None`` (default) downloads when no ``root`` is given and never
    into a ``root``; ``True`` downloads into ``root`` too; ``False`` never downloads.
    Raises ``FashionMNISTNotFound`` with one message that lists the places searched
    and how to get the data.
    """
    searched = candidate_dirs(root)
    env = os.environ.get(DATA_DIR_ENV)
    for i, folder in enumerate(searched):
        if folder.is_dir() and _complete(folder):
            if not root and env and i >= 3:  # not in $SPLITVIT_DATA_DIR: say so, loudly
                log.warning(
                    "Fashion-MNIST: $%s=%s does not hold the idx files; using the files in %s",
                    DATA_DIR_ENV,
                    env,
                    folder,
                )
            else:
                log.info("Fashion-MNIST: using the files in %s", folder)
            return folder
    if root and not download:
        base = Path(root).expanduser()
        state = (
            "does not exist"
            if not base.exists()
            else ("is not a folder" if not base.is_dir() else "does not hold all four idx files")
        )
        raise FashionMNISTNotFound(
            f"root={root} {state} (searched {', '.join(str(d) for d in searched)} for train-images-idx3-ubyte"
            "[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]); put the "
            "files there, set download=true to download them into it, or leave root unset to use "
            f"${DATA_DIR_ENV} or Debian's copy in {DEBIAN_DIR} (`sudo apt-get install dataset-fashion-mnist`)"
        )
    why = "download disabled (download=False)"
    if download is None or download:  # None: no root here
        dest = _download_dir(root)
        try:
            folder = download_fashion_mnist(dest)
            if _complete(folder):
                log.info("Fashion-MNIST: downloaded into %s", folder)
                return folder
            why = f"download into {dest} left incomplete files"
        except Exception as exc:  # noqa: BLE001 - any failure means: tell the user how to get the data
            why = f"download into {dest} failed: {exc}"
    raise FashionMNISTNotFound(
        "Fashion-MNIST idx files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
        "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]) not found in: "
        + ", ".join(str(d) for d in searched)
        + f"; {why}. Get them with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu, installs "
        f"{DEBIAN_DIR}), or put the files in a folder and pass root=FOLDER (or set ${DATA_DIR_ENV})."
    )


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an idx file (optionally gzipped) into a uint8 array; a ValueError naming the file if malformed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot read idx file: {exc}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (bad magic {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape)):
        raise ValueError(f"{path}: idx size {len(data) - header} does not match its shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


@functools.lru_cache(maxsize=4)
def _load(folder: str, part: str) -> tuple[np.ndarray, np.ndarray]:
    images_stem, labels_stem = PARTS[part]
    images = read_idx(_file(Path(folder), images_stem))
    labels = read_idx(_file(Path(folder), labels_stem)).astype(np.int64)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{folder}: {part} images {images.shape} and labels {labels.shape} do not match")
    return images, labels


def load_fashion_mnist(
    part: str, root: str | os.PathLike | None = None, *, download: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels int64 (N,))`` of ``part`` (``"train"`` or ``"t10k"``).

    Cached per process, so every dataset built on the same files shares one copy.
    """
    if part not in PARTS:
        raise ValueError(f"Fashion-MNIST part must be 'train' or 't10k', got {part!r}")
    return _load(str(find_fashion_mnist(root, download=download)), part)
