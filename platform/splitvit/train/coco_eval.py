"""COCO's own evaluation (pycocotools ``COCOeval``) of a detector's boxes and masks.

:func:`coco_evaluate` scores detections against a COCO-format ground truth: box and
mask AP, AP50, AP75, AP by object size and AP per class. Detections are plain
per-image records (:func:`detection_records`), so the workers of a distributed
evaluation can gather them and one process evaluates them once: the figures do not
depend on how the images were split or ordered.

COCO's size ranges (small < 32², medium < 96² pixels) suit photographs of about
640 px; on small canvases nearly every object would be "large". The ranges are
therefore a parameter, stated in every result (``area_ranges``): COCO's by default,
and :func:`area_ranges_for` scales them to a canvas.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NotRequired, Required, TypedDict

import numpy as np
import torch

if TYPE_CHECKING:
    from ..data.coco_format import CocoDocument

#: COCO's object-size ranges, in pixels of area (``COCOeval.Params``).
COCO_AREA_RANGES: dict[str, tuple[float, float]] = {"small": (0.0, 32.0**2), "medium": (32.0**2, 96.0**2)}
#: The side COCO's ranges were drawn for (a COCO image's longer side is at most 640 px).
COCO_REFERENCE_SIDE = 640
#: The summary figures, in COCOeval.stats' order.
SUMMARY_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
IOU_TYPES = ("bbox", "segm")


# pycocotools' own formats: typed dicts, since they go to pycocotools (and across workers) as they are
class CocoRecord(TypedDict):
    """One detection in COCO's result format (``loadRes``)."""

    image_id: int
    category_id: int
    bbox: list[float]  # x, y, width, height in the image file's pixels
    score: float
    segmentation: NotRequired[dict[str, list[int] | str]]  # the mask's run-length encoding: size, counts


class CocoFigures(TypedDict):
    """One IoU type's figures: ``COCOeval``'s summary (0-1; -1 where there is nothing to
    score) and AP per category name."""

    AP: float
    AP50: float
    AP75: float
    APs: float
    APm: float
    APl: float
    per_class: dict[str, float]


class CocoResult(TypedDict, total=False):
    """What :func:`coco_evaluate` returns: the size ranges used (pixels of area; large has
    no upper bound), the images and detections evaluated, and each IoU type's figures."""

    area_ranges: Required[dict[str, list[float | None]]]
    images: Required[int]
    detections: Required[int]
    bbox: CocoFigures
    segm: CocoFigures


def area_ranges_for(image_side: int) -> dict[str, tuple[float, float]]:
    """COCO's small and medium ranges scaled from a 640-px image to ``image_side`` pixels
    (area scales with the side squared); large is everything above medium."""
    if image_side <= 0:
        raise ValueError(f"image_side must be positive, got {image_side}")
    scale = (image_side / COCO_REFERENCE_SIDE) ** 2
    return {name: (low * scale, high * scale) for name, (low, high) in COCO_AREA_RANGES.items()}


def detection_records(
    image_ids: Sequence[int], outputs: Sequence[Mapping[str, torch.Tensor]], label_to_category: Sequence[int]
) -> list[CocoRecord]:
    """COCO result records (``loadRes`` format) from a detector's per-image outputs.

    Args:
        image_ids: the COCO image id of each output.
        outputs: torchvision's detection format: ``boxes`` ``[N, 4]`` xyxy pixels,
            ``labels`` ``[N]`` (1..K), ``scores`` ``[N]``, optionally ``masks``
            ``[N, 1, H, W]`` or ``[N, H, W]`` probabilities (thresholded at 0.5).
        label_to_category: the COCO category id of label ``k`` at index ``k``
            (index 0, the background, unused).
    """
    from pycocotools import mask as mask_utils

    if len(image_ids) != len(outputs):
        raise ValueError(f"{len(image_ids)} image ids for {len(outputs)} outputs")
    records: list[CocoRecord] = []
    for image_id, out in zip(image_ids, outputs):
        boxes = out["boxes"].detach().float().cpu()
        labels = out["labels"].detach().cpu().tolist()
        scores = out["scores"].detach().float().cpu().tolist()
        masks = out.get("masks")
        if masks is not None:
            masks = masks.detach().cpu()
            if masks.dim() == 4:
                masks = masks[:, 0]
            binary = np.asfortranarray((masks > 0.5).numpy().astype(np.uint8).transpose(1, 2, 0))
            rles = mask_utils.encode(binary) if len(labels) else []
        for i, (label, score) in enumerate(zip(labels, scores)):
            if not 0 < label < len(label_to_category):
                raise ValueError(f"detection label {label} outside 1..{len(label_to_category) - 1}")
            x0, y0, x1, y1 = boxes[i].tolist()
            record: CocoRecord = {
                "image_id": int(image_id),
                "category_id": int(label_to_category[label]),
                "bbox": [x0, y0, x1 - x0, y1 - y0],
                "score": float(score),
            }
            if masks is not None:
                rle = dict(rles[i])
                rle["counts"] = rle["counts"].decode("ascii")
                record["segmentation"] = rle
            records.append(record)
    return records


def load_ground_truth(annotation_file: str | CocoDocument) -> Any:
    """pycocotools' ``COCO`` index of a COCO-format file (a path) or an already-read
    document, without its console lines."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        if isinstance(annotation_file, dict):
            gt = COCO()
            gt.dataset = annotation_file
            gt.createIndex()
            return gt
        return COCO(str(annotation_file))


def coco_evaluate(
    ground_truth: Any,
    records: Iterable[CocoRecord],
    *,
    image_ids: Sequence[int] | None = None,
    area_ranges: Mapping[str, tuple[float, float]] | None = None,
    iou_types: Sequence[str] = IOU_TYPES,
) -> CocoResult:
    """Box and mask AP of ``records`` against ``ground_truth`` (a ``COCO`` index).

    Returns ``{iou_type: {"AP", "AP50", "AP75", "APs", "APm", "APl", "per_class":
    {category name: AP}}, "area_ranges": {...}, "images": n, "detections": n}``, AP
    on COCO's 0-1 scale; ``-1`` where COCO has nothing to score (no object of that
    size, say). ``image_ids``: the images evaluated (default: all of the ground
    truth's), so images with no detection count as misses. ``segm`` needs
    ``segmentation`` in the records.
    """
    for iou_type in iou_types:
        if iou_type not in IOU_TYPES:
            raise ValueError(f"iou type must be one of {IOU_TYPES}, got {iou_type!r}")
    ranges = dict(area_ranges or COCO_AREA_RANGES)
    if set(ranges) != {"small", "medium"} or not ranges["small"][1] <= ranges["medium"][0] + 1e-9:
        raise ValueError(f"area_ranges must give small below medium, got {ranges}")
    records = sorted((CocoRecord(**r) for r in records), key=lambda r: (r["image_id"], -r["score"], r["category_id"]))
    ids = sorted(int(i) for i in (image_ids if image_ids is not None else ground_truth.getImgIds()))
    names = {c["id"]: c["name"] for c in ground_truth.loadCats(ground_truth.getCatIds())}
    result: CocoResult = {
        "area_ranges": {
            "small": [ranges["small"][0], ranges["small"][1]],
            "medium": [ranges["medium"][0], ranges["medium"][1]],
            "large": [ranges["medium"][1], None],  # no upper bound (None: JSON has no infinity)
        },
        "images": len(ids),
        "detections": len(records),
    }
    for iou_type in iou_types:
        if iou_type == "segm" and any("segmentation" not in r for r in records):
            raise ValueError("segm evaluation needs a segmentation (mask) in every detection record")
        result[iou_type] = _evaluate_one(ground_truth, records, ids, ranges, iou_type, names)
    return result


def _evaluate_one(gt, records, image_ids, ranges, iou_type, names) -> CocoFigures:
    """One ``COCOeval`` run: the summary figures and AP per category."""
    from pycocotools.cocoeval import COCOeval

    if not records:  # loadRes cannot index an empty list: nothing detected scores 0 where there are objects
        return _empty_result(gt, image_ids, ranges, names)
    with contextlib.redirect_stdout(io.StringIO()):
        detections = gt.loadRes([dict(r) for r in records])  # loadRes adds fields to the records it gets
        evaluator = COCOeval(gt, detections, iou_type)
        evaluator.params.imgIds = list(image_ids)
        evaluator.params.areaRng = [
            [0.0, 1e10],
            [ranges["small"][0], ranges["small"][1]],
            [ranges["medium"][0], ranges["medium"][1]],
            [ranges["medium"][1], 1e10],
        ]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    # precision: [iou thresholds, recall points, categories, area ranges, max dets]; area "all", 100 dets
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    per_class = {}
    for k, category in enumerate(evaluator.params.catIds):
        values = precision[:, :, k]
        values = values[values > -1]
        per_class[names[category]] = float(values.mean()) if values.size else -1.0
    summary = {key: float(value) for key, value in zip(SUMMARY_KEYS, evaluator.stats[:6])}
    return CocoFigures(**summary, per_class=per_class)


def _empty_result(gt, image_ids, ranges, names) -> CocoFigures:
    """The figures of no detections at all: 0 where the ground truth has objects to find
    (crowds aside), -1 where it has none, as COCOeval reports."""
    anns = [a for a in gt.loadAnns(gt.getAnnIds(imgIds=list(image_ids))) if not a.get("iscrowd", 0)]
    areas = [a["area"] for a in anns]

    def some(low: float, high: float) -> float:
        return 0.0 if any(low <= area < high for area in areas) else -1.0

    present = {a["category_id"] for a in anns}
    return CocoFigures(
        AP=some(0, 1e10),
        AP50=some(0, 1e10),
        AP75=some(0, 1e10),
        APs=some(*ranges["small"]),
        APm=some(*ranges["medium"]),
        APl=some(ranges["medium"][1], 1e10),
        per_class={names[c]: (0.0 if c in present else -1.0) for c in sorted(names)},
    )
