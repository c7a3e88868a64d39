"""The SPLIT model: quadtree geometry, split policies, mixed-scale SplitViT, heads."""

from .policies import POLICY_NAMES, EntropyPolicy, LearnedPolicy, PolicyContext, RandomPolicy, SplitPolicy, build_policy
from .quadtree import GeometryError, QuadtreeGeometry, expected_tokens, leaf_masks, token_counts, top_down_decisions
from .splitvit import SplitOutput, SplitViT, validate_thresholds

__all__ = [
    "POLICY_NAMES",
    "EntropyPolicy",
    "GeometryError",
    "LearnedPolicy",
    "PolicyContext",
    "QuadtreeGeometry",
    "RandomPolicy",
    "SplitOutput",
    "SplitPolicy",
    "SplitViT",
    "build_policy",
    "expected_tokens",
    "leaf_masks",
    "token_counts",
    "top_down_decisions",
    "validate_thresholds",
]
