"""COCO-format instance annotations (detection and instance masks), local or ``s3://``.

:func:`load_coco_index` reads and checks the whole annotation file up front, so a
malformed file fails with one :class:`CocoFormatError` naming the file and the id
before any image is read. :class:`CocoDetection` serves ``(image, target)`` items in
torchvision's detection format; segmentations (polygons, uncompressed and compressed
RLE) become masks through ``pycocotools.mask``, the field's own reader, and the
annotation file stays the ground truth that COCO's evaluation (``COCOeval``) loads.

Labels are contiguous ``1..K`` in sorted category-id order (0 is the background,
torchvision's convention). Crowd annotations stay in the target with ``iscrowd=1``:
COCO's evaluation ignores detections on crowd regions, training drops them.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from pycocotools import mask as mask_utils

from ..jsontypes import JsonObject
from ..storage import is_s3, join_uri, list_files, read_bytes
from .coco_format import (
    REQUIRED_KEYS,
    CocoAnnotation,
    CocoDocument,
    CocoImage,
    coco_entries_of,
    coco_error,
    parse_coco_document,
)
from .coco_format import CocoFormatError as CocoFormatError  # raised here; imported from here too
from .common import CorruptDataError, SkippingDataset, decode_image, image_to_tensor, pil_resample

log = logging.getLogger(__name__)

#: Rounding slack (pixels) allowed when a bbox reaches past its image's edge.
BBOX_SLACK = 1.0


@dataclass
class CocoIndex:
    """A checked COCO instances file: images by id, their annotations, the label map.

    ``dataset`` is the parsed JSON itself (what ``pycocotools.coco.COCO`` holds, and what
    :func:`splitvit.train.coco_eval.load_ground_truth` takes: an ``s3://`` file is read
    once), the other fields index into it.
    """

    annotation_file: str
    dataset: CocoDocument
    images: dict[int, CocoImage]  # image id -> its entry in "images"
    annotations: dict[int, list[CocoAnnotation]] = field(repr=False)  # image id -> its annotations, in file order
    category_ids: tuple[int, ...] = ()  # COCO category ids in label order (label k = category_ids[k - 1])
    categories: tuple[str, ...] = ()  # category names in label order

    @property
    def label_of(self) -> dict[int, int]:
        """COCO category id -> contiguous label ``1..K``."""
        return {cid: k + 1 for k, cid in enumerate(self.category_ids)}


_fail = coco_error
_entries = coco_entries_of


def _require(entry: JsonObject, keys: tuple[str, ...], where: str, source: str) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise _fail(source, f"{where} lacks {', '.join(repr(k) for k in missing)}")


def _check_segmentation(seg: Any, height: int, width: int, where: str, source: str) -> None:
    """Polygons need >= 3 points; RLE must be the image's size (and, uncompressed, sum to its pixels)."""
    if isinstance(seg, list):
        if not seg:
            raise _fail(source, f"{where}: empty segmentation (no polygons)")
        for p, polygon in enumerate(seg):
            if not isinstance(polygon, list) or len(polygon) % 2 or len(polygon) < 6:
                n = f"{len(polygon)} coordinates" if isinstance(polygon, list) else f"a {type(polygon).__name__}"
                raise _fail(source, f"{where}: polygon {p} has {n}; a polygon is [x1, y1, x2, y2, ...] of >= 3 points")
        return
    if isinstance(seg, dict) and "size" in seg and "counts" in seg:
        size = list(seg["size"]) if isinstance(seg["size"], list | tuple) else seg["size"]
        if size != [height, width]:
            raise _fail(
                source, f"{where}: RLE mask size {size} differs from its image's [height, width] {[height, width]}"
            )
        counts = seg["counts"]
        if isinstance(counts, list):
            total = sum(counts)
            if total != height * width:
                raise _fail(
                    source,
                    f"{where}: uncompressed RLE counts cover {total} pixels, its {width}x{height} image has "
                    f"{height * width}",
                )
        elif not isinstance(counts, str | bytes):
            raise _fail(source, f"{where}: RLE counts must be a list (uncompressed) or a string (compressed)")
        return
    raise _fail(source, f"{where}: segmentation must be a list of polygons or an RLE {{size, counts}}")


def _check_bbox(bbox: Any, height: int, width: int, where: str, source: str) -> None:
    if not (isinstance(bbox, list | tuple) and len(bbox) == 4 and all(isinstance(v, int | float) for v in bbox)):
        raise _fail(source, f"{where}: bbox must be [x, y, width, height], got {bbox!r}")
    x, y, w, h = bbox
    if w <= 0 or h <= 0:
        raise _fail(source, f"{where}: bbox {list(bbox)} has a width or height <= 0")
    s = BBOX_SLACK
    if x < -s or y < -s or x + w > width + s or y + h > height + s:
        raise _fail(
            source,
            f"{where}: bbox {list(bbox)} (x, y, w, h) lies outside its {width}x{height} image (width x height) "
            f"by more than {BBOX_SLACK:g} px",
        )


def _files_under(image_root: str) -> set[str]:
    """Every file under ``image_root`` as a path relative to it (one listing)."""
    files = list_files(image_root)
    base = image_root.rstrip("/") if is_s3(image_root) else os.path.abspath(os.path.expanduser(image_root))
    return {f[len(base) + 1 :].replace(os.sep, "/") for f in files}


def load_coco_index(annotation_file: str | os.PathLike, image_root: str | os.PathLike | None = None) -> CocoIndex:
    """Read and check a COCO instances file (local or ``s3://``), all of it, before any image is read.

    With ``image_root`` (local or ``s3://``), every image's ``file_name`` must be a file
    under it (one listing of the folder). Raises :class:`CocoFormatError`, one line that
    names the file and the offending id, for: malformed JSON, a missing top-level key,
    duplicate image, annotation or category ids, an annotation naming an unknown image
    or category, a bbox outside its image (1 px of rounding allowed) or not positive in
    size, a polygon of fewer than 3 points, an RLE mask of the wrong size, and an image
    missing from ``image_root``.
    """
    source = str(annotation_file)
    data = parse_coco_document(read_bytes(source), source)  # the shape: what the early check reads
    image_list, ann_list, cat_list = (_entries(data, key, source) for key in REQUIRED_KEYS)

    names: dict[int, str] = {}
    for c, cat in enumerate(cat_list):
        _require(cat, ("id", "name"), f"categories[{c}]", source)
        if cat["id"] in names:
            raise _fail(source, f"category id {cat['id']} appears twice in categories")
        names[cat["id"]] = str(cat["name"])
    category_ids = tuple(sorted(names))

    images: dict[int, CocoImage] = {}
    for i, img in enumerate(image_list):
        _require(img, ("id", "file_name", "width", "height"), f"images[{i}]", source)
        if img["id"] in images:
            raise _fail(source, f"image id {img['id']} appears twice in images")
        if not all(isinstance(img[k], int) and img[k] > 0 for k in ("width", "height")):
            raise _fail(source, f"image id {img['id']}: width and height must be positive integers")
        images[img["id"]] = cast(CocoImage, img)  # its keys checked just above

    annotations: dict[int, list[CocoAnnotation]] = {image_id: [] for image_id in images}
    seen: set[Any] = set()
    for a, ann in enumerate(ann_list):
        _require(ann, ("id",), f"annotations[{a}]", source)
        where = f"annotation id {ann['id']}"
        if ann["id"] in seen:
            raise _fail(source, f"{where} appears twice in annotations")
        seen.add(ann["id"])
        _require(ann, ("image_id", "category_id", "bbox", "segmentation"), where, source)
        image = images.get(ann["image_id"])
        if image is None:
            raise _fail(source, f"{where} names image id {ann['image_id']}, which is not in images")
        where = f"annotation id {ann['id']} (image id {ann['image_id']})"
        if ann["category_id"] not in names:
            raise _fail(source, f"{where} names category id {ann['category_id']}, which is not in categories")
        _check_bbox(ann["bbox"], image["height"], image["width"], where, source)
        _check_segmentation(ann["segmentation"], image["height"], image["width"], where, source)
        annotations[ann["image_id"]].append(cast(CocoAnnotation, ann))  # its keys checked above

    if image_root is not None:
        present = _files_under(str(image_root))
        missing = [i for i, img in images.items() if posixpath.normpath(str(img["file_name"])) not in present]
        if missing:
            first = images[missing[0]]
            raise _fail(
                source,
                f"image id {missing[0]}: file {first['file_name']!r} is not in {image_root} "
                f"({len(missing)} of {len(images)} listed images missing)",
            )
    log.info("COCO %s: %d images, %d annotations, %d categories", source, len(images), len(ann_list), len(category_ids))
    return CocoIndex(
        annotation_file=source,
        dataset=cast(CocoDocument, data),  # every entry checked above
        images=images,
        annotations=annotations,
        category_ids=category_ids,
        categories=tuple(names[c] for c in category_ids),
    )


def letterbox(
    target: dict[str, torch.Tensor], scale: float, size: tuple[int, int], canvas: int
) -> dict[str, torch.Tensor]:
    """``target`` (an image of ``(height, width)`` pixels) on a ``canvas`` square: the image
    scaled by ``scale`` into its top-left corner, zero padding beside it. Boxes scale,
    masks are resized (nearest) and padded; ``area`` stays the file's (COCO's evaluation
    runs in the file's pixels: :func:`splitvit.train.detection.to_original_pixels` maps
    detections back); ``scale`` and ``original_size`` say how."""
    height, width = size
    inner = (max(1, round(height * scale)), max(1, round(width * scale)))
    masks = target["masks"]
    padded = torch.zeros((len(masks), canvas, canvas), dtype=torch.uint8)
    if len(masks):  # an image without objects has nothing to resize (and its (0, h, w) would not fit)
        masks = torch.nn.functional.interpolate(masks[:, None].float(), size=inner, mode="nearest")[:, 0]
        padded[:, : inner[0], : inner[1]] = masks.to(torch.uint8)
    boxes = (target["boxes"] * scale).clamp(min=0)
    boxes = torch.minimum(boxes, torch.tensor([inner[1], inner[0], inner[1], inner[0]], dtype=boxes.dtype))
    return {**target, "boxes": boxes, "masks": padded}


def annotation_mask(segmentation: Any, height: int, width: int) -> np.ndarray:
    """A segmentation (polygons, uncompressed or compressed RLE) as a uint8 ``(height, width)`` 0/1 mask."""
    if isinstance(segmentation, list):  # polygons: one RLE each, merged
        rle = mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    elif isinstance(segmentation["counts"], list):  # uncompressed RLE
        rle = mask_utils.frPyObjects(segmentation, height, width)
    else:
        rle = segmentation
    return mask_utils.decode(rle)


def coco_entries(
    image: torch.Tensor,
    target: dict[str, torch.Tensor],
    category_ids: Sequence[int],
    first_annotation_id: int,
    file_name: str | None = None,
) -> tuple[CocoImage, list[CocoAnnotation]]:
    """One item (in :class:`CocoDetection`'s format) as COCO instances entries: its image
    (``file_name`` default ``<image_id>.png``, the image's own width and height) and its
    annotations (bbox x, y, w, h from the boxes; area = mask pixels; segmentation =
    compressed RLE; category id of label ``k`` = ``category_ids[k - 1]``), numbered from
    ``first_annotation_id`` (COCOeval reads id 0 as "unmatched": start at 1)."""
    image_id = int(target["image_id"])
    height, width = image.shape[-2:]
    entry: CocoImage = {
        "id": image_id,
        "file_name": file_name or f"{image_id:06d}.png",
        "width": int(width),
        "height": int(height),
    }
    annotations: list[CocoAnnotation] = []
    for box, label, mask, crowd in zip(
        target["boxes"].tolist(), target["labels"].tolist(), target["masks"].numpy(), target["iscrowd"].tolist()
    ):
        rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
        x1, y1, x2, y2 = box
        annotations.append(
            {
                "id": first_annotation_id + len(annotations),
                "image_id": image_id,
                "category_id": int(category_ids[int(label) - 1]),
                "bbox": [x1, y1, x2 - x1, y2 - y1],
                "area": int(mask.sum()),
                "segmentation": {"size": rle["size"], "counts": rle["counts"].decode("ascii")},
                "iscrowd": int(crowd),
            }
        )
    return entry, annotations


def empty_target(image_id: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """The target of an image without objects: every field with zero rows and its right shape."""
    return {
        "boxes": torch.zeros((0, 4), dtype=torch.float32),
        "labels": torch.zeros((0,), dtype=torch.int64),
        "masks": torch.zeros((0, height, width), dtype=torch.uint8),
        "iscrowd": torch.zeros((0,), dtype=torch.uint8),
        "area": torch.zeros((0,), dtype=torch.float32),
        "image_id": torch.tensor(image_id, dtype=torch.int64),
    }


class CocoDetection(SkippingDataset):
    """Images and instance annotations of a COCO instances file, local or ``s3://``.

    Items are ``(image, target)``: ``image`` float32 ``(3, H, W)`` in [0, 1] (grayscale
    and RGBA files converted to RGB), ``target`` a dict of ``boxes`` float32 ``(N, 4)``
    (x1, y1, x2, y2 in pixels, clipped to the image), ``labels`` int64 ``(N,)`` in
    ``1..K``, ``masks`` uint8 ``(N, H, W)``, ``iscrowd`` uint8 ``(N,)``, ``area``
    float32 ``(N,)`` (the file's ``area``, which COCO's evaluation uses; the mask's
    pixel count where the file has none) and ``image_id`` int64. Images are in
    ascending id order; an image without annotations is a valid background item.

    A file that PIL cannot read, or whose size differs from the annotation file's, is
    corrupt data: skipped and counted (``skipped``, ``skipped_files``), or raised as
    ``CorruptDataError`` with ``strict=True``, as for every file-backed dataset.

    With ``image_size`` (a model's square canvas), an image of another size is
    letterboxed, as detection models' loaders do: scaled so that its longer side fills
    the canvas (``interpolation``), in the top-left corner, zero padding beside it; its
    boxes and masks follow (:func:`letterbox`). Such an item carries ``scale`` and
    ``original_size`` (height, width), with which evaluation maps detections back to the
    file's pixels, where COCO's own evaluation compares them with the annotations.

    Attributes:
        annotation_file: the annotation file, for ``COCO(annotation_file)`` / ``COCOeval``.
        categories: category names in label order (label k is ``categories[k - 1]``).
        category_ids: COCO category ids in label order (to write detections back as COCO results).
        num_classes: K + 1 (with the background, torchvision's convention).
        image_ids: the COCO image id of each item, ascending.
        index: the checked :class:`CocoIndex`.
    """

    def __init__(
        self,
        annotation_file: str | os.PathLike,
        image_root: str | os.PathLike,
        *,
        image_size: int | None = None,
        interpolation: str = "bilinear",
        strict: bool = False,
    ) -> None:
        super().__init__(strict=strict)
        self.image_root = str(image_root)
        self.index = load_coco_index(annotation_file, self.image_root)
        if not any(self.index.annotations.values()):
            # nothing to learn from or to evaluate against: a detector "trained" on it
            # ran to exit 0 without a word
            raise _fail(
                self.index.annotation_file,
                f"has no annotations (its {len(self.index.images)} images have no objects): "
                "nothing to train on or evaluate against; is it an image-info file, or the wrong split's?",
            )
        self.image_size = image_size
        self.resample = pil_resample(interpolation)
        self.annotation_file = self.index.annotation_file
        self.categories = self.index.categories
        self.category_ids = self.index.category_ids
        self.num_classes = len(self.categories) + 1
        self.image_ids = sorted(self.index.images)
        self._label_of = self.index.label_of

    def ground_truth_document(self) -> CocoDocument:
        """The annotation file's document: COCO's ground truth of this set, in the file's pixels."""
        return self.index.dataset

    def raw_len(self) -> int:
        return len(self.image_ids)

    def load_raw(self, raw_index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image_id = self.image_ids[raw_index]
        entry = self.index.images[image_id]
        height, width = entry["height"], entry["width"]
        source = join_uri(self.image_root, entry["file_name"])
        try:
            data = read_bytes(source)
        except OSError as exc:
            raise CorruptDataError(source, str(exc)) from None
        img = decode_image(data, source)
        if img.size != (width, height):  # the masks would not line up with the pixels
            raise CorruptDataError(
                source, f"image is {img.size[0]}x{img.size[1]}, the annotation file says {width}x{height}"
            )
        target = self.target(image_id)
        canvas = self.image_size
        if canvas is None or (width, height) == (canvas, canvas):
            return image_to_tensor(img), target
        scale = canvas / max(width, height)
        inner = (max(1, round(width * scale)), max(1, round(height * scale)))
        image = torch.zeros((3, canvas, canvas), dtype=torch.float32)
        image[:, : inner[1], : inner[0]] = image_to_tensor(img.resize(inner, self.resample))
        boxed = letterbox(target, scale, (height, width), canvas)
        return image, {**boxed, "scale": torch.tensor(scale), "original_size": torch.tensor([height, width])}

    def target(self, image_id: int) -> dict[str, torch.Tensor]:
        """The target of image ``image_id`` (no pixels read)."""
        entry = self.index.images[image_id]
        height, width = entry["height"], entry["width"]
        anns = self.index.annotations[image_id]
        if not anns:
            return empty_target(image_id, height, width)
        masks = np.stack([annotation_mask(a["segmentation"], height, width) for a in anns])
        xywh = np.asarray([a["bbox"] for a in anns], dtype=np.float64)
        boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
        boxes = np.clip(boxes, 0, [width, height, width, height])  # the 1 px of rounding a bbox may have
        area = [float(a["area"]) if "area" in a else float(m.sum()) for a, m in zip(anns, masks, strict=True)]
        return {
            "boxes": torch.from_numpy(boxes.astype(np.float32)),
            "labels": torch.tensor([self._label_of[a["category_id"]] for a in anns], dtype=torch.int64),
            "masks": torch.from_numpy(masks.astype(np.uint8)),
            "iscrowd": torch.tensor([int(a.get("iscrowd", 0)) for a in anns], dtype=torch.uint8),
            "area": torch.tensor(area, dtype=torch.float32),
            "image_id": torch.tensor(image_id, dtype=torch.int64),
        }
