"""Where a forward pass spends its time: a clock that a benchmark attaches to a model.

:class:`SplitViT` marks the stages of its forward pass (level embeddings, fine
aggregation, the policy's blocks, level context, the policy's heads, decisions,
gather, packing, blocks, head) with :meth:`StageClock.stage`; a detector adds its
pyramid, proposals, RoI heads and mask pasting (:data:`DETECTOR_STAGES`). Without a clock
attached (the default) a mark costs one attribute read; with one, every stage's
wall time is added up, a nested stage's time counted once, in the innermost stage.
``splitvit bench parts`` reads it (:mod:`splitvit.bench.parts`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The stages a SplitViT forward pass marks, in the order they run.
STAGES = (
    "embedding",  # patch embedding of every level a pass needs, position and level embeddings
    "aggregation",  # fine aggregation into coarse tokens (model.fine_aggregation)
    "policy_blocks",  # the ViT's first blocks on the coarse tokens, for the learned policy
    "level_context",  # the same blocks on every finer level's nodes (model.policy.level_context)
    "policy_head",  # the policy itself: heads (learned), histograms (entropy), ...
    "decision",  # thresholds, top-down decisions, leaf masks, token counts
    "gather",  # each image's leaves into one sequence (the one host read)
    "packing",  # packed layout and attention kernel indices, pack and unpack
    "blocks",  # the ViT's blocks and final norm on the leaf sequences
    "head",  # pooling and classifier, or the dense head (a detector's backbone: the fine map)
)

#: The stages a :class:`~splitvit.model.detection.SplitDetector` marks after its
#: backbone's (on the backbone's clock), in the order they run.
DETECTOR_STAGES = (
    "pyramid",  # the simple feature pyramid on the fine map
    "proposals",  # the region proposal network: its head, anchors, decoding, NMS
    "roi_heads",  # RoIAlign, the box head and predictor, post-processing, the mask head
    "paste",  # the mask head's masks pasted into their boxes at image size
)


class StageClock:
    """Seconds per stage, summed over the forward passes run while it is attached.

    Args:
        sync: called before every reading of the clock (``torch.cuda.synchronize`` on
            CUDA, so that a stage's queued kernels count in that stage).
    """

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._stack: list[str] = []
        self._last = 0.0

    def _lap(self) -> None:
        self.sync()
        now = time.perf_counter()
        if self._stack:
            name = self._stack[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Count the time until the block exits as ``name`` (less its nested stages')."""
        self._lap()
        self._stack.append(name)
        try:
            yield
        finally:
            self._lap()
            self._stack.pop()

    def reset(self) -> None:
        """Forget the seconds counted so far."""
        self.seconds = {}
