"""COCO's own evaluation (pycocotools) of detections: exact on hand-made ground truth,
independent of how detections were split across workers, crowd regions ignored."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from splitvit.train.coco_eval import (
    area_ranges_for,
    coco_evaluate,
    detection_records,
    load_ground_truth,
)

SIDE = 64


def _mask(box: tuple[int, int, int, int]) -> np.ndarray:
    x0, y0, x1, y1 = box
    m = np.zeros((SIDE, SIDE), dtype=np.uint8)
    m[y0:y1, x0:x1] = 1
    return m


def _ground_truth() -> dict:
    """Three images: two objects, one object plus a crowd region, and background only.
    Categories 3 ("cat") and 7 ("dog"): COCO ids need not be contiguous."""
    from pycocotools import mask as mask_utils

    objects = {
        1: [(3, (4, 4, 20, 20), 0), (7, (30, 30, 62, 62), 0)],
        2: [(3, (10, 10, 18, 18), 0), (7, (40, 0, 64, 24), 1)],
        3: [],
    }
    annotations, next_id = [], 1
    for image_id, items in objects.items():
        for category, box, crowd in items:
            rle = mask_utils.encode(np.asfortranarray(_mask(box)))
            rle["counts"] = rle["counts"].decode("ascii")
            x0, y0, x1, y1 = box
            annotations.append(
                {
                    "id": next_id,
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": float((x1 - x0) * (y1 - y0)),
                    "segmentation": rle,
                    "iscrowd": crowd,
                }
            )
            next_id += 1
    return {
        "images": [{"id": i, "width": SIDE, "height": SIDE, "file_name": f"{i}.png"} for i in objects],
        "annotations": annotations,
        "categories": [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}],
    }


LABEL_TO_CATEGORY = [0, 3, 7]  # label 1 -> cat (3), label 2 -> dog (7)


def _output(items: list[tuple[int, tuple[int, int, int, int], float]]) -> dict[str, torch.Tensor]:
    """A detector's output for one image: (label, box, score) per detection, masks as boxes."""
    if not items:
        return {
            "boxes": torch.zeros(0, 4),
            "labels": torch.zeros(0, dtype=torch.int64),
            "scores": torch.zeros(0),
            "masks": torch.zeros(0, 1, SIDE, SIDE),
        }
    return {
        "boxes": torch.tensor([list(box) for _, box, _ in items], dtype=torch.float32),
        "labels": torch.tensor([label for label, _, _ in items]),
        "scores": torch.tensor([score for _, _, score in items]),
        "masks": torch.stack([torch.from_numpy(_mask(box)).float()[None] * 0.9 for _, box, _ in items]),
    }


def test_perfect_detections_score_one_and_a_detection_on_a_crowd_is_not_a_false_positive():
    gt = load_ground_truth(_ground_truth())
    outputs = {
        1: _output([(1, (4, 4, 20, 20), 0.9), (2, (30, 30, 62, 62), 0.8)]),
        2: _output([(1, (10, 10, 18, 18), 0.7), (2, (40, 0, 64, 24), 0.95)]),  # the second lies on the crowd
        3: _output([]),
    }
    records = detection_records(list(outputs), list(outputs.values()), LABEL_TO_CATEGORY)
    assert len(records) == 4 and {r["category_id"] for r in records} == {3, 7}
    figures = coco_evaluate(gt, records)
    for iou_type in ("bbox", "segm"):
        assert figures[iou_type]["AP"] == pytest.approx(1.0)
        assert figures[iou_type]["AP50"] == pytest.approx(1.0) and figures[iou_type]["AP75"] == pytest.approx(1.0)
        assert figures[iou_type]["per_class"] == pytest.approx({"cat": 1.0, "dog": 1.0})
    assert figures["images"] == 3 and figures["detections"] == 4


def test_a_missed_object_and_a_false_positive_lower_ap_and_show_in_the_class_figures():
    gt = load_ground_truth(_ground_truth())
    outputs = {
        1: _output([(1, (4, 4, 20, 20), 0.9)]),  # the dog is missed
        2: _output([(1, (10, 10, 18, 18), 0.7), (2, (0, 40, 20, 60), 0.99)]),  # a dog where there is none
        3: _output([(1, (0, 0, 10, 10), 0.5)]),  # a cat on the background image, ranked below the true cats
    }
    figures = coco_evaluate(gt, detection_records(list(outputs), list(outputs.values()), LABEL_TO_CATEGORY))
    box = figures["bbox"]
    assert box["per_class"]["dog"] == pytest.approx(0.0)  # its one object missed, its one detection false
    assert box["per_class"]["cat"] == pytest.approx(1.0)  # both cats found before the false one
    assert box["AP"] == pytest.approx(0.5)


def test_figures_do_not_depend_on_how_detections_were_split_or_ordered():
    """Two workers' records, gathered in either order, give the figures of one process."""
    gt = load_ground_truth(_ground_truth())
    outputs = {
        1: _output([(1, (5, 4, 20, 21), 0.9), (2, (30, 28, 60, 62), 0.6), (1, (30, 30, 62, 62), 0.3)]),
        2: _output([(1, (10, 9, 19, 18), 0.7), (2, (41, 0, 64, 24), 0.95)]),
        3: _output([(2, (0, 0, 12, 12), 0.4)]),
    }
    one = coco_evaluate(gt, detection_records(list(outputs), list(outputs.values()), LABEL_TO_CATEGORY))
    ids = list(outputs)
    first = detection_records(ids[:1], [outputs[i] for i in ids[:1]], LABEL_TO_CATEGORY)
    second = detection_records(ids[1:], [outputs[i] for i in ids[1:]], LABEL_TO_CATEGORY)
    gathered = second + first
    random.Random(0).shuffle(gathered)
    assert coco_evaluate(gt, gathered) == one
    assert 0.0 < one["bbox"]["AP"] < 1.0


def test_area_ranges_are_stated_and_sort_objects_by_size():
    """On a 64-px canvas COCO's ranges make every object small; ranges scaled to the
    canvas sort the 16-px cat (small), the 8-px cat and the 32-px dog by their size."""
    gt = load_ground_truth(_ground_truth())
    outputs = {1: _output([(1, (4, 4, 20, 20), 0.9)]), 2: _output([]), 3: _output([])}
    records = detection_records(list(outputs), list(outputs.values()), LABEL_TO_CATEGORY)
    coco_ranges = coco_evaluate(gt, records, iou_types=("bbox",))
    assert coco_ranges["area_ranges"]["small"] == [0.0, 1024.0] and coco_ranges["bbox"]["APl"] == -1.0
    scaled = area_ranges_for(SIDE)
    assert scaled["small"] == pytest.approx((0.0, 1024.0 / 100)) and scaled["medium"][1] == pytest.approx(92.16)
    own = {"small": (0.0, 100.0), "medium": (100.0, 400.0)}  # 8-px: small, 16-px: medium, 32-px: large
    figures = coco_evaluate(gt, records, area_ranges=own, iou_types=("bbox",))
    assert figures["area_ranges"]["large"] == [400.0, None]
    # the 16-px cat found (medium: 1.0), the 8-px cat (small) and the dog (large) missed
    assert (figures["bbox"]["APs"], figures["bbox"]["APm"], figures["bbox"]["APl"]) == pytest.approx((0, 1, 0))
    assert json.loads(json.dumps(figures, allow_nan=False)) == figures  # strict JSON, for MLflow and --json


def test_no_detections_score_zero_where_there_are_objects():
    gt = load_ground_truth(_ground_truth())
    figures = coco_evaluate(gt, [])
    for iou_type in ("bbox", "segm"):
        assert figures[iou_type]["AP"] == 0.0 and figures[iou_type]["per_class"] == {"cat": 0.0, "dog": 0.0}
    only_background = coco_evaluate(gt, [], image_ids=[3])
    assert only_background["bbox"]["AP"] == -1.0 and only_background["images"] == 1


def test_bad_records_and_settings_are_named():
    gt = load_ground_truth(_ground_truth())
    with pytest.raises(ValueError, match="label 5 outside 1..2"):
        detection_records([1], [_output([(5, (0, 0, 4, 4), 0.5)])], LABEL_TO_CATEGORY)
    with pytest.raises(ValueError, match="2 image ids for 1 outputs"):
        detection_records([1, 2], [_output([])], LABEL_TO_CATEGORY)
    boxes_only = [{"image_id": 1, "category_id": 3, "bbox": [4, 4, 16, 16], "score": 0.9}]
    with pytest.raises(ValueError, match="segm evaluation needs a segmentation"):
        coco_evaluate(gt, boxes_only)
    with pytest.raises(ValueError, match="iou type must be one of"):
        coco_evaluate(gt, boxes_only, iou_types=("keypoints",))
    with pytest.raises(ValueError, match="small below medium"):
        coco_evaluate(gt, boxes_only, area_ranges={"small": (0, 500), "medium": (100, 400)}, iou_types=("bbox",))
    with pytest.raises(ValueError, match="image_side must be positive"):
        area_ranges_for(0)
