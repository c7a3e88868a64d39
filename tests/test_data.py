"""Datasets: cluttered Fashion-MNIST, image folders, ADE20K layout, parquet shards
(local and through a local S3 endpoint), corrupt-file handling, ``splitvit data``."""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader

from splitvit.cli import main
from splitvit.data import (
    DATASET_NAMES,
    ClutteredFashionMNIST,
    ClutteredFashionMNISTSeg,
    CorruptDataError,
    FashionMNISTNotFound,
    ParquetShards,
    build_dataset,
    find_fashion_mnist,
    write_shards,
)
from splitvit.data import fashion_mnist as fm
from splitvit.data.fashion_mnist import read_idx

from .helpers import fake_items, write_idx

# ----------------------------------------------------------------- helpers

ROUND = 0.5 / 255 + 1e-6  # images are stored as 8-bit PNG


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory) -> Path:
    """A tiny Fashion-MNIST in its real file format: gzipped train files, plain t10k files."""
    root = tmp_path_factory.mktemp("fmnist")
    train_x, train_y = fake_items(60, seed=1)
    test_x, test_y = fake_items(20, seed=2)
    write_idx(root / "train-images-idx3-ubyte", train_x, gz=True)
    write_idx(root / "train-labels-idx1-ubyte", train_y, gz=True)
    write_idx(root / "t10k-images-idx3-ubyte", test_x, gz=False)
    write_idx(root / "t10k-labels-idx1-ubyte", test_y, gz=False)
    return root


def tiny_opts(root: Path) -> dict:
    return {"root": str(root), "val_size": 20, "download": False}


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def same_items(a, b, atol: float = 0.0) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x, y = torch.as_tensor(x), torch.as_tensor(y)  # a DataLoader turns int labels into 0-d tensors
        if (
            x.shape != y.shape
            or x.is_floating_point() != y.is_floating_point()
            or (x.dtype == torch.bool) != (y.dtype == torch.bool)
        ):
            return False
        ok = (
            torch.allclose(x.float(), y.float(), atol=atol, rtol=0)
            if x.is_floating_point()
            else torch.equal(x.long(), y.long())
        )
        if not ok:
            return False
    return True


# ----------------------------------------------------------------- Fashion-MNIST files


def test_fashion_mnist_found_in_debian_folder(monkeypatch):
    if not fm.DEBIAN_DIR.is_dir():
        pytest.skip(f"{fm.DEBIAN_DIR} absent: install Debian's dataset-fashion-mnist package to run this test")
    monkeypatch.delenv(fm.DATA_DIR_ENV, raising=False)
    assert find_fashion_mnist(download=False) == fm.DEBIAN_DIR
    train = build_dataset("cluttered-fashion-mnist", "train", image_size=64, download=False)
    val = build_dataset("cluttered-fashion-mnist", "val", image_size=64, download=False)
    test = build_dataset("cluttered-fashion-mnist", "test", image_size=64, download=False)
    assert (len(train), len(val), len(test)) == (55000, 5000, 10000)
    raw_train, raw_labels = fm.load_fashion_mnist("train", download=False)
    assert raw_train.shape == (60000, 28, 28) and set(np.unique(raw_labels)) == set(range(10))
    # val is the held-out tail of the train files: its canvas 3 shows raw train item 55003
    canvas = val.render(3)
    y, x, h, w = canvas.boxes[0]
    tile = canvas.image[:, y : y + h, x : x + w].mean(0)
    assert canvas.labels == [int(raw_labels[55003])]
    assert np.corrcoef(tile.ravel(), raw_train[55003].ravel().astype(float))[0, 1] > 0.99
    image, label, item_mask = test[0]
    assert image.shape == (3, 64, 64) and 0 <= label < 10 and item_mask.dtype == torch.bool and item_mask.any()


def test_missing_fashion_mnist_gives_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.delenv(fm.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no earlier download in ~/.cache/splitvit

    def offline(dest):
        raise OSError("fashion-mnist host is not reachable")

    monkeypatch.setattr(fm, "download_fashion_mnist", offline)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FashionMNISTNotFound) as info:
        # download=True: a root is only ever filled by a download asked for (no root: the default)
        build_dataset("cluttered-fashion-mnist", "train", image_size=64, root=str(empty), download=True)
    message = str(info.value)
    for needed in (
        "apt-get install dataset-fashion-mnist",
        "root=",
        str(empty),
        "no-debian",
        "not reachable",
        "train-images-idx3-ubyte",
    ):
        assert needed in message
    # the command reports the same single message and fails
    rc = main(
        [
            "data",
            "prepare",
            "cluttered-fashion-mnist",
            "--root",
            str(empty),
            "--option",
            "download=true",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "apt-get install dataset-fashion-mnist" in err and err.count("\n") == 1


def test_root_option_wins_and_reads_idx_gz_and_plain(fmnist_root):
    assert find_fashion_mnist(fmnist_root, download=False) == fmnist_root
    images, labels = fake_items(60, seed=1)
    train = build_dataset("cluttered-fashion-mnist", "train", image_size=48, **tiny_opts(fmnist_root))
    val = build_dataset("cluttered-fashion-mnist", "val", image_size=48, **tiny_opts(fmnist_root))
    test = build_dataset("cluttered-fashion-mnist", "test", image_size=48, **tiny_opts(fmnist_root))
    assert (len(train), len(val), len(test)) == (40, 20, 20)
    assert [train[i][1] for i in range(40)] == labels[:40].tolist()
    assert [val[i][1] for i in range(20)] == labels[40:].tolist()
    assert [test[i][1] for i in range(20)] == fake_items(20, seed=2)[1].tolist()


def test_corrupt_idx_file_is_named(tmp_path):
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + b"\x00" * 20)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte"):
        read_idx(bad)


# ----------------------------------------------------------------- cluttered canvases


def test_cluttered_is_deterministic_per_seed(fmnist_root):
    def make(seed, split="train"):
        return build_dataset("cluttered-fashion-mnist", split, image_size=64, seed=seed, **tiny_opts(fmnist_root))

    a, b, c = make(0), make(0), make(1)
    for i in (0, 7, 39):
        assert same_items(a[i], b[i])
    assert not torch.equal(a[0][0], c[0][0])
    # the same in DataLoader workers as in this process
    loaded = [item for batch in DataLoader(a, batch_size=4, num_workers=2) for item in zip(*batch)]
    assert all(same_items(loaded[i], a[i]) for i in range(len(a)))
    seg1 = build_dataset("cluttered-fashion-mnist-seg", "val", image_size=96, seed=3, **tiny_opts(fmnist_root))
    seg2 = build_dataset("cluttered-fashion-mnist-seg", "val", image_size=96, seed=3, **tiny_opts(fmnist_root))
    assert same_items(seg1[5], seg2[5])


def _patch_entropy(gray: np.ndarray, size: int = 8) -> np.ndarray:
    h, w = gray.shape
    out = np.zeros((h // size, w // size))
    for i in range(h // size):
        for j in range(w // size):
            hist = np.bincount(
                (gray[i * size : (i + 1) * size, j * size : (j + 1) * size] * 15.999).astype(int).ravel(), minlength=16
            )
            p = hist[hist > 0] / hist.sum()
            out[i, j] = -(p * np.log2(p)).sum()
    return out


@pytest.mark.parametrize("image_size", [64, 96])
def test_clutter_covers_a_third_and_stays_off_the_item(fmnist_root, image_size):
    images, labels = fake_items(60, seed=1)
    ds = ClutteredFashionMNIST(images, labels, image_size=image_size, clutter_fraction=0.34, seed=5)
    clutter_entropy, item_entropy = [], []
    for i in range(24):
        c = ds.render(i)
        image, label, item_mask = ds[i]
        assert torch.equal(image, torch.from_numpy(c.image)) and label == int(labels[i])
        assert c.clutter_mask.mean() >= 1 / 3
        (y, x, h, w), m = c.boxes[0], ds.renderer.margin
        keepout = np.zeros_like(c.clutter_mask)
        keepout[max(y - m, 0) : y + h + m, max(x - m, 0) : x + w + m] = True
        assert not (c.clutter_mask & keepout).any()
        # everything that is neither clutter nor the item's tile is flat background
        rest = ~(c.clutter_mask | keepout)
        assert np.allclose(c.image[:, rest], c.background[:, None])
        # the item is intact: its tile is the Fashion-MNIST item, scaled into colour
        tile = c.image[:, y : y + h, x : x + w]
        assert np.corrcoef(tile.mean(0).ravel(), images[i].ravel().astype(float))[0, 1] > 0.999
        assert torch.equal(item_mask, torch.from_numpy(c.item_masks[0]))
        assert item_mask[y : y + h, x : x + w].sum() == (images[i] > 0.1 * 255).sum() and item_mask.sum() > 0
        gray = c.image.mean(0)
        ent = _patch_entropy(gray)
        cells_clutter = _patch_entropy(c.clutter_mask.astype(float)) == 0  # 8x8 cells wholly in or out of clutter
        in_clutter = cells_clutter & (c.clutter_mask[::8, ::8])
        on_item = np.zeros_like(ent, bool)
        on_item[y // 8 : (y + h) // 8, x // 8 : (x + w) // 8] = True
        clutter_entropy += ent[in_clutter].tolist()
        item_entropy += ent[on_item & ~in_clutter].tolist()
    # pixel entropy is high where the label is not
    assert np.mean(clutter_entropy) > np.mean(item_entropy) + 0.5


def test_fragments_of_other_items_are_in_the_clutter(fmnist_root):
    images, labels = fake_items(60, seed=1)
    images = np.where(images > 0, 255, 0).astype(np.uint8)  # smooth items: fragments show as flat bright areas
    with_frag = ClutteredFashionMNIST(images, labels, image_size=64, fragment_prob=1.0, seed=2)
    without = ClutteredFashionMNIST(images, labels, image_size=64, fragment_prob=0.0, seed=2)

    # fragment pixels are bright and smooth; pure noise has no bright-and-smooth 3x3 neighbourhoods
    def smooth_bright(ds):
        total = 0
        for i in range(10):
            c = ds.render(i)
            g = c.image.mean(0)
            windows = np.lib.stride_tricks.sliding_window_view(g, (3, 3))
            smooth = (windows.std(axis=(-1, -2)) < 0.02) & (windows.mean(axis=(-1, -2)) > 0.6)
            total += int((smooth & c.clutter_mask[1:-1, 1:-1]).sum())
        return total

    assert smooth_bright(with_frag) > 50 * max(smooth_bright(without), 1)


def test_segmentation_variant(fmnist_root):
    ds = build_dataset("cluttered-fashion-mnist-seg", "train", image_size=96, seed=0, **tiny_opts(fmnist_root))
    assert isinstance(ds, ClutteredFashionMNISTSeg) and ds.num_classes == 11
    counts = set()
    for i in range(12):
        c = ds.render(i)
        image, mask = ds[i]
        assert image.shape == (3, 96, 96) and mask.dtype == torch.int64 and mask.shape == (96, 96)
        assert c.clutter_mask.mean() >= 0.4 - 1e-9
        assert (mask[torch.from_numpy(c.clutter_mask)] == 0).all()
        counts.add(len(c.labels))
        for label, item in zip(c.labels, c.item_masks):
            assert (mask[torch.from_numpy(item)] == label + 1).all()
        assert torch.equal(mask > 0, torch.from_numpy(c.item_masks.any(0)))
    assert counts <= set(range(ds.min_items, ds.max_items + 1)) and max(counts) >= 2
    with pytest.raises(ValueError, match="64x64 canvas"):
        ClutteredFashionMNISTSeg(*fake_items(10, 0), image_size=64, max_items=4)


# ----------------------------------------------------------------- folders


def _jpeg(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_imagefolder(tmp_path, caplog):
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            for k in range(n):
                _jpeg(tmp_path / split / cls / f"{k}.jpg", rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
    ds = build_dataset("imagefolder", "train", image_size=32, root=str(tmp_path))
    assert len(ds) == 6 and ds.classes == ["cat", "dog"] and ds.num_classes == 2
    assert [ds[i][1] for i in range(6)] == [0, 0, 0, 1, 1, 1]
    image, _ = ds[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= image.min() and image.max() <= 1
    val = build_dataset("imagefolder", "val", image_size=32, root=str(tmp_path))
    assert [val[i][1] for i in range(len(val))] == [0, 0, 1, 1]
    # a corrupt image: skipped (the next readable item is served), counted, named in the log
    bad = tmp_path / "train" / "cat" / "1.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    ds = build_dataset("imagefolder", "train", image_size=32, root=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        items = [ds[i] for i in range(len(ds))]
    assert ds.skipped == 1 and ds.skipped_files == [str(bad)] and str(bad) in caplog.text
    assert same_items(items[1], items[2])
    verified = build_dataset("imagefolder", "train", image_size=32, root=str(tmp_path), verify=True)
    assert len(verified) == 5 and verified.skipped == 1
    strict = build_dataset("imagefolder", "train", image_size=32, root=str(tmp_path), strict=True)
    with pytest.raises(CorruptDataError, match=str(bad)):
        strict[1]
    with pytest.raises(FileNotFoundError, match="test"):
        build_dataset("imagefolder", "test", image_size=32, root=str(tmp_path))


def test_file_backed_datasets_resize_with_the_models_interpolation(tmp_path):
    """``interpolation`` (the model's timm data config) picks the resize filter, as
    PIL's own resize would with that filter; an unknown name is one error."""
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    _jpeg(tmp_path / "train" / "cat" / "0.png", array)
    source = Image.fromarray(array)
    for name, method in (("bicubic", Image.BICUBIC), ("nearest", Image.NEAREST)):
        image, _ = build_dataset("imagefolder", "train", image_size=32, interpolation=name, root=str(tmp_path))[0]
        expected = ImageOps.fit(source, (32, 32), method=method)
        assert torch.equal(image, torch.from_numpy(np.asarray(expected).copy()).permute(2, 0, 1).float() / 255)
    with pytest.raises(ValueError, match="interpolation must be one of nearest, .*got 'cubic'"):
        build_dataset("synthetic", "train", image_size=32, interpolation="cubic")


def test_ade20k_layout(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    rng = np.random.default_rng(0)
    for split, n in (("training", 3), ("validation", 1)):
        for k in range(n):
            stem = f"ADE_{split[:5]}_{k:08d}"
            _jpeg(root / "images" / split / f"{stem}.jpg", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
            ann = np.zeros((48, 64), np.uint8)
            ann[:, 16:32], ann[:, 32:48], ann[:, 48:] = 1, 7, 150  # 0 stays on the left
            (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
            Image.fromarray(ann).save(root / "annotations" / split / f"{stem}.png")
    _jpeg(root / "images" / "training" / "no_annotation.jpg", np.zeros((8, 8, 3), np.uint8))
    ds = build_dataset("ade20k", "train", image_size=32, root=str(tmp_path))  # the parent folder works too
    assert len(ds) == 3
    image, mask = ds[0]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and mask.dtype == torch.int64
    # centre crop of 48x64 keeps columns 8..56: 0 -> 255 (ignore), 1 -> 0, 7 -> 6, 150 -> 149
    assert set(mask.unique().tolist()) == {255, 0, 6, 149}
    assert (mask[:, 0] == 255).all() and (mask[:, -1] == 149).all()
    assert len(build_dataset("ade20k", "val", image_size=32, root=str(root))) == 1
    with pytest.raises(ValueError, match="test"):
        build_dataset("ade20k", "test", image_size=32, root=str(root))
    # palette PNG annotations keep their class indices
    pal = Image.fromarray(np.full((48, 64), 7, np.uint8), mode="L").convert("P")
    pal.putpalette([v for i in range(256) for v in (i * 3 % 256, 0, 255 - i)])
    pal.save(root / "annotations" / "training" / "ADE_train_00000000.png")
    assert set(build_dataset("ade20k", "train", image_size=32, root=str(root))[0][1].unique().tolist()) == {6}


# ----------------------------------------------------------------- parquet shards


def test_parquet_round_trip_local(fmnist_root, tmp_path):
    src = build_dataset("cluttered-fashion-mnist", "val", image_size=64, **tiny_opts(fmnist_root))
    result = write_shards(
        src, str(tmp_path / "shards" / "val"), rows_per_shard=8, row_group_size=3, metadata={"split": "val"}
    )
    assert (result.rows, len(result.shards), result.skipped) == (20, 3, 0)
    manifest = json.loads((tmp_path / "shards" / "val" / "_manifest.json").read_text())
    assert manifest["num_rows"] == 20 and [s["rows"] for s in manifest["shards"]] == [8, 8, 4]
    assert manifest["columns"] == ["image", "label", "index", "object_mask"] and manifest["num_classes"] == 10
    ds = build_dataset("parquet", "val", image_size=64, uri=str(tmp_path / "shards"))
    assert isinstance(ds, ParquetShards) and len(ds) == 20 and ds.num_classes == 10
    # the manifest reads back as what was written: its shard files, task, split and canvas
    assert list(ds.manifest.shards) == result.shards and result.as_dict()["shards"] == manifest["shards"]
    assert (ds.manifest.task, ds.manifest.split, ds.manifest.image_size) == ("classification", "val", (64, 64))
    for i in (0, 7, 8, 19):
        assert same_items(ds[i], src[i], atol=ROUND)
    # it pickles (spawned workers, Ray) without its open files, and reads the same rows after
    assert same_items(pickle.loads(pickle.dumps(ds))[11], ds[11])
    # DataLoader workers (forked) read the same rows
    loaded = [item for batch in DataLoader(ds, batch_size=5, num_workers=2) for item in zip(*batch)]
    assert all(same_items(loaded[i], ds[i]) for i in range(20))
    # read back at another size: resized
    assert ds.image_size == 64 and build_dataset("parquet", "val", image_size=32, uri=str(tmp_path / "shards"))[0][
        0
    ].shape == (3, 32, 32)
    # the folder holds val: asking it for train is an error, not a silent mix-up
    with pytest.raises(ValueError, match="'val'"):
        build_dataset("parquet", "train", image_size=64, uri=str(tmp_path / "shards" / "val"))
    # no silent overwrite; with overwrite, stale shards are gone
    with pytest.raises(ValueError, match="already holds shards"):
        write_shards(src, str(tmp_path / "shards" / "val"), rows_per_shard=8)
    write_shards(src, str(tmp_path / "shards" / "val"), rows_per_shard=100, overwrite=True, limit=5)
    assert sorted(p.name for p in (tmp_path / "shards" / "val").iterdir()) == ["_manifest.json", "shard-00000.parquet"]
    assert len(build_dataset("parquet", "val", image_size=64, uri=str(tmp_path / "shards"))) == 5


def test_parquet_round_trip_segmentation(fmnist_root, tmp_path):
    src = build_dataset("cluttered-fashion-mnist-seg", "test", image_size=64, **tiny_opts(fmnist_root))
    write_shards(src, str(tmp_path), rows_per_shard=6, limit=10)
    ds = ParquetShards(str(tmp_path), image_size=64)
    assert ds.task == "segmentation" and len(ds) == 10 and ds.num_classes == 11
    for i in range(10):
        assert same_items(ds[i], src[i], atol=ROUND)


def test_prepare_push_and_read_from_s3(fmnist_root, tmp_path, s3_bucket):
    local = tmp_path / "prepared" / "val"
    rc = main(
        [
            "data",
            "prepare",
            "cluttered-fashion-mnist",
            "--split",
            "val",
            "--root",
            str(fmnist_root),
            "--option",
            "val_size=20",
            "--option",
            "download=false",
            "--out",
            str(local),
            "--image-size",
            "64",
            "--limit",
            "12",
            "--rows-per-shard",
            "5",
            "--json",
            str(tmp_path / "prepare.json"),
        ]
    )
    assert rc == 0
    prepared = json.loads((tmp_path / "prepare.json").read_text())
    assert prepared["rows"] == 12 and len(prepared["shards"]) == 3 and prepared["skipped"] == 0
    rc = main(
        ["data", "push", str(tmp_path / "prepared"), f"s3://{s3_bucket}/fmnist", "--json", str(tmp_path / "push.json")]
    )
    assert rc == 0
    pushed = json.loads((tmp_path / "push.json").read_text())
    assert pushed["files"] == 4 and pushed["bytes"] == sum(p.stat().st_size for p in local.iterdir())
    remote = build_dataset("parquet", "val", image_size=64, uri=f"s3://{s3_bucket}/fmnist")
    here = build_dataset("parquet", "val", image_size=64, uri=str(tmp_path / "prepared"))
    src = build_dataset("cluttered-fashion-mnist", "val", image_size=64, **tiny_opts(fmnist_root))
    assert len(remote) == 12
    for i in range(12):
        assert same_items(remote[i], here[i]) and same_items(remote[i], src[i], atol=ROUND)
    loaded = [item for batch in DataLoader(remote, batch_size=4, num_workers=2) for item in zip(*batch)]
    assert all(same_items(loaded[i], here[i]) for i in range(12))
    # prepare can also write straight to S3
    rc = main(
        [
            "data",
            "prepare",
            "parquet",
            "--split",
            "val",
            "--root",
            str(tmp_path / "prepared"),
            "--out",
            f"s3://{s3_bucket}/direct/val",
            "--rows-per-shard",
            "100",
        ]
    )
    assert rc == 0 and len(build_dataset("parquet", "val", image_size=64, uri=f"s3://{s3_bucket}/direct")) == 12


def test_push_to_missing_bucket_fails_clearly(tmp_path, s3_endpoint, capsys):
    (tmp_path / "a.txt").write_text("x")
    assert main(["data", "push", str(tmp_path), "s3://no-such-bucket-q/p"]) == 2
    assert "s3://no-such-bucket-q/p" in capsys.readouterr().err


def test_corrupt_shard_skipped_counted_or_strict(fmnist_root, tmp_path, caplog):
    src = build_dataset("cluttered-fashion-mnist", "val", image_size=48, **tiny_opts(fmnist_root))
    write_shards(src, str(tmp_path), rows_per_shard=7)
    bad = tmp_path / "shard-00001.parquet"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: no footer
    with caplog.at_level(logging.WARNING):
        ds = build_dataset("parquet", "val", image_size=48, uri=str(tmp_path))
    assert ds.skipped == 1 and ds.skipped_files == [str(bad)] and str(bad) in caplog.text
    assert len(ds) == 13  # 20 rows minus the 7 of the bad shard
    assert same_items(ds[7], src[14], atol=ROUND)  # rows after the bad shard come from the third one
    with pytest.raises(CorruptDataError, match=str(bad)):
        build_dataset("parquet", "val", image_size=48, uri=str(tmp_path), strict=True)
    # via the command: strict stops with the file named; without strict the rows are re-sharded
    assert (
        main(
            [
                "data",
                "prepare",
                "parquet",
                "--split",
                "val",
                "--root",
                str(tmp_path),
                "--out",
                str(tmp_path / "re"),
                "--strict",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "data",
                "prepare",
                "parquet",
                "--split",
                "val",
                "--root",
                str(tmp_path),
                "--out",
                str(tmp_path / "re"),
                "--json",
                str(tmp_path / "re.json"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "re.json").read_text())["rows"] == 13


def test_corrupt_row_image_skipped_counted_or_strict(tmp_path, caplog):
    good = png_bytes(np.full((8, 8, 3), 200, np.uint8))
    table = pa.table({"image": [good, b"\x89PNG broken", good], "label": [0, 1, 2], "index": [0, 1, 2]})
    pq.write_table(table, tmp_path / "shard-00000.parquet")
    ds = ParquetShards(str(tmp_path), image_size=8)
    with caplog.at_level(logging.WARNING):
        labels = [ds[i][1] for i in range(3)]
    assert labels == [0, 2, 2] and ds.skipped == 1 and "shard-00000.parquet" in ds.skipped_files[0]
    assert "shard-00000.parquet" in caplog.text
    with pytest.raises(CorruptDataError, match="shard-00000.parquet"):
        ParquetShards(str(tmp_path), image_size=8, strict=True)[1]


def test_write_shards_skips_corrupt_images(tmp_path):
    rng = np.random.default_rng(0)
    for k in range(4):
        _jpeg(tmp_path / "imgs" / "train" / "a" / f"{k}.png", rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    bad = tmp_path / "imgs" / "train" / "a" / "2.png"
    bad.write_bytes(b"garbage")
    ds = build_dataset("imagefolder", "train", image_size=16, root=str(tmp_path / "imgs"))
    result = write_shards(ds, str(tmp_path / "out"), rows_per_shard=10)
    assert result.rows == 3 and result.skipped == 1 and result.skipped_files == [str(bad)]
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["skipped_files"] == [str(bad)]
    assert ParquetShards(str(tmp_path / "out")).columns == ["image", "label", "index"]
    with pytest.raises(CorruptDataError, match=str(bad)):
        write_shards(ds, str(tmp_path / "out2"), strict=True)


# ----------------------------------------------------------------- synthetic


def test_synthetic_items_are_kept_once_drawn_and_handed_out_as_copies(monkeypatch):
    from splitvit.data import synthetic

    data = synthetic.SyntheticObjects(6, image_size=16, object_size=4, seed=3)
    drawn = [data._draw(i) for i in range(6)]  # each item from its own generator
    first = [data[i] for i in range(6)]
    for (image, label, mask), (ref_image, ref_label, ref_mask) in zip(first, drawn):
        assert torch.equal(image, ref_image) and label == ref_label and torch.equal(mask, ref_mask)
    calls = []
    monkeypatch.setattr(data, "_draw", lambda i: calls.append(i))
    first[2][0].zero_()  # a caller's copy, changed in place
    second = data[2]
    assert calls == [] and torch.equal(second[0], drawn[2][0]) and torch.equal(second[2], drawn[2][2])
    # a dataset over the byte limit draws every item on every read, keeping none
    monkeypatch.setattr(synthetic, "CACHE_BYTES", 5 * 13 * 16 * 16)
    large = synthetic.SyntheticObjects(6, image_size=16, object_size=4, seed=3)
    assert large._items is None and torch.equal(large[4][0], drawn[4][0])


# ----------------------------------------------------------------- registry


def test_registry_names_and_options(fmnist_root):
    assert set(DATASET_NAMES) >= {
        "synthetic",
        "cluttered-fashion-mnist",
        "cluttered-fashion-mnist-seg",
        "imagefolder",
        "ade20k",
        "parquet",
    }
    with pytest.raises(ValueError, match="clutter_fractoin"):
        build_dataset("cluttered-fashion-mnist", "train", image_size=64, clutter_fractoin=0.5, **tiny_opts(fmnist_root))
    with pytest.raises(ValueError, match="needs option root"):
        build_dataset("imagefolder", "train", image_size=64)
    with pytest.raises(ValueError, match="parquet"):
        build_dataset("nope", "train", image_size=64)
    assert len(build_dataset("synthetic", "train", image_size=32)) == 1024
    assert (
        len(
            build_dataset(
                "cluttered-fashion-mnist",
                "train",
                image_size=64,
                train_samples=7,
                val_samples=3,
                **tiny_opts(fmnist_root),
            )
        )
        == 7
    )


def test_canvas_cache_renders_once_and_reads_back_the_same_canvases(fmnist_root, tmp_path):
    cache = tmp_path / "cache"
    for name in ("cluttered-fashion-mnist", "cluttered-fashion-mnist-seg"):
        plain = build_dataset(name, "val", image_size=64, seed=4, **tiny_opts(fmnist_root))
        cached = build_dataset(name, "val", image_size=64, seed=4, cache_dir=str(cache), **tiny_opts(fmnist_root))
        for i in (0, len(plain) - 1):
            a, b = plain[i], cached[i]
            assert (a[0] - b[0]).abs().max() <= 0.5 / 255 + 1e-6  # stored as 8-bit
            for x, y in zip(a[1:], b[1:]):
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))
        with pytest.raises(IndexError):
            cached[len(cached)]
    folders = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert len(folders) == 2 and not [p for p in cache.iterdir() if ".tmp" in p.name]
    # the same canvases again: read from the cache, not rendered (the folder is unchanged)
    stamp = {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")}
    build_dataset(
        "cluttered-fashion-mnist", "val", image_size=64, seed=4, cache_dir=str(cache), **tiny_opts(fmnist_root)
    )
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")} == stamp
    # other settings are other canvases: a new entry, never a stale read
    seed4 = build_dataset(
        "cluttered-fashion-mnist", "val", image_size=64, seed=4, cache_dir=str(cache), **tiny_opts(fmnist_root)
    )
    seed5 = build_dataset(
        "cluttered-fashion-mnist", "val", image_size=64, seed=5, cache_dir=str(cache), **tiny_opts(fmnist_root)
    )
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 3
    assert not torch.equal(seed5[0][0], seed4[0][0])


def test_canvas_cache_rendered_in_chunks_by_worker_pool_matches_one_process(fmnist_root, tmp_path, monkeypatch):
    from splitvit.data import cluttered

    monkeypatch.setattr(cluttered, "RENDER_CHUNK", 3)  # 20 val canvases: 7 chunks over the pool
    pools = []
    real_context = cluttered.multiprocessing.get_context

    def counting_context(method):
        ctx = real_context(method)
        original = ctx.Pool

        class Ctx:
            def Pool(self, n, **kwargs):  # noqa: N802 - multiprocessing's name
                pools.append((method, n))
                return original(n, **kwargs)

            def __getattr__(self, name):
                return getattr(ctx, name)

        return Ctx()

    monkeypatch.setattr(cluttered.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(cluttered.multiprocessing, "get_context", counting_context)
    for name in ("cluttered-fashion-mnist", "cluttered-fashion-mnist-seg"):
        plain = build_dataset(name, "val", image_size=64, seed=2, **tiny_opts(fmnist_root))
        cached = build_dataset(
            name, "val", image_size=64, seed=2, cache_dir=str(tmp_path / "c"), **tiny_opts(fmnist_root)
        )
        for i in range(len(plain)):  # every row written, by whichever worker
            a, b = plain[i], cached[i]
            assert (a[0] - b[0]).abs().max() <= 0.5 / 255 + 1e-6
            for x, y in zip(a[1:], b[1:]):
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))
    # not "fork": the tests' process runs Ray's threads, which a forked child may deadlock on
    assert pools == [("forkserver", 3), ("forkserver", 3)]
