"""COCO-format detection data: the instances reader (polygons, RLE, crowd, background
images, every malformed-input error), the procedural Fashion-MNIST detection set, and
its COCO writer read back by our reader and by pycocotools."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from torch.utils.data import DataLoader

from splitvit.data import cluttered
from splitvit.data import coco as coco_module
from splitvit.data.cluttered import fashion_mnist_split, item_fragment
from splitvit.data.coco import CocoDetection, CocoFormatError, load_coco_index
from splitvit.data.common import CorruptDataError
from splitvit.data.fashion_det import FashionDetection, write_coco
from splitvit.data.fashion_mnist import CLASSES
from splitvit.storage import join_uri, write_bytes
from splitvit.train.coco_eval import load_ground_truth

from .helpers import fake_items, write_idx

# ----------------------------------------------------------------- a small COCO folder


def uncompressed_rle(mask: np.ndarray) -> dict:
    """COCO's uncompressed RLE, written out by hand: column-major runs, starting with zeros."""
    flat = mask.flatten(order="F").astype(int)
    counts, value, run = [], 0, 0
    for v in flat:
        if v == value:
            run += 1
        else:
            counts.append(run)
            value, run = v, 1
    counts.append(run)
    return {"size": list(mask.shape), "counts": counts}


def compressed_rle(mask: np.ndarray) -> dict:
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": rle["size"], "counts": rle["counts"].decode("ascii")}


# image 1: 10 wide, 8 high, RGB; image 2: 6x5 grayscale; image 3 (in a subfolder): RGBA, no annotations
POLYGON_MASK = np.zeros((8, 10), np.uint8)
POLYGON_MASK[1:3, 1:4] = 1  # the polygon (1,1)-(4,1)-(4,3)-(1,3) covers pixels x 1..3, y 1..2
CROWD_MASK = np.zeros((8, 10), np.uint8)
CROWD_MASK[4:8, 0:6] = 1
CROWD_MASK[5, 2] = 0
GRAY_MASK = np.zeros((5, 6), np.uint8)
GRAY_MASK[1:4, 2:5] = 1
GRAY_MASK[2, 3] = 0


def pixels() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.png": rng.integers(0, 256, (8, 10, 3), dtype=np.uint8),
        "b.png": rng.integers(0, 256, (5, 6), dtype=np.uint8),
        "sub/c.png": rng.integers(0, 256, (7, 7, 4), dtype=np.uint8),
    }


def coco_document() -> dict:
    return {
        "info": {"description": "test"},
        "images": [
            {"id": 1, "file_name": "a.png", "width": 10, "height": 8},
            {"id": 2, "file_name": "b.png", "width": 6, "height": 5},
            {"id": 3, "file_name": "sub/c.png", "width": 7, "height": 7},
        ],
        "categories": [{"id": 7, "name": "seven"}, {"id": 3, "name": "three"}],  # labels: three=1, seven=2
        "annotations": [
            {
                "id": 10,
                "image_id": 1,
                "category_id": 7,
                "bbox": [1, 1, 3, 2],
                "area": 6.0,
                "segmentation": [[1, 1, 4, 1, 4, 3, 1, 3]],
                "iscrowd": 0,
            },
            {
                "id": 11,
                "image_id": 1,
                "category_id": 3,
                "bbox": [0, 4, 6, 4],
                "area": 23.0,
                "segmentation": uncompressed_rle(CROWD_MASK),
                "iscrowd": 1,
            },
            {
                "id": 12,
                "image_id": 2,
                "category_id": 3,
                "bbox": [2, 1, 3, 3],
                "area": 8.0,
                "segmentation": compressed_rle(GRAY_MASK),
                "iscrowd": 0,
            },
        ],
    }


def write_folder(root: Path, document: dict) -> tuple[Path, Path]:
    """The images under ``root/images`` and the document as ``root/instances.json``."""
    images = root / "images"
    for name, array in pixels().items():
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(images / name)
    annotation_file = root / "instances.json"
    annotation_file.write_text(json.dumps(document, indent=1))
    return annotation_file, images


@pytest.fixture
def coco_folder(tmp_path) -> tuple[Path, Path]:
    return write_folder(tmp_path, coco_document())


def test_coco_folder_read_back_exactly(coco_folder):
    annotation_file, images = coco_folder
    ds = CocoDetection(annotation_file, images)
    assert len(ds) == 3 and ds.categories == ("three", "seven") and ds.category_ids == (3, 7)
    assert ds.num_classes == 3 and ds.annotation_file == str(annotation_file)
    raw = pixels()

    image, target = ds[0]  # image 1: a polygon and a crowd RLE
    assert image.dtype == torch.float32 and image.shape == (3, 8, 10)
    assert torch.equal(image, torch.from_numpy(raw["a.png"]).permute(2, 0, 1).float() / 255)
    assert torch.equal(target["boxes"], torch.tensor([[1.0, 1, 4, 3], [0, 4, 6, 8]]))
    assert torch.equal(target["labels"], torch.tensor([2, 1]))
    assert target["masks"].dtype == torch.uint8 and target["masks"].shape == (2, 8, 10)
    assert np.array_equal(target["masks"][0].numpy(), POLYGON_MASK)
    assert np.array_equal(target["masks"][1].numpy(), CROWD_MASK)
    assert torch.equal(target["iscrowd"], torch.tensor([0, 1], dtype=torch.uint8))
    assert torch.equal(target["area"], torch.tensor([6.0, 23.0]))
    assert target["image_id"].dtype == torch.int64 and int(target["image_id"]) == 1

    image, target = ds[1]  # image 2: grayscale file, compressed RLE
    assert image.shape == (3, 5, 6) and torch.equal(image[0], image[2])
    assert torch.equal(image[1], torch.from_numpy(raw["b.png"]).float() / 255)
    assert np.array_equal(target["masks"][0].numpy(), GRAY_MASK)
    assert torch.equal(target["boxes"], torch.tensor([[2.0, 1, 5, 4]])) and target["labels"].tolist() == [1]

    image, target = ds[2]  # image 3: RGBA file, no annotations = background
    assert torch.equal(image, torch.from_numpy(raw["sub/c.png"][..., :3]).permute(2, 0, 1).float() / 255)
    assert target["boxes"].shape == (0, 4) and target["boxes"].dtype == torch.float32
    assert target["masks"].shape == (0, 7, 7) and target["masks"].dtype == torch.uint8
    assert target["labels"].shape == (0,) and target["labels"].dtype == torch.int64
    assert target["iscrowd"].shape == (0,) and target["area"].shape == (0,) and int(target["image_id"]) == 3

    # the masks are what COCO's own API makes of the same file
    api = COCO(str(annotation_file))
    for image_id, (_, target) in zip(ds.image_ids, (ds[i] for i in range(len(ds))), strict=True):
        anns = api.loadAnns(api.getAnnIds(imgIds=[image_id]))
        expected = np.stack([api.annToMask(a) for a in anns]) if anns else np.zeros((0, 7, 7))
        assert np.array_equal(target["masks"].numpy(), expected)
    assert load_ground_truth(ds.index.dataset).getAnnIds() == api.getAnnIds()
    # one second reading in DataLoader workers (the dataset pickles)
    loaded = next(iter(DataLoader(ds, batch_size=3, num_workers=1, collate_fn=list)))
    assert torch.equal(loaded[1][1]["masks"], ds[1][1]["masks"])


def _without(key):
    def edit(doc):
        del doc[key]

    return edit


def _set(path, value):
    def edit(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _append(key, entry):
    def edit(doc):
        doc[key].append(entry)

    return edit


# (case, edit of the document, what the one line must say besides the file's name)
BAD_DOCUMENTS = [
    ("missing key", _without("categories"), "missing top-level key 'categories'"),
    ("unknown image", _set(("annotations", 1, "image_id"), 99), "annotation id 11 names image id 99, which is not in"),
    (
        "bbox past edge",
        _set(("annotations", 0, "bbox"), [8, 1, 4, 2]),
        "annotation id 10 (image id 1): bbox [8, 1, 4, 2]",
    ),
    ("bbox above", _set(("annotations", 0, "bbox"), [1, -1.5, 3, 2]), "annotation id 10 (image id 1): bbox [1, -1.5"),
    (
        "bbox zero wide",
        _set(("annotations", 2, "bbox"), [2, 1, 0, 3]),
        "annotation id 12 (image id 2): bbox [2, 1, 0, 3]",
    ),
    (
        "bbox negative",
        _set(("annotations", 2, "bbox"), [2, 1, 3, -1]),
        "annotation id 12 (image id 2): bbox [2, 1, 3, -1]",
    ),
    (
        "unknown category",
        _set(("annotations", 2, "category_id"), 5),
        "annotation id 12 (image id 2) names category id 5",
    ),
    (
        "short polygon",
        _set(("annotations", 0, "segmentation"), [[1, 1, 4, 1]]),
        "annotation id 10 (image id 1): polygon 0 has 4 coordinates; a polygon is",
    ),
    (
        "rle size",
        _set(("annotations", 2, "segmentation"), compressed_rle(np.zeros((6, 5)))),
        "annotation id 12 (image id 2): RLE mask size [6, 5]",
    ),
    (
        "rle counts",
        _set(("annotations", 1, "segmentation"), {"size": [8, 10], "counts": [3, 4, 5]}),
        "annotation id 11 (image id 1): uncompressed RLE counts cover 12 pixels",
    ),
    (
        "duplicate image",
        _append("images", {"id": 2, "file_name": "a.png", "width": 1, "height": 1}),
        "image id 2 appears twice",
    ),
    ("duplicate annotation", _set(("annotations", 2, "id"), 10), "annotation id 10 appears twice"),
    ("missing file", _set(("images", 1, "file_name"), "gone.png"), "image id 2: file 'gone.png' is not in"),
]


@pytest.mark.parametrize("edit, says", [case[1:] for case in BAD_DOCUMENTS], ids=[case[0] for case in BAD_DOCUMENTS])
def test_bad_annotation_file_gives_one_line_naming_file_and_id(tmp_path, monkeypatch, edit, says):
    document = coco_document()
    edit(document)
    annotation_file, images = write_folder(tmp_path, document)

    def no_image_reads(*args, **kwargs):
        raise AssertionError("an image was read before the index was checked")

    monkeypatch.setattr(coco_module, "decode_image", no_image_reads)
    with pytest.raises(CocoFormatError) as err:
        CocoDetection(annotation_file, images)
    message = str(err.value)
    assert message.startswith(f"{annotation_file}: ") and says in message and "\n" not in message
    assert isinstance(err.value, ValueError)


def test_bbox_rounding_of_one_pixel_is_allowed(tmp_path):
    document = coco_document()
    document["annotations"][0]["bbox"] = [-0.9, 1, 11.8, 2]  # 0.9 px over both edges of the 10 px image
    annotation_file, images = write_folder(tmp_path, document)
    _, target = CocoDetection(annotation_file, images)[0]
    assert target["boxes"][0].tolist() == [0.0, 1.0, 10.0, 3.0]  # clipped to the image


def test_malformed_json_names_line_and_column(tmp_path):
    annotation_file = tmp_path / "instances.json"
    annotation_file.write_text('{\n  "images": [],\n  "annotations": [,]\n}\n')
    with pytest.raises(CocoFormatError) as err:
        load_coco_index(annotation_file)
    assert str(err.value) == f"{annotation_file}: not valid JSON: Expecting value at line 3 column 19"


def test_corrupt_image_is_skipped_and_counted_or_raised_when_strict(coco_folder, caplog):
    annotation_file, images = coco_folder
    (images / "a.png").write_bytes(b"not a png at all")
    ds = CocoDetection(annotation_file, images)
    image, target = ds[0]  # the next readable item instead (deterministic), one warning naming the file
    assert int(target["image_id"]) == 2 and image.shape == (3, 5, 6)
    assert ds.skipped == 1 and ds.skipped_files == [str(images / "a.png")]
    assert "a.png" in caplog.text
    strict = CocoDetection(annotation_file, images, strict=True)
    with pytest.raises(CorruptDataError, match="a.png: not a recognised image format"):
        strict[0]
    # a file of another size than the annotation file says: corrupt too (its masks would not line up)
    Image.fromarray(np.zeros((5, 7), np.uint8)).save(images / "b.png")
    with pytest.raises(CorruptDataError, match=r"b.png: image is 7x5, the annotation file says 6x5"):
        strict[1]
    assert ds.verify() == 2 and len(ds) == 1


def test_read_from_s3(coco_folder, s3_bucket):
    annotation_file, images = coco_folder
    prefix = f"s3://{s3_bucket}/coco"
    write_bytes(join_uri(prefix, "instances.json"), annotation_file.read_bytes())
    for path in images.rglob("*.png"):
        write_bytes(join_uri(prefix, "images", path.relative_to(images).as_posix()), path.read_bytes())
    remote = CocoDetection(join_uri(prefix, "instances.json"), join_uri(prefix, "images"))
    local = CocoDetection(annotation_file, images)
    for i in range(len(local)):
        assert_same_item(remote[i], local[i])
    assert load_ground_truth(remote.index.dataset).getImgIds() == [1, 2, 3]
    document = coco_document()
    document["images"][0]["file_name"] = "missing.png"
    write_bytes(join_uri(prefix, "bad.json"), json.dumps(document).encode())
    with pytest.raises(CocoFormatError, match=f"^{prefix}/bad.json: image id 1: file 'missing.png' is not in"):
        load_coco_index(join_uri(prefix, "bad.json"), join_uri(prefix, "images"))


def assert_same_item(a, b) -> None:
    assert torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys()
    for key in a[1]:
        assert a[1][key].dtype == b[1][key].dtype and torch.equal(a[1][key], b[1][key]), key


# ----------------------------------------------------------------- Fashion-MNIST detection


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> tuple[np.ndarray, np.ndarray]:
    """The val split of a tiny Fashion-MNIST written in its real file format."""
    root = tmp_path_factory.mktemp("fmnist")
    for part, (images, labels) in {"train": fake_items(60, seed=1), "t10k": fake_items(20, seed=2)}.items():
        write_idx(root / f"{part}-images-idx3-ubyte", images, gz=False)
        write_idx(root / f"{part}-labels-idx1-ubyte", labels, gz=False)
    return fashion_mnist_split("val", root, val_size=30, download=False)


def test_fashion_detection_is_deterministic(pool):
    a = FashionDetection(*pool, seed=3, num_samples=6)
    b = FashionDetection(*pool, seed=3, num_samples=6)
    other = FashionDetection(*pool, seed=4, num_samples=6)
    for i in (0, 5):
        assert_same_item(a[i], b[i])
    assert not torch.equal(a[0][0], other[0][0])
    with pytest.raises(IndexError):
        a[6]


def test_fashion_detection_items_boxes_and_masks(pool):
    images, labels = pool
    ds = FashionDetection(images, labels, seed=0, num_samples=24)
    counts, sides = set(), set()
    for i in range(len(ds)):
        canvas = ds.render(i)
        image, target = ds[i]
        boxes, masks = target["boxes"].numpy(), target["masks"].numpy().astype(bool)
        n = len(canvas.labels)
        counts.add(n)
        assert image.shape == (3, 128, 128) and torch.equal(image * 255, (image * 255).round())  # 8-bit values
        assert boxes.shape == (n, 4) and masks.shape == (n, 128, 128) and int(target["image_id"]) == i
        assert target["labels"].tolist() == [c + 1 for c in canvas.labels] and set(target["labels"].tolist()) <= set(
            range(1, 11)
        )
        assert torch.equal(target["area"], torch.from_numpy(masks.sum((1, 2)).astype(np.float32)))
        assert not target["iscrowd"].any()
        # no two items overlap, not even with their margins
        grown = np.zeros((n, 128, 128), bool)
        for k, (y, x, h, w) in enumerate(canvas.boxes):
            sides.add(h)
            m = ds.margin
            grown[k, max(y - m, 0) : y + h + m, max(x - m, 0) : x + w + m] = True
            assert masks[k, y : y + h, x : x + w].sum() == masks[k].sum()  # the mask lies in its tile
        assert grown.sum(0).max() <= 1
        for k in range(n):  # tight boxes: every edge row/column holds a mask pixel, nothing outside
            x1, y1, x2, y2 = (int(v) for v in boxes[k])
            assert boxes[k].tolist() == [x1, y1, x2, y2]
            inside = np.zeros((128, 128), bool)
            inside[y1:y2, x1:x2] = True
            assert not (masks[k] & ~inside).any()
            assert masks[k, y1].any() and masks[k, y2 - 1].any() and masks[k, :, x1].any() and masks[k, :, x2 - 1].any()
            # the mask is the item's pixels: those that differ from the background in its tile
            y, x, h, w = canvas.boxes[k]
            painted = (np.abs(canvas.image[:, y : y + h, x : x + w] - canvas.background[:, None, None]) > 1e-6).any(0)
            assert np.array_equal(painted, masks[k, y : y + h, x : x + w])
        # the clutter covers its share and stays a margin off every item
        assert canvas.clutter_mask.mean() >= ds.clutter_fraction
        assert not (canvas.clutter_mask & grown.any(0)).any()
    assert counts <= set(range(2, 7)) and {2, 6} & counts and min(sides) < 30 < max(sides) <= 56


def test_no_clutter_variant_is_the_same_items_on_a_flat_background(pool):
    cluttered = FashionDetection(*pool, seed=1, num_samples=8)
    plain = FashionDetection(*pool, seed=1, num_samples=8, clutter=False)
    for i in range(len(plain)):
        c, p = cluttered.render(i), plain.render(i)
        _, target_c = cluttered[i]
        _, target_p = plain[i]
        for key in target_p:  # the very same objects: only the clutter differs
            assert torch.equal(target_c[key], target_p[key]), key
        items = p.item_masks.any(0)
        assert not p.clutter_mask.any()
        assert np.array_equal(p.image[:, ~items], np.broadcast_to(p.background[:, None], (3, int((~items).sum()))))
        assert np.array_equal(c.image[:, ~c.clutter_mask], p.image[:, ~c.clutter_mask])


def test_fragments_in_the_clutter_are_never_whole_items(pool, monkeypatch):
    images, labels = pool
    shown = []

    def recording_fragment(*args, **kwargs):
        alpha = item_fragment(*args, **kwargs)
        rows, cols = np.flatnonzero(alpha.any(1)), np.flatnonzero(alpha.any(0))
        if len(rows):
            shown.append((kwargs["item_size"], rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1))
        return alpha

    monkeypatch.setattr(cluttered, "item_fragment", recording_fragment)
    ds = FashionDetection(images, labels, seed=2, num_samples=6, fragment_prob=1.0)
    for i in range(len(ds)):
        ds.render(i)
    # fragments of items drawn at the largest item size, at most half of its side showing
    assert len(shown) > 30 and all(size == 56 and h <= 28 and w <= 28 for size, h, w in shown)
    assert max(max(h, w) for _, h, w in shown) == 28


def test_write_coco_round_trip(pool, tmp_path):
    ds = FashionDetection(*pool, seed=5, num_samples=5)
    files = write_coco(ds, tmp_path / "det", "val")
    assert files.annotation_file == str(tmp_path / "det" / "instances_val.json")
    back = CocoDetection(*files)
    assert back.categories == CLASSES and back.category_ids == tuple(range(1, 11)) and len(back) == 5
    for i in range(len(ds)):
        assert_same_item(back[i], ds[i])
    api = COCO(files.annotation_file)
    objects = sum(len(ds[i][1]["labels"]) for i in range(len(ds)))
    assert len(api.getImgIds()) == 5 and len(api.getAnnIds()) == objects and len(api.getCatIds()) == 10
    ann = api.loadAnns(api.getAnnIds(imgIds=[0]))[0]
    assert ann["id"] >= 1 and list(mask_utils.toBbox(api.annToRLE(ann))) == ann["bbox"]
    # COCO's evaluation reads it: the ground truth as detections scores 1.0
    from pycocotools.cocoeval import COCOeval

    results = [dict(copy.deepcopy(a), score=1.0) for a in api.loadAnns(api.getAnnIds())]
    for a in results:
        del a["id"]
    evaluation = COCOeval(api, api.loadRes(results), "segm")
    evaluation.params.areaRng = [[0, 1e10]] * 4  # the items are small by COCO's measure
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(1.0)
