"""Small helpers shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def walk_numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON-like structure, with its path (``.a.b[2]``); booleans skipped."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk_numbers(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk_numbers(v, f"{path}[{i}]")
