"""Split policies: which quadtree nodes split into four finer patches.

Every policy shares one interface: ``policy(images, geometry, context)`` returns one
score tensor ``(B, H_l, W_l)`` in ``[0, 1]`` per non-finest level. A node splits when
its score exceeds its level's threshold ``tau_l`` (and its parent split). ``full``
and ``coarse`` are fixed and ignore thresholds.

The learned policy (SPLIT) scores nodes from the model's own features: the
coarse tokens after a few of the ViT's own blocks (``context.coarse_features``),
and each node's own embedding at its scale (``context.node_embeddings``). With a
``width`` it runs a few narrow blocks of its own on the coarse embeddings instead
of the ViT's: at ViT-B size one shared block on the coarse tokens costs about 4%
of a forward pass at half the tokens, a width-192 block about 0.3%. A
``budget_conditioned`` policy is also told the batch's target token ratio
(``context.budget``), so that one model serves every budget. With ``level_context``
a finer level's node is scored from what the same blocks make of that level's
nodes seen together (``context.level_features``), not from its embedding alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Block

from .names import EVIDENCE_POOLINGS, POLICY_NAMES
from .quadtree import QuadtreeGeometry, repeat_cells


@dataclass
class PolicyContext:
    """What the model can tell a policy about an image batch.

    Attributes:
        coarse_features: ``(B, H_0, W_0, D)`` coarse tokens after the ViT's first
            ``policy.depth`` blocks, or ``None`` for policies that do not use them.
        node_embeddings: per non-finest level ``(B, H_l, W_l, D)`` token embeddings
            (patch + position + level) of every node at that level.
        budget: ``(B,)`` target token ratio per image, for a budget-conditioned
            policy; ``None`` when the model tells none.
        level_features: per non-finest level ``(B, H_l, W_l, D)``, every node after
            the ViT's first ``policy.depth`` blocks on the sequence of all that
            level's nodes (level 0: ``coarse_features``), for a ``level_context``
            policy without blocks of its own; ``None`` otherwise.
        fine_embeddings: ``(B, H, W, D)`` the finest level's token embeddings, for a
            ``fine_evidence`` policy; ``None`` otherwise.
    """

    coarse_features: torch.Tensor | None = None  # the coarse embeddings for a policy with its own blocks
    node_embeddings: list[torch.Tensor] | None = None
    budget: torch.Tensor | None = None
    level_features: list[torch.Tensor] | None = None
    fine_embeddings: torch.Tensor | None = None


class SplitPolicy(nn.Module):
    """Base class. Subclasses implement :meth:`forward` returning per-level scores."""

    name: str = ""
    #: True when decisions come from ``score > tau_l``; False for fixed policies.
    thresholded: bool = True
    #: True for a trained policy: it needs ``PolicyContext`` features, its scores are
    #: split probabilities (they define the expected token count), and its training
    #: decisions are sampled.
    learned: bool = False

    def forward(self, images: torch.Tensor, geometry: QuadtreeGeometry, context: PolicyContext) -> list[torch.Tensor]:
        raise NotImplementedError


def _level_shapes(images: torch.Tensor, geometry: QuadtreeGeometry) -> list[tuple[int, int, int]]:
    return [(images.shape[0], *geometry.grid(level)) for level in range(geometry.levels - 1)]


class FullPolicy(SplitPolicy):
    """Always split: a plain ViT at the finest patch size."""

    name = "full"
    thresholded = False

    def forward(self, images, geometry, context):
        return [torch.ones(s, device=images.device) for s in _level_shapes(images, geometry)]


class CoarsePolicy(SplitPolicy):
    """Never split: a plain ViT at the coarsest patch size."""

    name = "coarse"
    thresholded = False

    def forward(self, images, geometry, context):
        return [torch.zeros(s, device=images.device) for s in _level_shapes(images, geometry)]


class RandomPolicy(SplitPolicy):
    """Uniform random scores; with thresholds calibrated to a token budget this is
    random splitting at a matched budget. ``seed`` makes evaluation repeatable."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed

    def forward(self, images, geometry, context):
        gen = None
        if self.seed is not None:
            gen = torch.Generator(device=images.device).manual_seed(self.seed)
        return [torch.rand(s, generator=gen, device=images.device) for s in _level_shapes(images, geometry)]


class EntropyPolicy(SplitPolicy):
    """APT-style baseline: a node's score is the Shannon entropy of its grey-level
    histogram, normalised to ``[0, 1]`` by the largest entropy the node can have."""

    name = "entropy"

    def __init__(self, bins: int = 32) -> None:
        super().__init__()
        if bins < 2:
            raise ValueError(f"entropy bins must be >= 2, got {bins}")
        self.bins = bins

    def bin_indices(self, images: torch.Tensor) -> torch.Tensor:
        """Per-pixel grey-level bin ``(B, H, W)`` (int64), after a per-image min-max
        stretch so that every image uses the whole range of bins."""
        grey = images.float().mean(1)
        lo = grey.flatten(1).min(1).values.view(-1, 1, 1)
        hi = grey.flatten(1).max(1).values.view(-1, 1, 1)
        grey = (grey - lo) / (hi - lo).clamp_min(1e-6)
        return (grey * self.bins).long().clamp_(0, self.bins - 1)

    def histograms(self, idx: torch.Tensor, cell: int) -> torch.Tensor:
        """Bin counts of every ``cell x cell`` node: ``(B, H / cell, W / cell, bins)``.

        One ``scatter_add_`` over flat (image, node, bin) indices: no one-hot tensor,
        memory proportional to the pixels, not to pixels times bins. Counts are
        float32 (exact below 2**24 pixels per node).
        """
        b, h, w = idx.shape
        gh, gw = h // cell, w // cell
        rows = torch.arange(h, device=idx.device) // cell
        cols = torch.arange(w, device=idx.device) // cell
        node = (rows[:, None] * gw + cols[None, :]) * self.bins  # (H, W)
        image = torch.arange(b, device=idx.device).view(-1, 1, 1) * (gh * gw * self.bins)
        flat = (image + node + idx).flatten()
        counts = torch.zeros(b * gh * gw * self.bins, device=idx.device)
        counts.scatter_add_(0, flat, torch.ones((), device=idx.device).expand(flat.numel()))
        return counts.view(b, gh, gw, self.bins)

    @torch.no_grad()
    def forward(self, images, geometry, context):
        idx = self.bin_indices(images)
        # histograms of the finest non-finest level; each coarser level sums its children's
        level = geometry.levels - 2
        counts = self.histograms(idx, geometry.cell_size(level))
        scores: list[torch.Tensor] = []
        while True:
            size = geometry.cell_size(level)
            freq = counts / (size * size)
            ent = -(freq * freq.clamp_min(1e-12).log()).sum(-1)
            scores.append((ent / math.log(min(self.bins, size * size))).clamp(0, 1))
            if level == 0:
                break
            b, gh, gw, bins = counts.shape
            counts = counts.view(b, gh // 2, 2, gw // 2, 2, bins).sum((2, 4))
            level -= 1
        return scores[::-1]


class LearnedPolicy(SplitPolicy):
    """SPLIT's learned policy.

    A node at level ``l`` is scored from (a) the feature of its coarse ancestor after
    the ViT's first blocks — what the model itself makes of the region in context —
    and (b) the node's own embedding at its scale. One small MLP per level maps
    their sum to a logit; ``sigmoid(logit)`` is the split probability.

    With ``width``, the policy has blocks of its own (:attr:`own_blocks`): the coarse
    embeddings and node embeddings are projected to ``width`` and the coarse ones
    pass through ``depth`` timm ``Block`` modules of that width (``width // 64`` heads,
    at least one) before the heads; the model then runs none of its own blocks for
    the policy.

    With ``level_context``, (b) becomes a contextual feature at every level ``l > 0``:
    the blocks that make the coarse features (the ViT's first ones, whose output the
    model passes as ``context.level_features``, or the policy's own) run on all
    level-``l`` nodes together, so whether a mid-sized node holds the object or clutter
    is judged beside its neighbours, not from its linear embedding alone. It costs
    those blocks once more per finer level: on a quarter of the finest level's tokens
    for the level above it.

    With ``fine_evidence``, every node's logit also gets the largest of a per-patch
    score over the finest patches it covers (one small MLP on the finest level's
    embeddings, ``context.fine_embeddings``, one output per scored level, max-pooled
    to the level's grid): a node splits when any patch under it looks like it matters,
    the oracle's own rule, which a node's embedding, a mix of its patches, blurs. Its
    last layer starts at zero, so at initialisation it adds nothing; it costs one MLP on
    the finest level's embeddings, about a twelfth of a block at full resolution. With
    ``evidence_pooling="soft"`` a node takes the log-mean-exp of its patches' scores
    instead of their maximum: also zero at initialisation and near the maximum once the
    scores part, but every patch gets a share of the gradient, where the maximum of
    tied scores passes all of it to the first patch.

    With ``budget_conditioned``, an embedding of the target token ratio
    (``context.budget``, :attr:`budget_embed`) is added to the coarse features that
    enter every level's head (after the policy's own blocks): the policy learns to
    split more when told a larger budget. Its last layer starts at zero, so at
    initialisation the policy scores exactly as an unconditioned one.
    """

    name = "learned"
    learned = True

    def __init__(
        self,
        embed_dim: int,
        levels: int,
        hidden_dim: int | None = None,
        detach_features: bool = True,
        width: int | None = None,
        depth: int = 0,
        budget_conditioned: bool = False,
        level_context: bool = False,
        fine_evidence: bool = False,
        evidence_pooling: str = "max",
    ):
        super().__init__()
        if evidence_pooling not in EVIDENCE_POOLINGS:
            raise ValueError(f"evidence_pooling must be 'max' or 'soft', got {evidence_pooling!r}")
        self.evidence_pooling = evidence_pooling
        if level_context and levels < 3:
            raise ValueError(f"level_context needs levels >= 3 (only the coarsest level is scored), got {levels}")
        self.level_context = level_context
        self.detach_features = detach_features
        self.own_blocks = width is not None
        if width is not None:
            heads = max(1, width // 64)
            if width < 1 or width % heads:
                raise ValueError(
                    f"policy.width must be a positive multiple of its {heads} attention head(s), got {width}"
                )
            if depth < 0:
                raise ValueError(f"policy.depth must be >= 0, got {depth}")
            self.proj = nn.Linear(embed_dim, width)
            self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        dim = width if width is not None else embed_dim
        hidden = hidden_dim or dim
        self.heads = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))
            for _ in range(levels - 1)
        )
        self.fine_evidence = fine_evidence
        if fine_evidence:
            self.evidence = nn.Sequential(
                nn.LayerNorm(embed_dim), nn.Linear(embed_dim, hidden), nn.GELU(), nn.Linear(hidden, levels - 1)
            )
            nn.init.zeros_(self.evidence[-1].weight)  # adds nothing at initialisation
            nn.init.zeros_(self.evidence[-1].bias)
        self.budget_conditioned = budget_conditioned
        if budget_conditioned:
            self.budget_embed = nn.Sequential(nn.Linear(1, dim), nn.GELU(), nn.Linear(dim, dim))
            # zero output at init: conditioning starts as a no-op and is learned
            nn.init.zeros_(self.budget_embed[-1].weight)
            nn.init.zeros_(self.budget_embed[-1].bias)

    def _encode(self, feats: torch.Tensor) -> torch.Tensor:
        """The policy's own blocks on projected embeddings ``(B, H, W, width)``: the
        coarse level's, and with ``level_context`` every scored level's."""
        b, h, w, _ = feats.shape
        x = self.proj(feats).reshape(b, h * w, -1)
        return self.blocks(x).reshape(b, h, w, -1)

    def _embed_budget(self, budget: torch.Tensor | None, feats: torch.Tensor) -> torch.Tensor:
        """The budget embedding ``(B, 1, 1, dim)``, broadcast over the coarse grid."""
        if budget is None:
            raise ValueError("a budget-conditioned policy needs the target token ratio (PolicyContext.budget)")
        if budget.shape != (feats.shape[0],):
            raise ValueError(
                f"PolicyContext.budget must hold one target ratio per image, shape ({feats.shape[0]},), "
                f"got {tuple(budget.shape)}"
            )
        weight = self.budget_embed[0].weight
        return self.budget_embed(budget.to(weight.device, weight.dtype).unsqueeze(-1))[:, None, None, :]

    def logits(self, images, geometry, context: PolicyContext) -> list[torch.Tensor]:
        if context.coarse_features is None or context.node_embeddings is None:
            raise ValueError("the learned policy needs the model's coarse features and node embeddings")
        if self.level_context and not self.own_blocks and context.level_features is None:
            raise ValueError("a level_context policy needs every level's features (PolicyContext.level_features)")
        if self.fine_evidence and context.fine_embeddings is None:
            raise ValueError(
                "a fine_evidence policy needs the finest level's embeddings (PolicyContext.fine_embeddings)"
            )
        feats = context.coarse_features.detach() if self.detach_features else context.coarse_features
        if self.own_blocks:
            feats = self._encode(feats)
        if self.budget_conditioned:
            feats = feats + self._embed_budget(context.budget, feats)
        evidence = self._fine_evidence(context.fine_embeddings) if self.fine_evidence else None
        out = []
        for level, head in enumerate(self.heads):
            contextual = self.level_context and level > 0
            shared_context = contextual and not self.own_blocks  # the model ran its blocks on this level
            node = context.level_features[level] if shared_context else context.node_embeddings[level]
            if self.detach_features:
                node = node.detach()
            if self.own_blocks:
                node = self._encode(node) if contextual else self.proj(node)
            # float32 heads, autocast or not: bf16 probabilities near 0.5 are 1/256 apart,
            # so thresholds calibrated to a token budget would land between tied scores
            with torch.autocast(device_type=feats.device.type, enabled=False):
                logit = head((feats + node).float()).squeeze(-1)
                if evidence is not None:
                    logit = logit + self._pool_evidence(evidence[:, level], evidence.shape[-1] // logit.shape[-1])
                out.append(logit)
            if level + 1 < len(self.heads):  # carry the ancestor's feature down to the next level's grid
                feats = repeat_cells(feats, 2, dim=1)
        return out

    def _pool_evidence(self, evidence: torch.Tensor, factor: int) -> torch.Tensor:
        """Per-patch evidence ``(B, H, W)`` -> each ``factor x factor`` node's ``(B, H/f, W/f)``:
        the maximum, or with ``soft`` pooling the log-mean-exp."""
        if self.evidence_pooling == "max":
            return F.max_pool2d(evidence, factor)
        b, h, w = evidence.shape
        cells = evidence.reshape(b, h // factor, factor, w // factor, factor).transpose(2, 3)
        return torch.logsumexp(cells.reshape(b, h // factor, w // factor, -1), dim=-1) - math.log(factor * factor)

    def _fine_evidence(self, fine: torch.Tensor) -> torch.Tensor:
        """Per-patch evidence ``(B, levels - 1, H, W)`` from the finest embeddings
        ``(B, H, W, D)``, in float32 (see the heads)."""
        if self.detach_features:
            fine = fine.detach()
        with torch.autocast(device_type=fine.device.type, enabled=False):
            return self.evidence(fine.float()).permute(0, 3, 1, 2)

    def forward(self, images, geometry, context):
        return [torch.sigmoid(z) for z in self.logits(images, geometry, context)]


def check_split_probabilities(probs: list[torch.Tensor]) -> None:
    """Raise ``FloatingPointError`` when a policy's split probabilities are not finite.

    A diverging learned policy yields NaN probabilities, which ``torch.bernoulli`` and
    binary cross-entropy reject with a ``RuntimeError``: a worker crash, where the
    training loop should see a divergence (as for a NaN loss). One check, one sync.
    """
    if not bool(torch.stack([p.detach().isfinite().all() for p in probs]).all()):
        levels = [level for level, p in enumerate(probs) if not bool(p.detach().isfinite().all())]
        raise FloatingPointError(f"non-finite split probabilities from the policy at level(s) {levels}")


def build_policy(name: str, *, embed_dim: int = 0, levels: int = 2, seed: int | None = None, **kwargs) -> SplitPolicy:
    """Build a policy by name (one of :data:`POLICY_NAMES`)."""
    if name == "learned":
        return LearnedPolicy(embed_dim, levels, **kwargs)
    if name == "entropy":
        return EntropyPolicy(**kwargs)
    if name == "random":
        return RandomPolicy(seed=seed)
    if name == "full":
        return FullPolicy()
    if name == "coarse":
        return CoarsePolicy()
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
