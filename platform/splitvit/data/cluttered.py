"""Cluttered Fashion-MNIST: real items on a larger canvas among label-irrelevant clutter.

The clutter is high in pixel entropy (noise textures, some overlaid with fragments
of *other* Fashion-MNIST items) and covers a set share of the canvas, while the
item sits on a flat background with the clutter kept a margin away from it. Pixel
statistics therefore point at the clutter, the label at the item: the case where a
learned split policy should beat entropy splitting.

Everything about canvas ``i`` (placement, colours, clutter) depends only on
``(seed, i)``. Rendering costs about as much as a small ViT's training step, so
``cache_dir`` renders every canvas once, as 8-bit arrays on disk shared by every
process (and epoch, trial, run) that asks for the same canvases.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .fashion_mnist import CLASSES, ITEM_SIZE, load_fashion_mnist

DEFAULT_VAL_SIZE = 5000

log = logging.getLogger(__name__)


def fashion_mnist_split(
    split: str, root: str | os.PathLike | None = None, *, val_size: int = DEFAULT_VAL_SIZE, download: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of ``split``: train = the train files minus their last ``val_size``
    items, val = those last ``val_size`` items (a fixed held-out slice), test = t10k."""
    if split == "test":
        return load_fashion_mnist("t10k", root, download=download)
    images, labels = load_fashion_mnist("train", root, download=download)
    if not 0 < val_size < len(images):
        raise ValueError(f"val_size must be in (0, {len(images)}), got {val_size}")
    cut = len(images) - val_size
    if split == "train":
        return images[:cut], labels[:cut]
    if split == "val":
        return images[cut:], labels[cut:]
    raise ValueError(f"data split must be train, val or test, got {split!r}")


@dataclass
class Canvas:
    """One rendered canvas with everything a test or a figure may want to inspect."""

    image: np.ndarray  # (3, H, W) float32 in [0, 1]
    labels: list[int]  # the class of each placed item
    boxes: list[tuple[int, int, int, int]]  # (y, x, h, w) of each item's tile
    item_masks: np.ndarray  # (n_items, H, W) bool: each item's silhouette
    clutter_mask: np.ndarray  # (H, W) bool
    background: np.ndarray  # (3,) the flat background colour


class _ClutterRenderer:
    """Shared canvas rendering of both the classification and the segmentation variant."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        image_size: int,
        item_size: int,
        clutter_fraction: float,
        fragment_prob: float,
        margin: int,
        mask_threshold: float,
        max_items: int,
        seed: int,
    ) -> None:
        if images.ndim != 3 or len(images) != len(labels) or len(images) < 2:
            raise ValueError(
                f"need at least two items as (N, h, w) images with N labels, got {images.shape} and {labels.shape}"
            )
        if not 0.0 <= clutter_fraction < 1.0:
            raise ValueError(f"clutter_fraction must be in [0, 1), got {clutter_fraction}")
        if not 0.0 <= fragment_prob <= 1.0:
            raise ValueError(f"fragment_prob must be in [0, 1], got {fragment_prob}")
        tile = item_size + 2 * margin
        if image_size < tile:
            raise ValueError(
                f"image_size {image_size} is smaller than an item ({item_size}) plus its margin ({margin})"
            )
        # The clutter target must fit next to the items, else coverage could not be met.
        free = image_size * image_size - max_items * tile * tile
        if free < clutter_fraction * image_size * image_size:
            raise ValueError(
                f"clutter_fraction {clutter_fraction} of a {image_size}x{image_size} canvas does not fit beside "
                f"{max_items} item(s) of {item_size}px (+{margin}px margin); use a larger image_size or fewer items"
            )
        self.images = images
        self.labels = labels.astype(np.int64)
        self.image_size = image_size
        self.item_size = item_size
        self.clutter_fraction = clutter_fraction
        self.fragment_prob = fragment_prob
        self.margin = margin
        self.mask_threshold = mask_threshold
        self.seed = seed

    def render(self, index: int, item_indices: list[int], rng: np.random.Generator) -> Canvas:
        size, it, margin = self.image_size, self.item_size, self.margin
        background = rng.uniform(0.0, 0.25, size=3).astype(np.float32)
        image = np.broadcast_to(background[:, None, None], (3, size, size)).copy()
        keepout = np.zeros((size, size), dtype=bool)
        boxes, labels, masks = [], [], []
        for j in item_indices:
            corner = place_tile(keepout, it, margin, rng)
            if corner is None:
                continue
            oy, ox = corner
            keepout[tile_with_margin(oy, ox, it, margin)] = True
            alpha = item_intensity(self.images[j], it)
            paint_item(image, background, alpha, oy, ox, rng)
            mask = np.zeros((size, size), dtype=bool)
            mask[oy : oy + it, ox : ox + it] = alpha > self.mask_threshold
            boxes.append((oy, ox, it, it))
            labels.append(int(self.labels[j]))
            masks.append(mask)
        clutter = paint_clutter(
            image,
            keepout,
            rng,
            pool=self.images,
            exclude=set(item_indices),
            fragment_item_size=it,
            clutter_fraction=self.clutter_fraction,
            fragment_prob=self.fragment_prob,
        )
        return Canvas(
            image=image,
            labels=labels,
            boxes=boxes,
            item_masks=np.stack(masks) if masks else np.zeros((0, size, size), bool),
            clutter_mask=clutter,
            background=background,
        )


def item_intensity(item: np.ndarray, size: int) -> np.ndarray:
    """A Fashion-MNIST item (uint8 ``(28, 28)``) as intensities in [0, 1], resized (bilinear) to ``size``."""
    if item.shape != (size, size):
        item = np.asarray(Image.fromarray(item).resize((size, size), Image.BILINEAR))
    return item.astype(np.float32) / 255.0


def tile_with_margin(oy: int, ox: int, side: int, margin: int) -> tuple[slice, slice]:
    """The canvas rows and columns of a ``side`` tile at ``(oy, ox)`` grown by ``margin`` (clipped at 0)."""
    return slice(max(oy - margin, 0), oy + side + margin), slice(max(ox - margin, 0), ox + side + margin)


def place_tile(
    keepout: np.ndarray, side: int, margin: int, rng: np.random.Generator, *, tries: int = 64
) -> tuple[int, int] | None:
    """Top-left corner of a ``side`` tile on the square canvas of ``keepout`` whose margin-grown
    area misses ``keepout`` (rejection sampling, so tiles with margins never overlap); None
    when ``tries`` draws found none. ``keepout`` is not marked: the caller does."""
    size = keepout.shape[0]
    for _ in range(tries):
        oy, ox = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        if not keepout[tile_with_margin(oy, ox, side, margin)].any():
            return oy, ox
    return None


def paint_item(
    image: np.ndarray, background: np.ndarray, alpha: np.ndarray, oy: int, ox: int, rng: np.random.Generator
) -> None:
    """Paint an item (``alpha``, intensities in [0, 1]) in a random bright colour over the flat
    ``background`` of ``image`` (``(3, S, S)``, in place) with its top-left corner at ``(oy, ox)``."""
    h, w = alpha.shape
    fg = rng.uniform(0.75, 1.0, size=3).astype(np.float32)
    image[:, oy : oy + h, ox : ox + w] = background[:, None, None] + alpha[None] * (fg - background)[:, None, None]


def clutter_texture(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A ``(3, h, w)`` high-entropy texture: colour noise, tinted grey noise or two-colour salt and pepper."""
    kind = rng.integers(3)
    if kind == 0:  # per-pixel colour noise
        return rng.uniform(0, 1, size=(3, h, w)).astype(np.float32)
    if kind == 1:  # grey noise in a random tint
        tint = rng.uniform(0.4, 1.0, size=3).astype(np.float32)
        return rng.uniform(0, 1, size=(1, h, w)).astype(np.float32) * tint[:, None, None]
    a, b = rng.uniform(0, 1, size=(2, 3)).astype(np.float32)  # 1-pixel salt and pepper in two colours
    pick = rng.random((h, w)) < 0.5
    return np.where(pick[None], a[:, None, None], b[:, None, None]).astype(np.float32)


def item_fragment(
    pool: np.ndarray,
    h: int,
    w: int,
    exclude: set[int],
    rng: np.random.Generator,
    *,
    item_size: int,
    max_side: int | None = None,
) -> np.ndarray:
    """A random crop of an item of ``pool`` not in ``exclude`` (at ``item_size``, rotated/flipped),
    at most ``max_side`` on a side (default: the whole item may show), placed in an ``(h, w)`` alpha map."""
    j = int(rng.integers(len(pool)))
    while j in exclude and len(exclude) < len(pool):
        j = int(rng.integers(len(pool)))
    alpha = np.rot90(item_intensity(pool[j], item_size), k=int(rng.integers(4)))
    if rng.random() < 0.5:
        alpha = alpha[:, ::-1]
    side = alpha.shape[0] if max_side is None else min(max_side, alpha.shape[0])
    fh, fw = min(h, side), min(w, side)
    cy, cx = rng.integers(0, alpha.shape[0] - fh + 1), rng.integers(0, alpha.shape[1] - fw + 1)
    out = np.zeros((h, w), dtype=np.float32)
    py, px = rng.integers(0, h - fh + 1), rng.integers(0, w - fw + 1)
    out[py : py + fh, px : px + fw] = alpha[cy : cy + fh, cx : cx + fw]
    return out


def paint_clutter(
    image: np.ndarray,
    keepout: np.ndarray,
    rng: np.random.Generator,
    *,
    pool: np.ndarray,
    exclude: set[int],
    fragment_item_size: int,
    clutter_fraction: float,
    fragment_prob: float,
    fragment_max_side: int | None = None,
) -> np.ndarray:
    """Paint label-irrelevant clutter into ``image`` (``(3, S, S)``, in place) outside ``keepout``
    until it covers ``clutter_fraction`` of the canvas; returns the clutter mask ``(S, S)`` bool.

    Clutter is rectangles of :func:`clutter_texture`, with chance ``fragment_prob`` overlaid
    by an :func:`item_fragment` of an item of ``pool`` not in ``exclude``.
    """
    size = image.shape[-1]
    clutter = np.zeros((size, size), dtype=bool)
    target = int(np.ceil(clutter_fraction * size * size))
    lo, hi = max(size // 8, 4), max(size // 3, 5)
    covered = 0
    for _ in range(256):
        if covered >= target:
            break
        h, w = (int(v) for v in rng.integers(lo, hi + 1, size=2))
        y, x = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        region = ~keepout[y : y + h, x : x + w]
        if not region.any():
            continue
        texture = clutter_texture(h, w, rng)
        if rng.random() < fragment_prob:
            alpha = item_fragment(pool, h, w, exclude, rng, item_size=fragment_item_size, max_side=fragment_max_side)
            colour = rng.uniform(0.6, 1.0, size=3).astype(np.float32)
            texture = texture * (1 - alpha[None]) + alpha[None] * colour[:, None, None]
        patch = image[:, y : y + h, x : x + w]
        patch[:, region] = texture[:, region]
        covered += int((region & ~clutter[y : y + h, x : x + w]).sum())
        clutter[y : y + h, x : x + w] |= region
    missing = target - covered
    if missing > 0:  # rare: rectangles kept landing on the items; finish with scattered noise pixels
        free = np.flatnonzero(~(clutter | keepout))
        pick = rng.choice(free, size=min(missing, len(free)), replace=False)
        ys, xs = np.unravel_index(pick, clutter.shape)
        image[:, ys, xs] = rng.uniform(0, 1, size=(3, len(pick))).astype(np.float32)
        clutter[ys, xs] = True
    return clutter


def _canvas_cache(
    dataset: ClutteredFashionMNIST | ClutteredFashionMNISTSeg, cache_dir: str | os.PathLike
) -> dict[str, np.ndarray]:
    """Every canvas of ``dataset`` as arrays memory-mapped from ``cache_dir``, rendered
    there first if needed (once: a file lock makes concurrent processes wait for the
    first; the folder appears atomically, so a killed render leaves nothing half-written).

    Arrays: ``images`` uint8 ``(N, 3, S, S)``, and ``labels`` + ``item_masks`` (classification)
    or ``masks`` uint8 ``(N, S, S)`` (segmentation). The key covers the item pool's bytes
    and every rendering setting, so changed data or settings never read stale canvases.
    """
    r = dataset.renderer
    settings = {
        "kind": type(dataset).__name__,
        "n": len(dataset),
        "seed": dataset.seed,
        "size": r.image_size,
        "item": r.item_size,
        "clutter": r.clutter_fraction,
        "frag": r.fragment_prob,
        "margin": r.margin,
        "mask": r.mask_threshold,
        "items": [getattr(dataset, "min_items", 1), getattr(dataset, "max_items", 1)],
    }
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(r.images).tobytes())
    digest.update(np.ascontiguousarray(r.labels).tobytes())
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"{settings['kind'].lower()}-{digest.hexdigest()[:16]}"
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").is_file():
            log.info("rendering %d canvases into %s (once)", len(dataset), folder)
            tmp = root / f"{folder.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            _render_into(dataset, tmp)
            (tmp / "done").write_text(json.dumps(settings) + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
    return {f.stem: np.load(f, mmap_mode="r") for f in folder.glob("*.npy")}


#: Canvases per rendering task; larger caches are rendered by a pool of worker processes.
RENDER_CHUNK = 512
_RENDERING: ClutteredFashionMNIST | ClutteredFashionMNISTSeg | None = None  # a pool worker's dataset


def _render_into(dataset: ClutteredFashionMNIST | ClutteredFashionMNISTSeg, folder: Path) -> None:
    """Render every canvas of ``dataset`` into ``.npy`` arrays in ``folder``: in this
    process for small sets, else in chunks on every CPU this process may use (the full
    training set of 55,000 canvases takes about two minutes on one core)."""
    size, n = dataset.renderer.image_size, len(dataset)
    seg = isinstance(dataset, ClutteredFashionMNISTSeg)
    shapes = {"images": (np.uint8, (n, 3, size, size))}
    shapes.update(
        {"masks": (np.uint8, (n, size, size))}
        if seg
        else {"item_masks": (bool, (n, size, size)), "labels": (np.int64, (n,))}
    )
    for name, (dtype, shape) in shapes.items():  # the files first; each chunk fills its own rows
        np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=dtype, shape=shape).flush()
    chunks = [(start, min(start + RENDER_CHUNK, n)) for start in range(0, n, RENDER_CHUNK)]
    workers = min(len(os.sched_getaffinity(0)), len(chunks), 32)
    if workers < 2 or "forkserver" not in multiprocessing.get_all_start_methods():
        for start, stop in chunks:
            _render_chunk(dataset, folder, start, stop)
        return
    # forkserver, not fork: the caller may already run threads (Ray's, a DataLoader's),
    # and a child forked from a threaded process can hang on a lock it inherited held.
    # The server imports this module once; each worker receives the dataset (its item
    # pool) once, by its initializer.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with context.Pool(workers, initializer=_set_rendering, initargs=(dataset,)) as pool:
        pool.starmap(_render_in_worker, [(str(folder), start, stop) for start, stop in chunks])


def _set_rendering(dataset: ClutteredFashionMNIST | ClutteredFashionMNISTSeg) -> None:
    global _RENDERING
    _RENDERING = dataset


def _render_in_worker(folder: str, start: int, stop: int) -> None:
    _render_chunk(_RENDERING, Path(folder), start, stop)


def _render_chunk(dataset, folder: Path, start: int, stop: int) -> None:
    """Canvases ``start:stop`` into the arrays of ``folder`` (each chunk writes its own rows)."""
    seg = isinstance(dataset, ClutteredFashionMNISTSeg)
    size = dataset.renderer.image_size
    arrays = {f.stem: np.load(f, mmap_mode="r+") for f in folder.glob("*.npy")}
    for i in range(start, stop):
        canvas = dataset.render(i)
        arrays["images"][i] = np.round(canvas.image * 255.0).astype(np.uint8)
        if seg:
            arrays["masks"][i] = _class_map(canvas, size)
        else:
            arrays["labels"][i] = canvas.labels[0]
            arrays["item_masks"][i] = canvas.item_masks[0]
    for array in arrays.values():
        array.flush()


def _class_map(canvas: Canvas, size: int) -> np.ndarray:
    """Per-pixel classes of a segmentation canvas: item class + 1, 0 elsewhere."""
    mask = np.zeros((size, size), dtype=np.int64)
    for label, item_mask in zip(canvas.labels, canvas.item_masks):
        mask[item_mask] = label + 1
    return mask


def _as_image(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels.astype(np.float32) / 255.0)


class _ClutteredCanvases(Dataset):
    """What both variants share: the renderer, the length, per-canvas seeding, the cache."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        image_size: int,
        num_samples: int | None,
        item_size: int,
        clutter_fraction: float,
        fragment_prob: float,
        margin: int,
        mask_threshold: float,
        max_items: int,
        seed: int,
        cache_dir: str | None,
    ) -> None:
        self.renderer = _ClutterRenderer(
            images,
            labels,
            image_size=image_size,
            item_size=item_size,
            clutter_fraction=clutter_fraction,
            fragment_prob=fragment_prob,
            margin=margin,
            mask_threshold=mask_threshold,
            max_items=max_items,
            seed=seed,
        )
        self.num_samples = len(images) if num_samples is None else int(num_samples)
        self.image_size = image_size
        self.seed = seed
        self._cache = _canvas_cache(self, cache_dir) if cache_dir else None

    def __len__(self) -> int:
        return self.num_samples

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)

    def _rng(self, index: int) -> np.random.Generator:
        """Canvas ``index``'s random stream: it depends on ``(seed, index)`` only."""
        self._check(index)
        return np.random.default_rng((self.seed, index))


class ClutteredFashionMNIST(_ClutteredCanvases):
    """Classification: one Fashion-MNIST item per canvas among clutter.

    Items are ``(image (3, S, S) float in [0, 1], label int, item_mask (S, S) bool)``;
    canvas ``i`` shows item ``i mod N`` of ``images``.

    Args:
        images, labels: the item pool (uint8 ``(N, 28, 28)`` and ``(N,)``), e.g. from
            ``fashion_mnist_split``; clutter fragments come from the same pool.
        image_size: canvas side.
        num_samples: dataset length (default: the pool size).
        item_size: item side on the canvas (28 = native).
        clutter_fraction: share of the canvas covered by clutter (at least this much).
        fragment_prob: chance that a clutter patch carries a fragment of another item.
        margin: clutter-free pixels around each item.
        mask_threshold: item intensity above which a pixel belongs to the item mask.
        seed: canvases depend only on ``(seed, index)``.
        cache_dir: render every canvas once into this folder (8-bit) and read it from there.
    """

    num_classes = len(CLASSES)
    classes = CLASSES

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        image_size: int = 64,
        num_samples: int | None = None,
        item_size: int = ITEM_SIZE,
        clutter_fraction: float = 0.4,
        fragment_prob: float = 0.5,
        margin: int = 2,
        mask_threshold: float = 0.1,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(
            images,
            labels,
            image_size=image_size,
            num_samples=num_samples,
            item_size=item_size,
            clutter_fraction=clutter_fraction,
            fragment_prob=fragment_prob,
            margin=margin,
            mask_threshold=mask_threshold,
            max_items=1,
            seed=seed,
            cache_dir=cache_dir,
        )

    def render(self, index: int) -> Canvas:
        """The full canvas ``index`` (image, item box, masks, clutter mask)."""
        rng = self._rng(index)
        return self.renderer.render(index, [index % len(self.renderer.images)], rng)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        if self._cache is not None:
            self._check(index)
            c = self._cache
            return (
                _as_image(c["images"][index]),
                int(c["labels"][index]),
                torch.from_numpy(np.array(c["item_masks"][index])),
            )
        canvas = self.render(index)
        return torch.from_numpy(canvas.image), canvas.labels[0], torch.from_numpy(canvas.item_masks[0])


class ClutteredFashionMNISTSeg(_ClutteredCanvases):
    """Segmentation: several Fashion-MNIST items per canvas among the same clutter.

    Items are ``(image (3, S, S) float in [0, 1], mask (S, S) long)`` with class
    ``k + 1`` on the silhouette of an item of class ``k`` and 0 elsewhere (clutter,
    including fragments of items, is background).

    Args:
        min_items, max_items: items per canvas; by default as many (up to 4) as fit
            beside the clutter, at least 2 where that fits.
        Others as in ``ClutteredFashionMNIST``.
    """

    num_classes = len(CLASSES) + 1
    classes = ("background", *CLASSES)
    ignore_index = 255

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        image_size: int = 64,
        num_samples: int | None = None,
        item_size: int = ITEM_SIZE,
        min_items: int | None = None,
        max_items: int | None = None,
        clutter_fraction: float = 0.4,
        fragment_prob: float = 0.5,
        margin: int = 2,
        mask_threshold: float = 0.1,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        tile = (item_size + 2 * margin) ** 2
        if max_items is None:
            max_items = int(max(1, min(4, (image_size * image_size * (1 - clutter_fraction)) // tile)))
        if min_items is None:
            min_items = min(2, max_items)
        if not 1 <= min_items <= max_items:
            raise ValueError(f"need 1 <= min_items <= max_items, got {min_items} and {max_items}")
        self.min_items, self.max_items = min_items, max_items  # before the cache: part of its key
        super().__init__(
            images,
            labels,
            image_size=image_size,
            num_samples=num_samples,
            item_size=item_size,
            clutter_fraction=clutter_fraction,
            fragment_prob=fragment_prob,
            margin=margin,
            mask_threshold=mask_threshold,
            max_items=max_items,
            seed=seed,
            cache_dir=cache_dir,
        )

    def render(self, index: int) -> Canvas:
        """The full canvas ``index``."""
        rng = self._rng(index)
        count = int(rng.integers(self.min_items, self.max_items + 1))
        pool = len(self.renderer.images)
        count = min(count, pool)
        picks = [int(j) for j in rng.choice(pool, size=count, replace=False)]
        return self.renderer.render(index, picks, rng)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is not None:
            self._check(index)
            return _as_image(self._cache["images"][index]), torch.from_numpy(
                self._cache["masks"][index].astype(np.int64)
            )
        canvas = self.render(index)
        return torch.from_numpy(canvas.image), torch.from_numpy(_class_map(canvas, self.image_size))
