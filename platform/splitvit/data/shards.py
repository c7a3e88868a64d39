"""Writing any dataset as parquet shards (local folder or ``s3://``).

Layout of ``out_uri``::

    shard-00000.parquet ... shard-NNNNN.parquet
    _manifest.json        counts, schema, classes; written last

Columns: ``image`` (PNG bytes), ``label`` (int64, classification) or ``mask``
(PNG bytes, class ids 0..255, 255 = ignore), ``object_mask`` (PNG bytes, only when
the dataset yields a third element such as an object/item mask) and ``index`` (the
item's index in the source dataset). ``ParquetShards`` reads them back.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ..storage import StorageError, delete_file, exists, filesystem_for, join_uri, list_files, makedirs, write_bytes
from .common import CorruptDataError

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
FORMAT = "splitvit-shards/1"
SHARD_PATTERN = "shard-{:05d}.parquet"


@dataclass
class ShardWriteResult:
    """What ``write_shards`` wrote."""

    uri: str
    manifest: str
    rows: int
    shards: list[dict[str, Any]]
    bytes: int
    skipped: int
    skipped_files: list[str]
    task: str
    columns: list[str]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def encode_png(array: np.ndarray) -> bytes:
    """uint8 ``(H, W)`` or ``(H, W, 3)`` array -> PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG", compress_level=3)
    return buf.getvalue()


def _image_png(image: Any) -> tuple[bytes, tuple[int, int]]:
    # numpy, not torch: tiny per-item tensor ops pay torch's thread-pool overhead
    a = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if a.ndim != 3 or a.shape[0] not in (1, 3):
        raise ValueError(f"expected an image tensor (3, H, W), got shape {a.shape}")
    if a.shape[0] == 1:
        a = np.repeat(a, 3, axis=0)
    if a.dtype.kind == "f":
        a = np.rint(np.clip(a, 0, 1) * 255)
    arr = a.astype(np.uint8).transpose(1, 2, 0)
    return encode_png(arr), (int(arr.shape[0]), int(arr.shape[1]))


def _mask_png(mask: Any, what: str) -> bytes:
    arr = mask.numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if arr.ndim != 2:
        raise ValueError(f"expected a {what} of shape (H, W), got {arr.shape}")
    if arr.dtype != bool and (arr.min() < 0 or arr.max() > 255):
        raise ValueError(f"{what} values {arr.min()}..{arr.max()} do not fit a PNG mask (0..255)")
    return encode_png(arr.astype(np.uint8))


class _Checked(Dataset):
    """Yields ``("ok", i, item)`` or ``("bad", i, source, reason)`` so that corrupt items can be
    skipped even when they are loaded in DataLoader workers."""

    def __init__(self, dataset: Dataset, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int):
        i = self.indices[k]
        load = getattr(self.dataset, "load_item", None)  # SkippingDataset: no silent substitution
        try:
            return ("ok", i, load(i) if load else self.dataset[i])
        except CorruptDataError as exc:
            return ("bad", i, exc.source, exc.reason)


def _identity(x: Any) -> Any:
    return x


def _items(dataset: Dataset, indices: list[int], num_workers: int) -> Iterator[tuple]:
    checked = _Checked(dataset, indices)
    if num_workers <= 0:
        yield from (checked[k] for k in range(len(checked)))
        return
    loader = DataLoader(checked, batch_size=None, shuffle=False, num_workers=num_workers,
                        collate_fn=_identity, prefetch_factor=4)
    yield from loader


def _existing_shards(out_uri: str, overwrite: bool) -> list[str]:
    """Shard files and manifest already in ``out_uri``; an error unless ``overwrite``."""
    if not exists(out_uri):
        return []
    try:
        old = list_files(out_uri, (".parquet", MANIFEST), recursive=False)
    except FileNotFoundError:
        return []
    old = [u for u in old if u.rsplit("/", 1)[-1].startswith("shard-") or u.endswith(MANIFEST)]
    if old and not overwrite:
        raise ValueError(f"{out_uri} already holds shards ({len(old)} files); choose another folder or overwrite")
    return old


def write_shards(
    dataset: Dataset,
    out_uri: str,
    rows_per_shard: int = 1000,
    *,
    row_group_size: int = 64,
    limit: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    num_workers: int = 0,
    progress: bool = False,
) -> ShardWriteResult:
    """Write ``dataset`` (items ``(image, label | mask[, object_mask])``) as parquet shards.

    Args:
        dataset: any map-style dataset with the item convention of ``splitvit.data``.
        out_uri: a local folder or ``s3://bucket/prefix`` (the bucket must exist).
        rows_per_shard: rows per parquet file.
        row_group_size: rows per row group, the unit a reader fetches for one item;
            small groups keep random access cheap.
        limit: write only the first ``limit`` items.
        strict: raise on a corrupt item instead of skipping (and counting) it.
        overwrite: replace shards already in ``out_uri`` (otherwise that is an error).
        metadata: extra JSON-able facts for the manifest (dataset name, split, ...).
        num_workers: DataLoader workers that load/decode items in parallel.
        progress: show a progress bar.

    Returns the counts; ``_manifest.json`` in ``out_uri`` holds the same and the schema.
    """
    if rows_per_shard < 1 or row_group_size < 1:
        raise ValueError(f"rows_per_shard and row_group_size must be >= 1, got {rows_per_shard} and {row_group_size}")
    start = time.perf_counter()
    total = len(dataset) if limit is None else min(int(limit), len(dataset))
    if total < 1:
        raise ValueError(f"nothing to write: the dataset has {len(dataset)} items (limit {limit})")
    stale = _existing_shards(out_uri, overwrite)
    # The old manifest goes first, so no reader trusts it while shards are replaced;
    # old shards the new set does not replace are removed only once it is complete.
    for uri in [u for u in stale if u.endswith(MANIFEST)]:
        delete_file(uri)
    makedirs(out_uri)
    fs, base = filesystem_for(out_uri)

    columns: dict[str, list] = {}
    task: str | None = None
    image_size: tuple[int, int] | None = None
    shards: list[dict[str, Any]] = []
    skipped_files: list[str] = []
    rows = 0

    def flush() -> None:
        nonlocal columns
        if not columns.get("image"):
            return
        name = SHARD_PATTERN.format(len(shards))
        types = {"image": pa.binary(), "label": pa.int64(), "mask": pa.binary(), "object_mask": pa.binary(), "index": pa.int64()}
        table = pa.table({k: pa.array(v, type=types[k]) for k, v in columns.items()})
        path = f"{base.rstrip('/')}/{name}"
        try:
            pq.write_table(table, path, filesystem=fs, row_group_size=row_group_size,
                           use_dictionary=[c for c in ("label", "index") if c in columns], compression="snappy")
            size = fs.get_file_info(path).size
        except OSError as exc:
            raise StorageError(f"{join_uri(out_uri, name)}: writing the shard failed: {exc}") from exc
        shards.append({"file": name, "rows": table.num_rows, "bytes": int(size or 0)})
        log.info("wrote %s (%d rows)", join_uri(out_uri, name), table.num_rows)
        columns = {k: [] for k in columns}

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"shards -> {out_uri}", unit="img")
    for record in _items(dataset, list(range(total)), num_workers):
        if bar is not None:
            bar.update(1)
        if record[0] == "bad":
            _, i, source, reason = record
            if strict:
                raise CorruptDataError(source, reason)
            if source not in skipped_files:
                skipped_files.append(source)
            log.warning("skipping item %d: corrupt or unreadable data in %s: %s", i, source, reason)
            continue
        _, i, item = record
        image, target = item[0], item[1]
        png, size = _image_png(image)
        kind = "classification" if np.ndim(target) == 0 else "segmentation"
        if task is None:
            task, image_size = kind, size
            columns = {"image": [], ("label" if kind == "classification" else "mask"): [], "index": []}
            if len(item) > 2:
                columns["object_mask"] = []
        elif kind != task or (len(item) > 2) != ("object_mask" in columns):
            raise ValueError(f"item {i} does not match the first item's layout ({task}, {len(columns) - 1} fields)")
        columns["image"].append(png)
        if kind == "classification":
            columns["label"].append(int(target))
        else:
            columns["mask"].append(_mask_png(target, "mask"))
        if "object_mask" in columns:
            columns["object_mask"].append(_mask_png(item[2], "object mask"))
        columns["index"].append(int(i))
        rows += 1
        if len(columns["image"]) >= rows_per_shard:
            flush()
    flush()
    if bar is not None:
        bar.close()
    if rows == 0:
        raise ValueError(f"no readable items to write to {out_uri} ({len(skipped_files)} corrupt files skipped)")

    written = {sh["file"] for sh in shards}
    for uri in stale:
        if not uri.endswith(MANIFEST) and uri.replace(os.sep, "/").rsplit("/", 1)[-1] not in written:
            delete_file(uri)
    manifest = {
        "format": FORMAT,
        "task": task,
        "num_rows": rows,
        "image_size": list(image_size or ()),
        "num_classes": getattr(dataset, "num_classes", None),
        "classes": list(getattr(dataset, "classes", None) or []) or None,
        "columns": list(columns),
        "schema": {"image": "binary PNG RGB", "label": "int64", "mask": "binary PNG L class ids (255 = ignore)",
                   "object_mask": "binary PNG L 0/1", "index": "int64 index in the source dataset"},
        "shards": shards,
        "skipped": len(skipped_files),
        "skipped_files": skipped_files,
        **(metadata or {}),
    }
    manifest["schema"] = {k: v for k, v in manifest["schema"].items() if k in columns}
    manifest_uri = join_uri(out_uri, MANIFEST)
    write_bytes(manifest_uri, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
    result = ShardWriteResult(
        uri=out_uri, manifest=manifest_uri, rows=rows, shards=shards, bytes=sum(s["bytes"] for s in shards),
        skipped=len(skipped_files), skipped_files=skipped_files, task=task or "", columns=list(columns),
        seconds=time.perf_counter() - start, extra=dict(metadata or {}),
    )
    log.info("wrote %d rows in %d shards to %s (%d corrupt skipped)", rows, len(shards), out_uri, result.skipped)
    return result
