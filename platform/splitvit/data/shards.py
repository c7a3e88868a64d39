"""Writing any dataset as parquet shards (local folder or ``s3://``).

Layout of ``out_uri``::

    shard-00000.parquet ... shard-NNNNN.parquet
    _instances.json       detection only: the COCO ground truth of the images held
    _manifest.json        counts, schema, classes or categories; written last

Columns: ``image`` (PNG bytes), ``label`` (int64, classification) or ``mask``
(PNG bytes, class ids 0..255, 255 = ignore), ``object_mask`` (PNG bytes, only when
the dataset yields a third element such as an object/item mask) and ``index`` (the
item's index in the source dataset). ``ParquetShards`` reads them back.

Detection items ``(image, target dict)`` (:class:`~.coco.CocoDetection`'s format) keep
their target in typed columns (:data:`DETECTION_COLUMNS`): ``boxes`` (xyxy float32 per
object), ``labels``, ``iscrowd``, ``area``, ``image_id``, ``masks`` (each instance mask
as COCO's compressed RLE string, exact whatever overlaps), and for a letterboxed COCO
image ``scale`` and ``original_size`` (null otherwise). ``_instances.json`` is what
COCO's evaluation compares detections with: a COCO source's own entries for the images
written (in the file's pixels), else the items' entries (:func:`~.coco.coco_entries`,
as :func:`~.fashion_det.coco_document` makes them).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader, Dataset

from ..jsontypes import JsonObject
from ..storage import StorageError, delete_file, exists, filesystem_for, join_uri, list_files, makedirs, write_bytes
from .coco import coco_entries
from .coco_format import CocoAnnotation, CocoCategory, CocoDocument, CocoImage
from .common import CorruptDataError

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
#: Detection shards' COCO ground truth (the images they hold), beside the manifest.
GROUND_TRUTH = "_instances.json"
FORMAT = "splitvit-shards/1"
SHARD_PATTERN = "shard-{:05d}.parquet"
#: A detection target's fields, each a column (``scale`` and ``original_size``: letterboxed items only).
DETECTION_COLUMNS = ("boxes", "labels", "masks", "iscrowd", "area", "image_id", "scale", "original_size")
#: The fields every detection target has.
DETECTION_REQUIRED = DETECTION_COLUMNS[:6]


@dataclass(frozen=True)
class ShardFile:
    """One shard file of a set: its name in the set's folder, its rows and size."""

    file: str
    rows: int
    bytes: int

    def to_dict(self) -> dict[str, str | int]:
        """The manifest's entry (``shards``' items)."""
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: JsonObject) -> ShardFile:
        """A manifest's entry (:meth:`to_dict`)."""
        return cls(file=str(data["file"]), rows=int(data.get("rows", 0)), bytes=int(data.get("bytes", 0)))


@dataclass(frozen=True)
class ShardManifest:
    """A shard set's ``_manifest.json`` as its readers use it (:func:`~.parquet.resolve_shard_dir`
    reads it); :func:`write_shards` writes the file, with the schema, counts and metadata besides.

    Attributes:
        task: ``classification``, ``segmentation`` or ``detection`` (``None``: not said).
        image_size: the stored images' ``(height, width)`` (``None``: not said).
        num_classes, classes: the dataset's, when it has them.
        shards: the set's files, in order (the manifest is written last: it lists complete files only).
        split: the split the set holds, when its metadata says.
        categories, category_ids: detection only: category names and COCO ids in label order.
        ground_truth: detection only: the COCO ground truth file's name in the folder.
    """

    task: str | None = None
    image_size: tuple[int, int] | None = None
    num_classes: int | None = None
    classes: list[str] | None = None
    shards: tuple[ShardFile, ...] = ()
    split: str | None = None
    categories: tuple[str, ...] | None = None
    category_ids: tuple[int, ...] | None = None
    ground_truth: str | None = None

    @classmethod
    def from_dict(cls, data: JsonObject) -> ShardManifest:
        """The manifest from its JSON (keys it lacks stay ``None``; others are left out)."""
        size = data.get("image_size")
        return cls(
            task=data.get("task"),
            image_size=(int(size[0]), int(size[1])) if size else None,
            num_classes=data.get("num_classes"),
            classes=data.get("classes"),
            shards=tuple(ShardFile.from_dict(s) for s in data.get("shards") or ()),
            split=data.get("split"),
            categories=tuple(data["categories"]) if "categories" in data else None,
            category_ids=tuple(data["category_ids"]) if "category_ids" in data else None,
            ground_truth=data.get("ground_truth"),
        )


@dataclass
class ShardWriteResult:
    """What ``write_shards`` wrote."""

    uri: str
    manifest: str
    rows: int
    shards: list[ShardFile]
    bytes: int
    skipped: int
    skipped_files: list[str]
    task: str
    columns: list[str]
    seconds: float
    extra: JsonObject = field(default_factory=dict)  # the metadata given: any JSON-able facts

    def as_dict(self) -> JsonObject:
        """The result as ``splitvit data prepare --json`` reports it."""
        return {**self.__dict__, "shards": [s.to_dict() for s in self.shards]}


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


def _numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class DetectionRow(TypedDict):
    """A detection item's values of :data:`DETECTION_COLUMNS`, in that order (``scale``,
    ``original_size``: ``None`` unless letterboxed)."""

    boxes: list[list[float]]
    labels: list[int]
    masks: list[str]
    iscrowd: list[int]
    area: list[float]
    image_id: int
    scale: float | None
    original_size: list[int] | None


def detection_row(i: int, target: dict[str, torch.Tensor], size: tuple[int, int]) -> DetectionRow:
    """Item ``i``'s detection target as the values of :data:`DETECTION_COLUMNS`; its image
    is ``size`` (height, width). Instance masks must be 0/1 and the image's size."""
    unknown = sorted(set(target) - set(DETECTION_COLUMNS))
    missing = [k for k in DETECTION_REQUIRED if k not in target]
    if unknown or missing:
        raise ValueError(
            f"item {i}: a detection target has {', '.join(DETECTION_REQUIRED)} (and scale, original_size when "
            f"letterboxed); " + (f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}")
        )
    labels = _numpy(target["labels"]).astype(np.int64).reshape(-1)
    n = len(labels)
    boxes, masks = _numpy(target["boxes"]), _numpy(target["masks"])
    if boxes.shape != (n, 4) or masks.shape != (n, *size):
        raise ValueError(
            f"item {i}: {n} labels need boxes ({n}, 4) and masks ({n}, {size[0]}, {size[1]}) (its image's size), "
            f"got {tuple(boxes.shape)} and {tuple(masks.shape)}"
        )
    if masks.size and masks.max() > 1:
        raise ValueError(f"item {i}: instance masks are 0/1, got values up to {masks.max()}")
    rles = mask_utils.encode(np.asfortranarray(masks.astype(np.uint8).transpose(1, 2, 0))) if n else []
    return {
        "boxes": boxes.astype(np.float32).tolist(),
        "labels": labels.tolist(),
        "masks": [rle["counts"].decode("ascii") for rle in rles],
        "iscrowd": _numpy(target["iscrowd"]).astype(np.uint8).reshape(-1).tolist(),
        "area": _numpy(target["area"]).astype(np.float32).reshape(-1).tolist(),
        "image_id": int(target["image_id"]),
        "scale": float(target["scale"]) if "scale" in target else None,
        "original_size": [int(v) for v in _numpy(target["original_size"])] if "original_size" in target else None,
    }


class _GroundTruth:
    """The COCO document of the detection items written, gathered as they are: a source
    that keeps its COCO ground truth (``ground_truth_document()``: a COCO file, in its
    own pixels) gives its entries for each image written, any other the items' own
    (:func:`~.coco.coco_entries`, numbered in the order written)."""

    def __init__(self, dataset: Dataset) -> None:
        own = getattr(dataset, "ground_truth_document", None)
        self.source: CocoDocument | None = own() if own is not None else None
        self.category_ids = tuple(dataset.category_ids)
        self.images: list[CocoImage] = []
        self.annotations: list[CocoAnnotation] = []
        self.categories: list[CocoCategory] = [
            {"id": cid, "name": name} for cid, name in zip(self.category_ids, dataset.categories, strict=True)
        ]
        self.source_images: dict[int, CocoImage] | None = None
        self.source_annotations: dict[int, list[CocoAnnotation]] = {}
        if self.source is None:
            return
        self.source_images = {image["id"]: image for image in self.source["images"]}
        for ann in self.source["annotations"]:
            self.source_annotations.setdefault(ann["image_id"], []).append(ann)

    def add(self, image: Any, target: dict[str, torch.Tensor]) -> None:
        """Add an item's image and annotations."""
        if self.source_images is None:
            entry, found = coco_entries(image, target, self.category_ids, len(self.annotations) + 1)
        else:
            image_id = int(target["image_id"])
            entry, found = self.source_images[image_id], self.source_annotations.get(image_id, [])
        self.images.append(entry)
        self.annotations += found

    def document(self) -> CocoDocument:
        """The COCO instances document of the images added: the source's other top-level
        keys (categories, info, licenses...) as they are, else the dataset's categories."""
        if self.source is None:
            return {"images": self.images, "annotations": self.annotations, "categories": self.categories}
        rest = {k: v for k, v in self.source.items() if k not in ("images", "annotations")}
        return {"images": self.images, "annotations": self.annotations, **rest}


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
    loader = DataLoader(
        checked, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_identity, prefetch_factor=4
    )
    yield from loader


def _existing_shards(out_uri: str, overwrite: bool) -> list[str]:
    """Shard files, ground truth and manifest already in ``out_uri``; an error unless ``overwrite``."""
    if not exists(out_uri):
        return []
    try:
        old = list_files(out_uri, (".parquet", MANIFEST, GROUND_TRUTH), recursive=False)
    except FileNotFoundError:
        return []
    old = [u for u in old if u.rsplit("/", 1)[-1].startswith("shard-") or u.endswith((MANIFEST, GROUND_TRUTH))]
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
    metadata: JsonObject | None = None,
    num_workers: int = 0,
    progress: bool = False,
) -> ShardWriteResult:
    """Write ``dataset`` (items ``(image, label | mask[, object_mask])`` or detection items
    ``(image, target dict)``) as parquet shards.

    Args:
        dataset: any map-style dataset with the item convention of ``splitvit.data``
            (a detection set also with ``categories`` and ``category_ids``).
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

    Returns the counts; ``_manifest.json`` in ``out_uri`` holds the same and the schema
    (and for detection the categories; ``_instances.json`` their COCO ground truth).
    """
    if rows_per_shard < 1 or row_group_size < 1:
        raise ValueError(f"rows_per_shard and row_group_size must be >= 1, got {rows_per_shard} and {row_group_size}")
    start = time.perf_counter()
    total = len(dataset) if limit is None else min(int(limit), len(dataset))
    if total < 1:
        raise ValueError(f"nothing to write: the dataset has {len(dataset)} items (limit {limit})")
    stale = _prepare_output(out_uri, overwrite)
    writer = _ShardWriter(out_uri, rows_per_shard, row_group_size, dataset)
    skipped_files = _write_items(writer, dataset, total, strict=strict, num_workers=num_workers, progress=progress)
    if writer.rows == 0:
        raise ValueError(f"no readable items to write to {out_uri} ({len(skipped_files)} corrupt files skipped)")
    written = [s.file for s in writer.shards]
    if writer.ground_truth is not None:
        document = json.dumps(writer.ground_truth.document(), separators=(",", ":"))
        write_bytes(join_uri(out_uri, GROUND_TRUTH), document.encode())
        written.append(GROUND_TRUTH)
    _remove_replaced(stale, written)
    manifest_uri = _write_manifest(writer, dataset, skipped_files, metadata)
    result = ShardWriteResult(
        uri=out_uri,
        manifest=manifest_uri,
        rows=writer.rows,
        shards=writer.shards,
        bytes=sum(s.bytes for s in writer.shards),
        skipped=len(skipped_files),
        skipped_files=skipped_files,
        task=writer.task or "",
        columns=list(writer.columns),
        seconds=time.perf_counter() - start,
        extra=dict(metadata or {}),
    )
    log.info(
        "wrote %d rows in %d shards to %s (%d corrupt skipped)",
        writer.rows,
        len(writer.shards),
        out_uri,
        result.skipped,
    )
    return result


def _prepare_output(out_uri: str, overwrite: bool) -> list[str]:
    """Create ``out_uri`` and remove its manifest; returns the shards, ground truth and
    manifest that were there (an error unless ``overwrite``).

    The old manifest goes first, so no reader trusts it while shards are replaced;
    old files the new set does not replace are removed only once it is complete
    (:func:`_remove_replaced`).
    """
    stale = _existing_shards(out_uri, overwrite)
    for uri in [u for u in stale if u.endswith(MANIFEST)]:
        delete_file(uri)
    makedirs(out_uri)
    return stale


class _ShardWriter:
    """Encoded items gathered into columns, written out as one parquet shard every
    ``rows_per_shard`` rows. The first item fixes the layout (task and columns)."""

    COLUMN_TYPES = {
        "image": pa.binary(),
        "label": pa.int64(),
        "mask": pa.binary(),
        "object_mask": pa.binary(),
        "boxes": pa.list_(pa.list_(pa.float32(), 4)),
        "labels": pa.list_(pa.int64()),
        "masks": pa.list_(pa.string()),
        "iscrowd": pa.list_(pa.uint8()),
        "area": pa.list_(pa.float32()),
        "image_id": pa.int64(),
        "scale": pa.float32(),
        "original_size": pa.list_(pa.int64()),
        "index": pa.int64(),
    }

    def __init__(self, out_uri: str, rows_per_shard: int, row_group_size: int, dataset: Dataset) -> None:
        self.out_uri = out_uri
        self.dataset = dataset
        self.fs, self.base = filesystem_for(out_uri)
        self.rows_per_shard, self.row_group_size = rows_per_shard, row_group_size
        self.columns: dict[str, list] = {}
        self.task: str | None = None
        self.image_size: tuple[int, int] | None = None
        self.ground_truth: _GroundTruth | None = None  # detection: the COCO document of the images written
        self.shards: list[ShardFile] = []
        self.rows = 0

    def add(self, i: int, item: tuple) -> None:
        """Encode item ``i`` (``(image, label | mask[, object_mask])`` or ``(image, target
        dict)``) as a row; write a shard when one is full."""
        image, target = item[0], item[1]
        png, size = _image_png(image)
        if isinstance(target, dict):
            kind = "detection"
        else:
            kind = "classification" if np.ndim(target) == 0 else "segmentation"
        self._check_layout(i, kind, size, has_object_mask=len(item) > 2)
        self.columns["image"].append(png)
        if kind == "detection":
            for key, value in detection_row(i, target, size).items():
                self.columns[key].append(value)
            self.ground_truth.add(image, target)
        elif kind == "classification":
            self.columns["label"].append(int(target))
        else:
            self.columns["mask"].append(_mask_png(target, "mask"))
        if "object_mask" in self.columns:
            self.columns["object_mask"].append(_mask_png(item[2], "object mask"))
        self.columns["index"].append(int(i))
        self.rows += 1
        if len(self.columns["image"]) >= self.rows_per_shard:
            self.flush()

    def _check_layout(self, i: int, kind: str, size: tuple[int, int], *, has_object_mask: bool) -> None:
        """Take the first item's layout; raise on an item whose layout differs."""
        if self.task is None:
            if kind == "detection" and has_object_mask:
                raise ValueError(f"item {i}: a detection item is (image, target dict), got more fields")
            self.task, self.image_size = kind, size
            targets = {"classification": ["label"], "segmentation": ["mask"], "detection": list(DETECTION_COLUMNS)}
            self.columns = {"image": [], **{k: [] for k in targets[kind]}, "index": []}
            if has_object_mask:
                self.columns["object_mask"] = []
            if kind == "detection":
                self.ground_truth = _GroundTruth(self.dataset)
        elif kind != self.task or has_object_mask != ("object_mask" in self.columns):
            raise ValueError(
                f"item {i} does not match the first item's layout ({self.task}, {len(self.columns) - 1} fields)"
            )
        elif kind == "detection" and size != self.image_size:
            # one canvas for every item: batches stack them, and the reader checks the model's size against it
            raise ValueError(
                f"item {i}: image is {size[1]}x{size[0]}, the first item's {self.image_size[1]}x{self.image_size[0]}; "
                "detection shards hold one canvas size (the dataset's image_size)"
            )

    def flush(self) -> None:
        """Write the rows gathered so far as the next shard (nothing when there are none)."""
        if not self.columns.get("image"):
            return
        name = SHARD_PATTERN.format(len(self.shards))
        table = pa.table({k: pa.array(v, type=self.COLUMN_TYPES[k]) for k, v in self.columns.items()})
        path = f"{self.base.rstrip('/')}/{name}"
        try:
            pq.write_table(
                table,
                path,
                filesystem=self.fs,
                row_group_size=self.row_group_size,
                use_dictionary=[c for c in ("label", "index") if c in self.columns],
                compression="snappy",
            )
            size = self.fs.get_file_info(path).size
        except OSError as exc:
            raise StorageError(f"{join_uri(self.out_uri, name)}: writing the shard failed: {exc}") from exc
        self.shards.append(ShardFile(name, table.num_rows, int(size or 0)))
        log.info("wrote %s (%d rows)", join_uri(self.out_uri, name), table.num_rows)
        self.columns = {k: [] for k in self.columns}


def _write_items(
    writer: _ShardWriter, dataset: Dataset, total: int, *, strict: bool, num_workers: int, progress: bool
) -> list[str]:
    """Load the first ``total`` items of ``dataset`` and write them with ``writer``;
    returns the corrupt files skipped (``strict``: the first one raises instead)."""
    skipped_files: list[str] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"shards -> {writer.out_uri}", unit="img")
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
        writer.add(i, item)
    writer.flush()
    if bar is not None:
        bar.close()
    return skipped_files


def _remove_replaced(stale: list[str], written: list[str]) -> None:
    """Delete the old files (shards, ground truth) the new set did not overwrite (the old manifest is gone already)."""
    for uri in stale:
        if not uri.endswith(MANIFEST) and uri.replace(os.sep, "/").rsplit("/", 1)[-1] not in written:
            delete_file(uri)


def _write_manifest(
    writer: _ShardWriter, dataset: Dataset, skipped_files: list[str], metadata: JsonObject | None
) -> str:
    """Write ``_manifest.json`` (written last: its presence means the set is complete); returns its URI."""
    columns = writer.columns
    manifest = {
        "format": FORMAT,
        "task": writer.task,
        "num_rows": writer.rows,
        "image_size": list(writer.image_size or ()),
        "num_classes": getattr(dataset, "num_classes", None),
        "classes": list(getattr(dataset, "classes", None) or []) or None,
        "columns": list(columns),
        "schema": {
            "image": "binary PNG RGB",
            "label": "int64",
            "mask": "binary PNG L class ids (255 = ignore)",
            "object_mask": "binary PNG L 0/1",
            "boxes": "list<fixed_size_list<float32, 4>> x1, y1, x2, y2 in the image's pixels",
            "labels": "list<int64> 1..K (category_ids[k - 1] is label k's COCO category id)",
            "masks": "list<string> COCO compressed RLE of each instance mask, the image's size",
            "iscrowd": "list<uint8>",
            "area": "list<float32> the source's (COCO's evaluation reads it)",
            "image_id": "int64 COCO image id",
            "scale": "float32 letterbox scale (null: not letterboxed)",
            "original_size": "list<int64> the file's height, width (null: not letterboxed)",
            "index": "int64 index in the source dataset",
        },
        "shards": [s.to_dict() for s in writer.shards],
        "skipped": len(skipped_files),
        "skipped_files": skipped_files,
        **(metadata or {}),
    }
    manifest["schema"] = {k: v for k, v in manifest["schema"].items() if k in columns}
    if writer.ground_truth is not None:
        manifest["categories"] = list(dataset.categories)
        manifest["category_ids"] = [int(c) for c in dataset.category_ids]
        manifest["ground_truth"] = GROUND_TRUTH
    manifest_uri = join_uri(writer.out_uri, MANIFEST)
    write_bytes(manifest_uri, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
    return manifest_uri
