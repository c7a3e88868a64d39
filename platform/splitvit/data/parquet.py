"""A map-style dataset over parquet shards written by ``write_shards``, local or ``s3://``.

Shard footers are read when the dataset is built (cheap: metadata only), so the
length and the corrupt-shard count are known up front. Rows are fetched one row
group at a time, with a small per-process cache; file handles are opened lazily in
each process, so the dataset pickles and works in DataLoader workers (fork or spawn).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from ..storage import exists, filesystem_for, join_uri, list_files, read_bytes
from .common import (
    CorruptDataError,
    SkippingDataset,
    decode_image,
    decode_mask,
    fit_square,
    image_to_tensor,
    mask_to_tensor,
)
from .shards import MANIFEST

log = logging.getLogger(__name__)


def resolve_shard_dir(uri: str, split: str | None) -> tuple[str, dict[str, Any] | None]:
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
                manifest = json.loads(read_bytes(join_uri(folder, MANIFEST)))
            except ValueError as exc:
                raise ValueError(f"{join_uri(folder, MANIFEST)}: not valid JSON: {exc}") from None
        if folder == uri and split and manifest and manifest.get("split") not in (None, split):
            raise ValueError(
                f"{uri} holds the {manifest['split']!r} split, not {split!r} "
                f"(and {join_uri(uri, split)} does not exist)"
            )
        return folder, manifest
    raise FileNotFoundError(
        f"parquet shards: {uri} does not exist" + (f" (nor {join_uri(uri, split)})" if split else "")
    )


class ParquetShards(SkippingDataset):
    """All rows of the parquet shards in a folder or ``s3://`` prefix.

    Items are ``(image (3, H, W) float in [0, 1], label int | mask (H, W) long)``,
    plus ``object_mask (H, W) bool`` when the shards carry one. Images (and masks)
    are resized to ``image_size`` when they were stored at another size.

    Args:
        uri: folder or ``s3://bucket/prefix`` with shards (or with ``split/`` subfolders).
        split: ``train``/``val``/``test`` (see ``resolve_shard_dir``), or None.
        image_size: output side; None keeps the stored size.
        strict: raise on a corrupt shard or row instead of skipping and counting it.
        cache_row_groups: decoded row groups kept per process.
    """

    def __init__(
        self,
        uri: str,
        split: str | None = None,
        *,
        image_size: int | None = None,
        strict: bool = False,
        cache_row_groups: int = 4,
    ) -> None:
        super().__init__(strict=strict)
        self.uri = str(uri)
        self.folder, self.manifest = resolve_shard_dir(self.uri, split)
        self.image_size = image_size
        self.cache_row_groups = cache_row_groups
        if self.manifest and self.manifest.get("shards"):
            # The manifest is written last: trusting its list ignores stray or half-written files.
            files = [join_uri(self.folder, s["file"]) for s in self.manifest["shards"]]
        else:
            files = list_files(self.folder, ".parquet", recursive=False)
        if not files:
            raise FileNotFoundError(f"parquet shards: no .parquet files in {self.folder}")
        m = self.manifest or {}
        self.num_classes = m.get("num_classes")
        self.classes = m.get("classes")
        self.files: list[str] = []
        units: list[tuple[int, int, int]] = []  # (file number, row group, rows)
        self.columns: list[str] | None = None
        fs, _ = filesystem_for(self.folder)
        for uri_ in files:
            try:
                meta = self._read_metadata(fs, uri_)
            except CorruptDataError as exc:
                self.record_corrupt(exc)  # raises when strict
                continue
            names = meta.schema.to_arrow_schema().names
            if "image" not in names or not ({"label", "mask"} & set(names)):
                raise ValueError(f"{uri_}: not a splitvit shard (columns {names}; need image and label or mask)")
            if self.columns is None:
                self.columns = names
            elif set(names) != set(self.columns):
                raise ValueError(f"{uri_}: columns {names} differ from the other shards' {self.columns}")
            k = len(self.files)
            self.files.append(uri_)
            units += [(k, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        if not units:
            raise ValueError(
                f"parquet shards: no readable rows in {self.folder} "
                f"({self.skipped} corrupt shards: {self.skipped_files})"
            )
        self._units = np.asarray([(f, g) for f, g, _ in units], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum([n for _, _, n in units])]).astype(np.int64)
        self.task = "segmentation" if "mask" in self.columns else "classification"
        self._bad_files: set[int] = set()
        self._reset_handles()
        log.info("parquet shards %s: %d rows in %d shards in %s", split, self.raw_len(), len(self.files), self.folder)

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
                    self._fs, _ = filesystem_for(self.folder)
                _, path = filesystem_for(uri_)
                self._handles[file_no] = pq.ParquetFile(self._fs.open_input_file(path))
            table = self._handles[file_no].read_row_group(group, columns=self.columns)
        except (OSError, ValueError) as exc:
            self._bad_files.add(file_no)
            raise CorruptDataError(uri_, f"row group {group}: {type(exc).__name__}: {exc}") from None
        data = table.to_pydict()
        self._cache[key] = data
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return data

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
        if self.image_size is not None:
            img = fit_square(img, self.image_size, Image.BICUBIC)
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
