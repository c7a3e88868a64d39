"""The learned policy's inputs (issue #12): with ``policy_level_context`` a finer
level's node is judged beside every node of its level, after the policy's blocks,
not from its own patch embedding and its coarse ancestor alone."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from splitvit.config import BudgetConfig, ConfigError, PolicyTrainingConfig, TeacherConfig
from splitvit.model import SplitViT
from splitvit.model.policies import LearnedPolicy, PolicyContext
from splitvit.train.experiment import load_experiment
from splitvit.train.steps import SplitLossConfig, training_step

from .helpers import tiny_model

SMOKE = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "smoke.yaml"


def scores(model: SplitViT, images: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.eval().split_scores(images)


def shuffle_within_coarse_pixels(images: torch.Tensor, rows: slice, cols: slice, block: int) -> torch.Tensor:
    """``images`` with the pixels of every ``block x block`` square inside the region
    ``rows, cols`` shuffled: the area-resized image at ``1 / block`` (what the coarse
    tokens embed) is unchanged, the finer levels' patches are not."""
    out = images.clone()
    gen = torch.Generator().manual_seed(0)
    region = out[:, :, rows, cols]
    b, c, h, w = region.shape
    squares = region.reshape(b, c, h // block, block, w // block, block).permute(0, 1, 2, 4, 3, 5)
    squares = squares.reshape(b, c, h // block, w // block, block * block)
    squares = squares[..., torch.randperm(block * block, generator=gen)]
    squares = squares.reshape(b, c, h // block, w // block, block, block).permute(0, 1, 2, 4, 3, 5)
    out[:, :, rows, cols] = squares.reshape(b, c, h, w)
    return out


@pytest.mark.parametrize("width", [None, 16])
def test_a_finer_node_is_judged_beside_its_neighbours(width):
    """The tiny model: 32-px images, coarse 16-px nodes (2 x 2), 8-px nodes (4 x 4).
    Shuffling pixels inside the 4-px squares of the right half leaves every coarse
    token as it was (the coarse level embeds the image area-resized by 4) and changes
    the 8-px nodes there. A plain policy scores the left half's 8-px nodes from their
    own embedding and their coarse ancestor, so their scores stay; a level-context
    policy sees the right half's 8-px nodes beside them, so theirs move."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    shuffled = shuffle_within_coarse_pixels(images, slice(0, 32), slice(16, 32), block=4)
    for level_context in (False, True):
        model = tiny_model(width=width, level_context=level_context)
        before, after = scores(model, images), scores(model, shuffled)
        # the coarse level saw the same tokens (up to the pooling's summation order)
        assert torch.allclose(before[0], after[0], rtol=0, atol=1e-6)
        left = (before[1][:, :, :2] - after[1][:, :, :2]).abs().max()
        right = (before[1][:, :, 2:] - after[1][:, :, 2:]).abs().max()
        assert right > 1e-4  # the shuffled nodes' own embeddings changed
        # measured: plain 0 / 6e-8 (float noise), level context 1.1e-4 / 2.4e-3
        if level_context:
            assert left > 1e-5
        else:
            assert left < 1e-6


def test_level_context_uses_the_blocks_that_make_the_coarse_features():
    """Without blocks of its own, the policy's level-1 input is the ViT's first
    ``policy_depth`` blocks run on all level-1 nodes, what the coarse level gets from
    them on all coarse nodes (the same function, :meth:`SplitViT._context_features`)."""
    model = tiny_model(level_context=True).eval()
    images = torch.rand(2, 3, 32, 32)
    seen: list[PolicyContext] = []
    policy_forward = model.policy.forward
    model.policy.forward = lambda images, geometry, context: (
        seen.append(context) or policy_forward(images, geometry, context)
    )
    scores(model, images)
    (context,) = seen
    assert context.level_features is not None and len(context.level_features) == 2
    assert context.level_features[0] is context.coarse_features
    with torch.no_grad():
        expected = model._context_features(context.node_embeddings[1])
    assert context.level_features[1].shape == (2, 4, 4, model.embed_dim)
    assert torch.allclose(context.level_features[1], expected)
    assert not torch.allclose(context.level_features[1], context.node_embeddings[1])


def test_level_context_survives_a_checkpoint(tmp_path):
    model = tiny_model(level_context=True)
    model.save(tmp_path / "model.pt")
    loaded = SplitViT.load(tmp_path / "model.pt")
    assert loaded.policy.level_context and loaded.spec.policy.level_context is True
    images = torch.rand(2, 3, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(scores(model, images), scores(loaded, images)))
    # other policies ignore it: the control fine-tuned from the same spec builds as ever
    assert not hasattr(SplitViT.load(tmp_path / "model.pt", policy="entropy").policy, "level_context")


def test_a_training_step_with_level_context_trains_the_finer_level():
    """A SPLIT training step runs with the setting and its loss reaches the level-1
    head that now reads the contextual features."""
    model = tiny_model(level_context=True).train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=0),
        teacher=TeacherConfig(weight=1.0),
        budget=BudgetConfig(target_ratio=0.5),
    )
    loss, _ = training_step(model, images, labels, cfg, epoch=0)
    loss.backward()
    head = model.policy.heads[1][1].weight.grad
    assert head is not None and head.abs().sum() > 0


def test_bad_level_context_settings_name_the_problem():
    with pytest.raises(ValueError, match="level_context needs levels >= 3"):
        LearnedPolicy(8, 2, level_context=True)
    policy = LearnedPolicy(8, 3, level_context=True)
    context = PolicyContext(
        coarse_features=torch.zeros(1, 2, 2, 8), node_embeddings=[torch.zeros(1, 2, 2, 8), torch.zeros(1, 4, 4, 8)]
    )
    with pytest.raises(ValueError, match="level_features"):
        policy(torch.zeros(1, 3, 32, 32), None, context)
    with pytest.raises(ConfigError) as err:
        load_experiment(SMOKE, ["model.levels=2", "model.image_size=32", "model.policy.level_context=true"])
    assert err.value.key == "model.policy.level_context"
    assert "needs model.levels >= 3" in str(err.value)


@pytest.mark.parametrize("level_context", [False, True])
def test_policy_feature_grad_trains_the_blocks_its_features_come_from(level_context):
    """A loss on the scores of :meth:`SplitViT.forward` reaches the ViT's first block
    (the policy's context) only with ``policy_feature_grad``; :meth:`split_scores`, what
    the policy's own epochs train on, keeps it detached either way."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    for feature_grad in (False, True):
        model = tiny_model(level_context=level_context, feature_grad=feature_grad).train()
        assert model.policy.detach_features is not feature_grad
        block = model.vit.blocks[0].attn.qkv.weight
        head = model.policy.heads[1][1].weight
        sum(p.sum() for p in model(images).split_probs).backward()
        assert head.grad is not None and head.grad.abs().sum() > 0
        if feature_grad:
            assert block.grad is not None and block.grad.abs().sum() > 0
        else:
            assert block.grad is None
        model.zero_grad(set_to_none=True)
        sum(p.sum() for p in model.split_scores(images)).backward()
        assert head.grad is not None and head.grad.abs().sum() > 0
        assert block.grad is None and model.level_embed.grad is None


def test_policy_feature_grad_is_a_model_setting_that_survives_a_checkpoint(tmp_path):
    config = load_experiment(SMOKE, ["model.policy.feature_grad=true"])
    assert config.model.policy.feature_grad is True
    model = tiny_model(feature_grad=True)
    model.save(tmp_path / "model.pt")
    loaded = SplitViT.load(tmp_path / "model.pt")
    assert loaded.spec.policy.feature_grad is True and loaded.policy.detach_features is False
    with pytest.raises(ConfigError) as err:
        load_experiment(SMOKE, ["model.policy.feature_grad=maybe"])
    assert err.value.key == "model.policy.feature_grad"


def test_fine_evidence_adds_nothing_at_initialisation():
    """Its last layer starts at zero: a model given the setting scores as the same
    weights without it, so a fine-tune from a reference starts where the plain policy does."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    plain = tiny_model(level_context=True)
    model = tiny_model(level_context=True, fine_evidence=True)
    missing = model.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing and all(key.startswith("policy.evidence.") for key in missing)
    assert all(torch.equal(a, b) for a, b in zip(scores(plain, images), scores(model, images)))


def test_fine_evidence_raises_every_node_over_the_telling_patch():
    """A node's logit gains the largest evidence of the finest patches it covers: with
    evidence read off one embedding channel, one patch's value lifts its ancestors at
    every level and no other node."""
    dim, levels = 8, 3
    policy = LearnedPolicy(dim, levels)
    policy.fine_evidence = True
    policy.evidence = torch.nn.Linear(dim, levels - 1, bias=False)
    with torch.no_grad():
        policy.evidence.weight.zero_()
        policy.evidence.weight[:, 0] = 1.0  # both levels' evidence: channel 0 of a patch's embedding
    gen = torch.Generator().manual_seed(4)
    context = PolicyContext(
        coarse_features=torch.randn(1, 1, 1, dim, generator=gen),
        node_embeddings=[torch.randn(1, 1, 1, dim, generator=gen), torch.randn(1, 2, 2, dim, generator=gen)],
        fine_embeddings=torch.zeros(1, 4, 4, dim),
    )
    images = torch.zeros(1, 3, 32, 32)
    before = policy.logits(images, None, context)
    context.fine_embeddings[0, 1, 2, 0] = 5.0  # a patch under the level-1 node (0, 1)
    after = policy.logits(images, None, context)
    assert torch.allclose(after[0] - before[0], torch.full((1, 1, 1), 5.0))
    lifted = torch.zeros(1, 2, 2)
    lifted[0, 0, 1] = 5.0
    assert torch.allclose(after[1] - before[1], lifted)
    with pytest.raises(ValueError, match="fine_embeddings"):
        policy.logits(images, None, dataclasses.replace(context, fine_embeddings=None))


def test_fine_evidence_learns_and_survives_a_checkpoint(tmp_path):
    model = tiny_model(level_context=True, fine_evidence=True).train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    loss, _ = training_step(
        model,
        images,
        labels,
        SplitLossConfig(policy=PolicyTrainingConfig(warmup_epochs=0), budget=BudgetConfig(target_ratio=0.5)),
        epoch=0,
    )
    loss.backward()
    last = model.policy.evidence[-1].weight.grad
    assert last is not None and last.abs().sum() > 0
    with torch.no_grad():
        model.policy.evidence[-1].weight.normal_()  # as if trained: the evidence now counts
    model.save(tmp_path / "model.pt")
    loaded = SplitViT.load(tmp_path / "model.pt")
    assert loaded.spec.policy.fine_evidence is True and loaded.policy.fine_evidence
    assert all(torch.equal(a, b) for a, b in zip(scores(model, images), scores(loaded, images)))
    assert load_experiment(SMOKE, ["model.policy.fine_evidence=true"]).model.policy.fine_evidence is True


@pytest.mark.parametrize("pooling", ["max", "soft"])
def test_evidence_pooling_reads_each_nodes_patches_and_soft_pooling_spreads_the_gradient(pooling):
    """``max`` takes a node's most telling patch and passes the gradient to it alone (to
    the first of tied patches, as at initialisation); ``soft`` is the log-mean-exp of
    the node's patches: zero where they all are, near the max once they part, and every
    patch gets its softmax share of the gradient."""
    policy = LearnedPolicy(8, 3, fine_evidence=True, evidence_pooling=pooling)
    values = torch.tensor([[0.0, 1.0, 4.0, -2.0], [2.0, -1.0, 0.5, 0.5], [0.0, 0.0, 9.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    pooled = policy._pool_evidence(values[None], 2)[0]
    for row in range(2):
        for col in range(2):
            cell = values[2 * row : 2 * row + 2, 2 * col : 2 * col + 2].flatten()
            expected = cell.max() if pooling == "max" else torch.logsumexp(cell, 0) - math.log(4)
            assert pooled[row, col] == pytest.approx(float(expected), abs=1e-6)
    tied = torch.zeros(1, 4, 4, requires_grad=True)
    out = policy._pool_evidence(tied, 2)
    assert torch.equal(out, torch.zeros(1, 2, 2))  # nothing added while the evidence is untrained
    out.sum().backward()
    if pooling == "max":
        assert int((tied.grad != 0).sum()) == 4 and tied.grad[0, 0, 0] == 1.0  # each node's first patch
    else:
        assert torch.allclose(tied.grad, torch.full((1, 4, 4), 0.25))


def test_evidence_pooling_is_checked_and_survives_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="evidence_pooling must be 'max' or 'soft', got 'mean'"):
        LearnedPolicy(8, 3, fine_evidence=True, evidence_pooling="mean")
    for overrides, problem in (
        (["model.policy.evidence_pooling=mean"], "must be one of max, soft, got 'mean'"),
        (["model.policy.evidence_pooling=soft"], "model.policy.fine_evidence is false"),
    ):
        with pytest.raises(ConfigError) as err:
            load_experiment(SMOKE, overrides)
        assert err.value.key == "model.policy.evidence_pooling" and problem in str(err.value)
    config = load_experiment(SMOKE, ["model.policy.fine_evidence=true", "model.policy.evidence_pooling=soft"])
    assert config.model.policy.evidence_pooling == "soft"
    model = tiny_model(level_context=True, fine_evidence=True, evidence_pooling="soft")
    with torch.no_grad():
        model.policy.evidence[-1].weight.normal_()  # as if trained: the pooling now matters
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    model.save(tmp_path / "model.pt")
    loaded = SplitViT.load(tmp_path / "model.pt")
    assert loaded.spec.policy.evidence_pooling == "soft" and loaded.policy.evidence_pooling == "soft"
    assert all(torch.equal(a, b) for a, b in zip(scores(model, images), scores(loaded, images)))
