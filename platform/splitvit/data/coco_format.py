"""The shape of a COCO instances file, checked without torch.

:func:`parse_coco_document` is the first part of :func:`~splitvit.data.coco.load_coco_index`'s
check (valid JSON, an object at the top, ``images``, ``annotations`` and
``categories`` lists of objects); :func:`check_coco_file` runs it on a local file
before torch loads, so that ``splitvit data prepare coco`` and ``splitvit train`` on
a malformed file say so in a second rather than after torch's import. The entries
themselves (ids, boxes, segmentations, image files) are checked by ``load_coco_index``.
"""

from __future__ import annotations

import json
import os
from typing import NotRequired, TypedDict

from ..jsontypes import JsonObject

#: Top-level keys every COCO instances file has.
REQUIRED_KEYS = ("images", "annotations", "categories")
#: Larger local files are left to ``load_coco_index`` alone: parsing them twice would
#: cost more than the torch import the early check saves (COCO's train file: 450 MB).
EARLY_CHECK_MAX_BYTES = 64 * 2**20


# A COCO instances file's entries: typed dicts, since they stay the file's own objects (pycocotools
# reads them, shards copy them out as they are); a file's further keys (``license``...) ride along.
class CocoRle(TypedDict):
    """A mask as run-length encoding: ``size`` [height, width]; ``counts`` a list
    (uncompressed) or a string (compressed)."""

    size: list[int]
    counts: list[int] | str


class CocoImage(TypedDict):
    """An entry of ``images``: the keys every image has (checked by ``load_coco_index``)."""

    id: int
    file_name: str
    width: int
    height: int


class CocoAnnotation(TypedDict):
    """An entry of ``annotations``: bbox x, y, width, height in its image's pixels;
    segmentation polygons ``[x1, y1, x2, y2, ...]`` or an RLE."""

    id: int
    image_id: int
    category_id: int
    bbox: list[float]
    segmentation: list[list[float]] | CocoRle
    area: NotRequired[float]
    iscrowd: NotRequired[int]


class CocoCategory(TypedDict):
    """An entry of ``categories``."""

    id: int
    name: str


class CocoDocument(TypedDict):
    """A COCO instances document (a file's further top-level keys, ``info``, ``licenses``, ride along)."""

    images: list[CocoImage]
    annotations: list[CocoAnnotation]
    categories: list[CocoCategory]


class CocoFormatError(ValueError):
    """An annotation file that is not valid COCO instances data; the message names the file and the id."""


def coco_error(source: str, what: str) -> CocoFormatError:
    """The error for ``source``: ``<file>: <what is wrong>``."""
    return CocoFormatError(f"{source}: {what}")


def coco_entries_of(data: JsonObject, key: str, source: str) -> list[JsonObject]:
    """``data[key]``, which must be a list of objects."""
    if key not in data:
        raise coco_error(
            source, f"missing top-level key {key!r} (a COCO instances file has {', '.join(REQUIRED_KEYS)})"
        )
    value = data[key]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise coco_error(source, f"top-level key {key!r} must be a list of objects, got {type(value).__name__}")
    return value


def parse_coco_document(raw: bytes | str, source: str) -> JsonObject:
    """The parsed file: raises :class:`CocoFormatError` naming ``source`` unless it is
    JSON whose top level is an object holding the three lists of objects."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise coco_error(source, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError as exc:
        raise coco_error(source, f"not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(data, dict):
        raise coco_error(source, f"not a COCO instances file: the top level is a {type(data).__name__}, not an object")
    for key in REQUIRED_KEYS:
        coco_entries_of(data, key, source)
    return data


def check_coco_file(path: str, key: str) -> None:
    """Before torch loads: a local annotation file exists and has COCO's shape
    (:func:`parse_coco_document`). ``key`` names the setting in the error (an option or
    a config key). ``s3://`` files and files over :data:`EARLY_CHECK_MAX_BYTES` are
    left to ``load_coco_index``. Raises ``FileNotFoundError`` or :class:`CocoFormatError`."""
    if "://" in path and not path.startswith("file://"):
        return
    local = os.path.expanduser(path[len("file://") :] if path.startswith("file://") else path)
    if not os.path.isfile(local):
        raise FileNotFoundError(f"{key}: COCO annotation file {path} does not exist")
    if os.path.getsize(local) > EARLY_CHECK_MAX_BYTES:
        return
    with open(local, "rb") as f:
        raw = f.read()
    try:
        parse_coco_document(raw, path)
    except CocoFormatError as exc:
        raise CocoFormatError(f"{key}: {exc}") from None
