"""Datasets over image folders: ImageNet's layout and ADE20K's layout.

Images are centre-cropped to a square and resized to ``image_size`` (masks with
nearest-neighbour, so class ids survive). The file lists are sorted, so the
datasets are deterministic; a corrupt file is skipped and counted (see
``SkippingDataset``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from PIL import Image

from .common import (
    IMAGE_EXTENSIONS,
    CorruptDataError,
    SkippingDataset,
    decode_mask,
    fit_square,
    image_to_tensor,
    mask_to_tensor,
    pil_resample,
    read_file,
    read_image_file,
)

log = logging.getLogger(__name__)


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


class ImageFolderDataset(SkippingDataset):
    """ImageNet layout ``root/{train,val,test}/CLASS/*.jpg``; items ``(image, class index)``.

    Class indices follow the sorted class folders of ``train`` (when present), so
    every split maps a class name to the same index.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str,
        *,
        image_size: int,
        strict: bool = False,
        interpolation: str = "bicubic",
    ) -> None:
        super().__init__(strict=strict)
        self.resample = pil_resample(interpolation)
        self.root = Path(root).expanduser()
        folder = self.root / split
        if not folder.is_dir():
            raise FileNotFoundError(
                f"imagefolder: {folder} does not exist (expected {self.root}/{{train,val}}/CLASS/*.jpg)"
            )
        reference = self.root / "train" if (self.root / "train").is_dir() else folder
        self.classes = sorted(d.name for d in reference.iterdir() if d.is_dir())
        index = {c: i for i, c in enumerate(self.classes)}
        unknown = sorted(d.name for d in folder.iterdir() if d.is_dir() and d.name not in index)
        if unknown:
            raise ValueError(f"imagefolder: {folder} has classes not in {reference}: {', '.join(unknown[:5])}")
        self.samples = [(str(p), index[d.name]) for d in sorted(folder.iterdir()) if d.is_dir() for p in _images_in(d)]
        if not self.samples:
            raise FileNotFoundError(f"imagefolder: no images ({', '.join(IMAGE_EXTENSIONS)}) under {folder}/CLASS/")
        self.num_classes = len(self.classes)
        self.image_size = image_size
        log.info("imagefolder %s: %d images of %d classes in %s", split, len(self.samples), self.num_classes, folder)

    def raw_len(self) -> int:
        return len(self.samples)

    def load_raw(self, raw_index: int):
        path, label = self.samples[raw_index]
        img = fit_square(read_image_file(path, min_size=self.image_size), self.image_size, self.resample)
        return image_to_tensor(img), label


class ADE20KDataset(SkippingDataset):
    """ADEChallengeData2016 layout: ``images/{training,validation}/*.jpg`` with
    ``annotations/{training,validation}/*.png`` of the same stem.

    Items ``(image, mask)``: annotation 0 ("other") becomes 255 (ignore), class k
    becomes k - 1, giving 150 classes 0..149. ``root`` may be the
    ``ADEChallengeData2016`` folder or its parent. ADE20K has no annotated test
    split, so ``split="test"`` is an error.
    """

    SPLITS = {"train": "training", "val": "validation"}
    num_classes = 150
    ignore_index = 255

    def __init__(
        self,
        root: str | os.PathLike,
        split: str,
        *,
        image_size: int,
        strict: bool = False,
        interpolation: str = "bicubic",
    ) -> None:
        super().__init__(strict=strict)
        self.resample = pil_resample(interpolation)
        root = Path(root).expanduser()
        if (root / "ADEChallengeData2016").is_dir():
            root = root / "ADEChallengeData2016"
        if split not in self.SPLITS:
            raise ValueError(f"ade20k has no annotated {split!r} split; use train or val")
        images_dir, ann_dir = root / "images" / self.SPLITS[split], root / "annotations" / self.SPLITS[split]
        for d in (images_dir, ann_dir):
            if not d.is_dir():
                raise FileNotFoundError(
                    f"ade20k: {d} does not exist (expected the ADEChallengeData2016 layout under {root})"
                )
        self.samples = []
        missing = 0
        for img in _images_in(images_dir):
            ann = ann_dir / (img.stem + ".png")
            if ann.is_file():
                self.samples.append((str(img), str(ann)))
            else:
                missing += 1
        if missing:
            log.warning(
                "ade20k: %d images in %s have no annotation in %s and are left out", missing, images_dir, ann_dir
            )
        if not self.samples:
            raise FileNotFoundError(f"ade20k: no annotated images in {images_dir}")
        self.root = root
        self.image_size = image_size
        log.info("ade20k %s: %d annotated images in %s", split, len(self.samples), images_dir)

    def raw_len(self) -> int:
        return len(self.samples)

    def load_raw(self, raw_index: int):
        img_path, ann_path = self.samples[raw_index]
        img = read_image_file(img_path)
        ann = decode_mask(read_file(ann_path), ann_path)
        if ann.size != img.size:  # misaligned pairs would teach wrong labels
            raise CorruptDataError(
                ann_path, f"annotation size {ann.size} differs from image size {img.size} of {img_path}"
            )
        img = fit_square(img, self.image_size, self.resample)
        mask = mask_to_tensor(fit_square(ann, self.image_size, Image.NEAREST))
        # 0 is "other/unlabelled" in ADE20K: ignore it and shift the 150 classes to 0..149
        mask = mask - 1
        mask[mask < 0] = self.ignore_index
        return image_to_tensor(img), mask
