"""Shared pieces of the file-backed datasets: image decoding, resizing, and the
skip-and-count policy for corrupt files."""

from __future__ import annotations

import io
import logging
import multiprocessing
import re
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff")


_MESSAGE = re.compile(r"corrupt or unreadable data in (?P<source>.+?): (?P<reason>.*)")


class CorruptDataError(ValueError):
    """A file (image or shard) could not be read; ``source`` names it.

    ``deterministic`` (the flag :func:`splitvit.errors.is_deterministic` reads; this
    package may not import that module): reading it again would fail the same way (a
    file that does not decode, is missing or unreadable), so training does not retry
    (``strict=true``). False for an I/O error that may pass (a disk or network hiccup).
    """

    def __init__(self, source: str, reason: str | None = None, *, deterministic: bool = True) -> None:
        if reason is None:
            # one argument: torch's DataLoader re-raising a loader worker's error passes
            # the worker's traceback; its last line is the original message
            source, reason = _parse_message(source)
        super().__init__(f"corrupt or unreadable data in {source}: {reason}")
        self.source = source
        self.reason = reason
        self.deterministic = deterministic

    def __reduce__(self):  # Ray pickles a worker's exception: rebuild from source and reason
        return (type(self), (self.source, self.reason), dict(self.__dict__))


def _parse_message(text: str) -> tuple[str, str]:
    """``(source, reason)`` from the last line of a message or traceback holding
    CorruptDataError's message; ``("data", text)`` when none does."""
    for line in reversed(text.strip().splitlines()):
        match = _MESSAGE.search(line)
        if match:
            return match.group("source"), match.group("reason")
    return "data", text.strip()


def decode_image(data: bytes, source: str, mode: str = "RGB", *, min_size: int | None = None) -> Image.Image:
    """Decode PNG/JPEG/... bytes fully (so truncation shows here, not later) into ``mode``
    (``""`` keeps the file's own mode).

    ``min_size``: a JPEG may be decoded at a reduced scale whose sides stay at least
    this large (libjpeg's DCT scaling), which makes large photos far cheaper to load.
    """
    try:
        img = Image.open(io.BytesIO(data))
        if min_size and img.format == "JPEG":
            img.draft("RGB", (min_size, min_size))
        img.load()
        return img.convert(mode) if mode and img.mode != mode else img
    except UnidentifiedImageError:
        raise CorruptDataError(source, "not a recognised image format") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptDataError(source, f"{type(exc).__name__}: {exc}") from None


def read_file(path: str) -> bytes:
    """A local file's bytes; an unreadable file raises ``CorruptDataError`` naming it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        # a missing or forbidden file stays so on a retry; other I/O errors may pass
        lasting = isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError))
        raise CorruptDataError(path, str(exc), deterministic=lasting) from None


def read_image_file(path: str, mode: str = "RGB", *, min_size: int | None = None) -> Image.Image:
    """Read and decode a local image file; a missing or bad file raises ``CorruptDataError``."""
    return decode_image(read_file(path), path, mode, min_size=min_size)


def decode_mask(data: bytes, source: str) -> Image.Image:
    """Decode a class-index mask PNG into mode ``L`` keeping the raw indices.

    Palette (``P``) masks keep their indices (converting them would map colours to
    grey levels); 16-bit masks must hold values below 256.
    """
    img = decode_image(data, source, mode="")
    if img.mode in ("L", "P"):
        return Image.fromarray(np.asarray(img, dtype=np.uint8), mode="L")
    if img.mode in ("I", "I;16", "I;16B", "I;16L"):
        arr = np.asarray(img)
        if arr.min() < 0 or arr.max() > 255:
            raise CorruptDataError(source, f"mask values {arr.min()}..{arr.max()} do not fit 0..255")
        return Image.fromarray(arr.astype(np.uint8), mode="L")
    if img.mode == "1":
        return img.convert("L").point(lambda v: 1 if v else 0)
    raise CorruptDataError(source, f"mask has mode {img.mode}; expected a single-channel class-index PNG")


#: Image resizing filters by the names timm's data configs use (``interpolation``).
RESAMPLING = {
    "nearest": Image.NEAREST,
    "bilinear": Image.BILINEAR,
    "bicubic": Image.BICUBIC,
    "lanczos": Image.LANCZOS,
    "box": Image.BOX,
    "hamming": Image.HAMMING,
}


def pil_resample(interpolation: str) -> int:
    """PIL's filter for a timm ``interpolation`` name (``bicubic``, ``bilinear``...)."""
    if interpolation not in RESAMPLING:
        raise ValueError(f"interpolation must be one of {', '.join(RESAMPLING)}, got {interpolation!r}")
    return RESAMPLING[interpolation]


def fit_square(img: Image.Image, size: int, resample: int) -> Image.Image:
    """Centre-crop to a square and resize to ``size`` (no aspect distortion)."""
    if img.size == (size, size):
        return img
    return ImageOps.fit(img, (size, size), method=resample)


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float tensor ``(3, H, W)`` in ``[0, 1]``.

    ``[0, 1]`` is the data contract of every dataset: the model normalises its own
    inputs with its timm data config (``SplitViT.normalize``), so datasets, split maps
    and the entropy policy all work on plain pixels."""
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def mask_to_tensor(img: Image.Image) -> torch.Tensor:
    """Single-channel PIL mask -> long tensor ``(H, W)``."""
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).astype(np.int64))


def first_images(dataset: Dataset, count: int) -> torch.Tensor:
    """The images of the first ``count`` items of ``dataset``, stacked (all, if fewer).

    Read in this process: ``next(iter(loader))`` on a loader with worker processes
    starts them, takes one batch and abandons them, and their shutdown costs seconds.
    """
    count = min(count, len(dataset))
    if count < 1:
        raise ValueError(f"no images to take: the dataset has {len(dataset)} items")
    return torch.stack([dataset[i][0] for i in range(count)])


def detection_collate(
    batch: list[tuple[torch.Tensor, dict[str, torch.Tensor]]],
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """A detection batch for a ``DataLoader`` (``collate_fn``): the images stacked
    ``(B, 3, H, W)`` (one canvas size), the targets a list of their dicts as they are
    (each image has its own number of objects).

    Raises ``ValueError`` naming the sizes when the images differ in size.
    """
    images = [image for image, _ in batch]
    sizes = sorted({tuple(image.shape) for image in images})
    if len(sizes) > 1:
        raise ValueError(f"a detection batch needs images of one size, got {', '.join(map(str, sizes))}")
    return torch.stack(images), [target for _, target in batch]


class SkipCounter:
    """How many items were passed over for being corrupt, counted across the
    DataLoader processes this one starts (forked ones inherit the shared count,
    spawned ones are handed it as they start); a plain pickle gets a count of its own."""

    def __init__(self) -> None:
        self._shared = multiprocessing.Value("q", 0)

    def add(self, n: int = 1) -> None:
        with self._shared.get_lock():
            self._shared.value += n

    @property
    def value(self) -> int:
        """The count so far."""
        return int(self._shared.value)

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        # shared memory travels only to a process being started (multiprocessing refuses otherwise)
        return {"shared": self._shared if get_spawning_popen() is not None else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shared = state["shared"] if state["shared"] is not None else multiprocessing.Value("q", 0)


class SkippingDataset(Dataset):
    """Base of the file-backed datasets: corrupt items are skipped and counted.

    Subclasses implement ``raw_len()`` and ``load_raw(i)``, which raises
    ``CorruptDataError`` for an unreadable item. ``dataset[i]`` then returns item
    ``i`` or, when it is corrupt, the next readable one (deterministically), logs a
    warning naming the file once and counts it in ``skipped`` / ``skipped_files``;
    with ``strict=True`` the error propagates instead.

    The files are counted per process: inside DataLoader workers each worker counts
    its own. ``skips`` counts every item asked for that was corrupt (again in each
    later epoch) across this process and its DataLoader workers: training reads
    it before and after each epoch and reports the difference (``train_skipped``).
    ``verify()`` decodes everything up front in this process, drops corrupt items
    from the index and so gives an exact count before training.
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.skipped_files: list[str] = []
        self.skips = SkipCounter()
        self._bad_raw: set[int] = set()
        self._keep: np.ndarray | None = None

    # subclasses -------------------------------------------------------------
    def raw_len(self) -> int:
        raise NotImplementedError

    def load_raw(self, raw_index: int) -> tuple[Any, ...]:
        raise NotImplementedError

    # policy -----------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Number of distinct corrupt files (images or shards) met in this process."""
        return len(self.skipped_files)

    def record_corrupt(self, exc: CorruptDataError) -> None:
        """Count ``exc.source`` once and log a warning naming it (or raise when strict)."""
        if self.strict:
            raise exc
        if exc.source not in self.skipped_files:
            self.skipped_files.append(exc.source)
            log.warning("skipping %s (%d corrupt so far)", exc, len(self.skipped_files))

    def __len__(self) -> int:
        return int(len(self._keep)) if self._keep is not None else self.raw_len()

    def _raw_index(self, index: int) -> int:
        return int(self._keep[index]) if self._keep is not None else index

    def load_item(self, index: int) -> tuple[Any, ...]:
        """Item ``index`` or ``CorruptDataError``: no substitution (used when writing shards)."""
        return self.load_raw(self._raw_index(index))

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} items")
        index %= n
        for offset in range(n):
            raw = self._raw_index((index + offset) % n)
            if raw in self._bad_raw:
                continue
            try:
                item = self.load_raw(raw)
            except CorruptDataError as exc:
                self._bad_raw.add(raw)
                self.record_corrupt(exc)
                continue
            if offset:  # item `index` was corrupt: another took its place
                self.skips.add()
            return item
        raise RuntimeError(
            f"every one of the {n} items of {type(self).__name__} is corrupt; first: {self.skipped_files[:1]}"
        )

    def verify(self) -> int:
        """Decode every item now, drop the corrupt ones from the index; returns how many were dropped."""
        keep = []
        dropped = 0
        for i in range(len(self)):
            raw = self._raw_index(i)
            try:
                self.load_raw(raw)
                keep.append(raw)
            except CorruptDataError as exc:
                self.record_corrupt(exc)
                self._bad_raw.add(raw)
                dropped += 1
        self._keep = np.asarray(keep, dtype=np.int64)
        return dropped
