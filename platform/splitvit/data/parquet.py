"""A map-style dataset over parquet shards written by ``write_shards``, local or ``s3://``,
and the sampler that reads it at about one byte read per dataset byte per epoch.

Shard footers are read when the dataset is built (cheap: metadata only), so the
length and the corrupt-shard count are known up front; the footers are kept, so no
process reads one again. Rows are fetched one row group at a time, with a small
per-process cache; file handles are opened lazily in each process, so the dataset
pickles and works in DataLoader workers (fork or spawn).

Random access costs a whole row group per item once the group has left the cache:
a globally shuffled index over a large set reads each group about as many times as
it has rows. :class:`RowGroupSampler` shuffles instead at two levels, the order of
row groups and the rows within a window of a few groups, so each group is read once
per epoch (:func:`training_sampler` picks it for parquet shards).

Detection shards give :class:`~.coco.CocoDetection`'s items (same keys, dtypes and
shapes) and its ``categories``/``category_ids``; ``ground_truth_document()`` is the
COCO ground truth stored beside them (a COCO source's own annotations, in its files'
pixels). They are read at the canvas size they were written at only: boxes, masks and
a letterbox's scale belong to that canvas.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from torch.utils.data import Dataset, DistributedSampler

from ..storage import exists, filesystem_for, join_uri, list_files, read_bytes
from .coco_format import CocoDocument
from .common import (
    CorruptDataError,
    SkippingDataset,
    decode_image,
    decode_mask,
    fit_square,
    image_to_tensor,
    mask_to_tensor,
    pil_resample,
)
from .shards import MANIFEST, ShardManifest

log = logging.getLogger(__name__)


def resolve_shard_dir(uri: str, split: str | None) -> tuple[str, ShardManifest | None]:
    """The folder holding ``split``'s shards and its manifest (None when it has none).

    ``uri/split`` is used when it exists; otherwise ``uri`` itself, provided its
    manifest (if any) does not say it holds a different split.
    """
    candidates = ([join_uri(uri, split)] if split else []) + [uri]
    for folder in candidates:
        if not exists(folder):
            continue
        manifest = None
        if exists(join_uri(folder, MANIFEST)):
            try:
                manifest = ShardManifest.from_dict(json.loads(read_bytes(join_uri(folder, MANIFEST))))
            except ValueError as exc:
                raise ValueError(f"{join_uri(folder, MANIFEST)}: not valid JSON: {exc}") from None
        if folder == uri and split and manifest and manifest.split not in (None, split):
            raise ValueError(
                f"{uri} holds the {manifest.split!r} split, not {split!r} (and {join_uri(uri, split)} does not exist)"
            )
        return folder, manifest
    raise FileNotFoundError(
        f"parquet shards: {uri} does not exist" + (f" (nor {join_uri(uri, split)})" if split else "")
    )


def detection_target(data: dict[str, list], row: int, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Row ``row`` of a detection row group's columns (``write_shards``'s ``DETECTION_COLUMNS``)
    as :class:`~.coco.CocoDetection`'s target, on an image of ``size`` (height, width)."""
    labels = data["labels"][row]
    counts = data["masks"][row]
    if counts:
        rles = [{"size": list(size), "counts": c} for c in counts]
        masks = np.ascontiguousarray(mask_utils.decode(rles).transpose(2, 0, 1))
    else:
        masks = np.zeros((0, *size), dtype=np.uint8)
    target = {
        "boxes": torch.tensor(data["boxes"][row], dtype=torch.float32).reshape(len(labels), 4),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "masks": torch.from_numpy(masks),
        "iscrowd": torch.tensor(data["iscrowd"][row], dtype=torch.uint8),
        "area": torch.tensor(data["area"][row], dtype=torch.float32),
        "image_id": torch.tensor(data["image_id"][row], dtype=torch.int64),
    }
    if data["scale"][row] is not None:  # a letterboxed COCO image
        target["scale"] = torch.tensor(data["scale"][row], dtype=torch.float32)
        target["original_size"] = torch.tensor(data["original_size"][row], dtype=torch.int64)
    return target


class ParquetShards(SkippingDataset):
    """All rows of the parquet shards in a folder or ``s3://`` prefix.

    Items are ``(image (3, H, W) float in [0, 1], label int | mask (H, W) long)``,
    plus ``object_mask (H, W) bool`` when the shards carry one. Images (and masks)
    are resized to ``image_size`` when they were stored at another size.

    Detection shards (``task == "detection"``) give ``(image, target dict)`` exactly as
    their source did (:class:`~.coco.CocoDetection`'s format, ``scale`` and
    ``original_size`` on letterboxed items) and have ``categories``, ``category_ids`` and
    ``num_classes`` (K + 1) from their manifest; an ``image_size`` other than the stored
    canvas is refused (prepare them at the model's size).

    Args:
        uri: folder or ``s3://bucket/prefix`` with shards (or with ``split/`` subfolders).
        split: ``train``/``val``/``test`` (see ``resolve_shard_dir``), or None.
        image_size: output side; None keeps the stored size.
        strict: raise on a corrupt shard or row instead of skipping and counting it.
        cache_row_groups: decoded row groups kept per process (and the shuffle window of
            :class:`RowGroupSampler`, which needs a window's groups to stay cached).
        interpolation: the filter that resizes images (timm's name: the model's data
            config's ``interpolation``); masks are always resized ``nearest``.
        filesystem: read through this pyarrow filesystem (paths as ``filesystem_for``
            gives them) instead of the one for ``uri``; e.g. one that counts bytes read.
    """

    def __init__(
        self,
        uri: str,
        split: str | None = None,
        *,
        image_size: int | None = None,
        strict: bool = False,
        cache_row_groups: int = 4,
        filesystem: pafs.FileSystem | None = None,
        interpolation: str = "bicubic",
    ) -> None:
        super().__init__(strict=strict)
        self.resample = pil_resample(interpolation)
        if cache_row_groups < 1:
            raise ValueError(f"cache_row_groups must be >= 1, got {cache_row_groups}")
        self.uri = str(uri)
        self.filesystem = filesystem
        self.folder, self.manifest = resolve_shard_dir(self.uri, split)
        self.image_size = image_size
        self.cache_row_groups = cache_row_groups
        if self.manifest and self.manifest.shards:
            # The manifest is written last: trusting its list ignores stray or half-written files.
            files = [join_uri(self.folder, s.file) for s in self.manifest.shards]
        else:
            files = list_files(self.folder, ".parquet", recursive=False)
        if not files:
            raise FileNotFoundError(f"parquet shards: no .parquet files in {self.folder}")
        m = self.manifest or ShardManifest()
        self.num_classes = m.num_classes
        self.classes = m.classes
        self.categories: tuple[str, ...] | None = m.categories
        self.category_ids: tuple[int, ...] | None = m.category_ids
        self.files: list[str] = []
        # footers kept for every process: reopening a file then reads no footer again
        self._metadata: list[pq.FileMetaData] = []
        units: list[tuple[int, int, int]] = []  # (file number, row group, rows)
        self.columns: list[str] | None = None
        fs = self.filesystem or filesystem_for(self.folder)[0]
        for uri_ in files:
            try:
                meta = self._read_metadata(fs, uri_)
            except CorruptDataError as exc:
                self.record_corrupt(exc)  # raises when strict
                continue
            names = meta.schema.to_arrow_schema().names
            if "image" not in names or not ({"label", "mask", "boxes"} & set(names)):
                raise ValueError(f"{uri_}: not a splitvit shard (columns {names}; need image and label, mask or boxes)")
            if self.columns is None:
                self.columns = names
            elif set(names) != set(self.columns):
                raise ValueError(f"{uri_}: columns {names} differ from the other shards' {self.columns}")
            k = len(self.files)
            self.files.append(uri_)
            self._metadata.append(meta)
            units += [(k, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        if not units:
            raise ValueError(
                f"parquet shards: no readable rows in {self.folder} "
                f"({self.skipped} corrupt shards: {self.skipped_files})"
            )
        self._units = np.asarray([(f, g) for f, g, _ in units], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum([n for _, _, n in units])]).astype(np.int64)
        self.task = (
            "detection" if "boxes" in self.columns else "segmentation" if "mask" in self.columns else "classification"
        )
        if self.task == "detection":
            self._check_detection(image_size)
        self._bad_files: set[int] = set()
        self._reset_handles()
        log.info("parquet shards %s: %d rows in %d shards in %s", split, self.raw_len(), len(self.files), self.folder)

    def _check_detection(self, image_size: int | None) -> None:
        """Detection shards need their manifest (categories, canvas, ground truth) and are
        read at the canvas they hold: boxes, masks and letterbox scales are that canvas's."""
        m = self.manifest or ShardManifest()
        if not m.categories or not m.ground_truth or m.image_size is None:
            raise ValueError(
                f"{self.folder}: detection shards without their {MANIFEST} categories and ground truth; "
                "write them with `splitvit data prepare`"
            )
        height, width = m.image_size
        if image_size is not None and (height, width) != (image_size, image_size):
            raise ValueError(
                f"{self.folder}: detection shards of {width}x{height} canvases read at {image_size} px; their boxes "
                f"and masks are the stored canvas's: prepare them with --image-size {image_size}, or set "
                f"model.image_size={height}"
            )

    def ground_truth_document(self) -> CocoDocument:
        """COCO's ground truth of the images these detection shards hold (their source's own
        annotations for a COCO file: in its pixels, as COCO's evaluation compares them)."""
        if self.task != "detection":
            raise ValueError(f"{self.folder}: {self.task} shards have no COCO ground truth (not detection shards)")
        return json.loads(read_bytes(join_uri(self.folder, self.manifest.ground_truth)))

    @staticmethod
    def _read_metadata(fs, uri_: str):
        _, path = filesystem_for(uri_)
        try:
            with fs.open_input_file(path) as f:
                return pq.read_metadata(f)
        except FileNotFoundError:
            raise CorruptDataError(uri_, "listed in the manifest but missing") from None
        except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) on a bad footer
            raise CorruptDataError(uri_, f"{type(exc).__name__}: {exc}") from None

    # per-process state ---------------------------------------------------------
    def _reset_handles(self) -> None:
        self._pid = os.getpid()
        self._fs = None
        self._handles: dict[int, pq.ParquetFile] = {}
        self._cache: OrderedDict[tuple[int, int], dict[str, list]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_fs=None, _handles={}, _cache=OrderedDict(), _pid=None)
        return state

    def _row_group(self, file_no: int, group: int) -> dict[str, list]:
        if self._pid != os.getpid():  # forked worker: never share the parent's connections
            self._reset_handles()
        key = (file_no, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        uri_ = self.files[file_no]
        try:
            if file_no not in self._handles:
                if self._fs is None:
                    self._fs = self.filesystem or filesystem_for(self.folder)[0]
                _, path = filesystem_for(uri_)
                self._handles[file_no] = pq.ParquetFile(
                    self._fs.open_input_file(path), metadata=self._metadata[file_no]
                )
            table = self._handles[file_no].read_row_group(group, columns=self.columns)
        except (OSError, ValueError) as exc:
            self._bad_files.add(file_no)
            raise CorruptDataError(uri_, f"row group {group}: {type(exc).__name__}: {exc}") from None
        data = table.to_pydict()
        self._cache[key] = data
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return data

    @property
    def num_row_groups(self) -> int:
        """Row groups across all readable shards."""
        return len(self._units)

    def row_group_of_items(self) -> np.ndarray:
        """For each item index ``0..len(self)-1``, the number of the row group holding it
        (its order follows the shards' order; items left out by ``_keep`` are absent)."""
        raw = self._keep if self._keep is not None else np.arange(self.raw_len(), dtype=np.int64)
        return (np.searchsorted(self._starts, raw, side="right") - 1).astype(np.int64)

    # SkippingDataset -----------------------------------------------------------
    def raw_len(self) -> int:
        return int(self._starts[-1])

    def load_raw(self, raw_index: int):
        unit = int(np.searchsorted(self._starts, raw_index, side="right") - 1)
        file_no, group = (int(v) for v in self._units[unit])
        uri_ = self.files[file_no]
        if file_no in self._bad_files:
            raise CorruptDataError(uri_, "shard failed to read earlier")
        data = self._row_group(file_no, group)
        row = raw_index - int(self._starts[unit])
        source = f"{uri_} (row group {group}, row {row})"
        img = decode_image(data["image"][row], source)
        if self.task == "detection":  # stored at the canvas size (checked when built)
            return image_to_tensor(img), detection_target(data, row, (img.height, img.width))
        if self.image_size is not None:
            img = fit_square(img, self.image_size, self.resample)
        if "label" in data:
            target: Any = int(data["label"][row])
        else:
            mask = decode_mask(data["mask"][row], source)
            if self.image_size is not None:
                mask = fit_square(mask, self.image_size, Image.NEAREST)
            target = mask_to_tensor(mask)
        if "object_mask" in data:
            obj = decode_mask(data["object_mask"][row], source)
            if self.image_size is not None:
                obj = fit_square(obj, self.image_size, Image.NEAREST)
            return image_to_tensor(img), target, mask_to_tensor(obj) > 0
        return image_to_tensor(img), target


class RowGroupSampler(DistributedSampler):
    """A per-epoch shuffle of :class:`ParquetShards` that reads every row group once.

    Each epoch (seeded by ``seed`` and the epoch, so a rerun repeats it): the row groups
    are put in a random order and their items laid end to end; rank ``r`` of
    ``num_replicas`` takes the ``r``-th contiguous slice (equal lengths, as
    ``DistributedSampler``: ``drop_last`` drops the remainder, otherwise items are
    repeated to fill), so each rank reads its own groups and at most the groups at
    slice boundaries are read by two ranks. Within a rank, items are shuffled inside
    windows of ``window`` consecutive row groups; every item is yielded once per epoch.

    DataLoader worker processes each keep their own row-group cache and take batches
    in turn (batch ``j`` to worker ``j % loader_workers``). Given ``batch_size`` and
    ``loader_workers``, the sampler gives each worker a contiguous run of row groups
    and orders batches so that worker ``k``'s batches come from its run only; otherwise
    every worker would read every group (amplification ``loader_workers``).

    The batch mix is coarser than a global shuffle: a batch draws from ``window``
    row groups rather than the whole set. A subclass of ``DistributedSampler``, so
    ``ray.train.torch.prepare_data_loader`` keeps it and ``set_epoch`` works as there.

    Args:
        dataset: the shards.
        num_replicas, rank: this process's place among the data-parallel workers.
        shuffle: False keeps the stored order (still split by rank and worker as above).
        seed: the shuffle's seed (with the epoch).
        drop_last: drop items that do not divide evenly among the ranks.
        window: row groups shuffled together (default ``dataset.cache_row_groups``;
            at most that, or the window would not stay cached).
        batch_size: the DataLoader's batch size (only for the ordering across workers).
        loader_workers: the DataLoader's ``num_workers``.
    """

    def __init__(
        self,
        dataset: ParquetShards,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        window: int | None = None,
        batch_size: int = 1,
        loader_workers: int = 0,
    ) -> None:
        if not isinstance(dataset, ParquetShards):
            raise TypeError(f"RowGroupSampler reads ParquetShards, got {type(dataset).__name__}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.window = int(window or dataset.cache_row_groups)
        if not 1 <= self.window <= dataset.cache_row_groups:
            raise ValueError(
                f"window must be in 1..cache_row_groups ({dataset.cache_row_groups}) so that a window's row groups "
                f"stay cached, got {self.window}"
            )
        if batch_size < 1 or loader_workers < 0:
            raise ValueError(f"batch_size must be >= 1 and loader_workers >= 0, got {batch_size} and {loader_workers}")
        self.batch_size, self.loader_workers = int(batch_size), int(loader_workers)

    def indices(self) -> np.ndarray:
        """This rank's item indices for the current epoch, in the order they are yielded."""
        groups = self.dataset.row_group_of_items()
        n = len(groups)
        # the same epoch order on every rank (they must agree on the slices), another each epoch
        rng = np.random.default_rng([abs(int(self.seed)), int(self.epoch)])
        if self.shuffle:
            position = np.empty(self.dataset.num_row_groups, dtype=np.int64)
            position[rng.permutation(self.dataset.num_row_groups)] = np.arange(self.dataset.num_row_groups)
            stream = np.argsort(position[groups], kind="stable")  # items grouped by row group, groups shuffled
        else:
            stream = np.arange(n, dtype=np.int64)
        if self.total_size <= n:
            stream = stream[: self.total_size]
        else:  # pad by repeating from the start, as DistributedSampler does
            stream = np.concatenate([stream, np.resize(stream, self.total_size - n)])
        mine = stream[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]
        return self._arrange(mine, groups, rng)

    def _arrange(self, mine: np.ndarray, groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Split ``mine`` into one contiguous run per loader worker (sized by the batches
        it will take), shuffle each run in windows, and interleave their batches."""
        workers, size = max(1, self.loader_workers), self.batch_size
        m = len(mine)
        if m == 0:
            return mine
        num_batches = -(-m // size)
        batch_sizes = np.full(num_batches, size, dtype=np.int64)
        batch_sizes[-1] = m - (num_batches - 1) * size
        owner = np.arange(num_batches) % workers
        run_lengths = np.bincount(owner, weights=batch_sizes, minlength=workers).astype(np.int64)
        runs, offset = [], 0
        for length in run_lengths:
            run = mine[offset : offset + length].copy()
            offset += length
            if self.shuffle:
                self._shuffle_windows(run, groups, rng)
            runs.append(run)
        out, taken = [], np.zeros(workers, dtype=np.int64)
        for j in range(num_batches):
            k = owner[j]
            out.append(runs[k][taken[k] : taken[k] + batch_sizes[j]])
            taken[k] += batch_sizes[j]
        return np.concatenate(out)

    def _shuffle_windows(self, run: np.ndarray, groups: np.ndarray, rng: np.random.Generator) -> None:
        """Shuffle ``run`` in place within windows of ``self.window`` consecutive row groups."""
        if len(run) == 0:
            return
        starts = np.concatenate([[0], np.flatnonzero(np.diff(groups[run]) != 0) + 1])
        bounds = np.concatenate([starts[:: self.window], [len(run)]])
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            rng.shuffle(run[lo:hi])

    def __iter__(self):
        return iter(self.indices().tolist())


def training_sampler(
    dataset: Dataset,
    *,
    num_replicas: int = 1,
    rank: int = 0,
    seed: int = 0,
    drop_last: bool = True,
    batch_size: int = 1,
    loader_workers: int = 0,
) -> DistributedSampler:
    """The shuffling sampler for training on ``dataset``: :class:`RowGroupSampler` for
    parquet shards (one read per row group per epoch), ``DistributedSampler`` otherwise
    (random access is cheap there). Call ``set_epoch`` before each epoch."""
    if isinstance(dataset, ParquetShards):
        return RowGroupSampler(
            dataset,
            num_replicas,
            rank,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
            batch_size=batch_size,
            loader_workers=loader_workers,
        )
    return DistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
