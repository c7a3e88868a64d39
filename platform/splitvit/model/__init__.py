"""The SPLIT model: quadtree geometry, split policies, mixed-scale SplitViT, heads, the detector."""

from __future__ import annotations

import importlib
from typing import Any

# Each name loads its module on first use: the names (``splitvit.model.names``) are read
# by checks that run before torch loads, and the model needs torch.
_WHERE = {
    "POLICY_NAMES": "names",
    "DetectorOutput": "detection",
    "EntropyPolicy": "policies",
    "GeometryError": "quadtree",
    "LearnedPolicy": "policies",
    "ModelSpec": "spec",
    "PolicyContext": "policies",
    "QuadtreeGeometry": "quadtree",
    "RandomPolicy": "policies",
    "SimpleFeaturePyramid": "detection",
    "SplitOutput": "splitvit",
    "SplitDetector": "detection",
    "SplitPolicy": "policies",
    "SplitViT": "splitvit",
    "build_policy": "policies",
    "expected_tokens": "quadtree",
    "leaf_masks": "quadtree",
    "token_counts": "quadtree",
    "top_down_decisions": "quadtree",
    "validate_thresholds": "splitvit",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
