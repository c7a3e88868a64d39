"""The one name for a JSON object where a record meets a file: ``JsonObject``.

A typed record (a dataclass) is what the parts hand each other; ``JsonObject`` is its
JSON form at an edge (``to_dict``/``from_dict``: a file, a Tune report, an MLflow
artifact). A ``dict[str, Any]`` elsewhere marks a record still untyped. The lowest
layer: every part may import it, and it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

#: a JSON object as written to or read from a file (keys as in the file)
JsonObject = dict[str, Any]
