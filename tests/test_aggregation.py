"""Fine-patch aggregation into coarse tokens (``model.fine_aggregation``, issue #12's
lever after APT): zero-initialised, local to each node, learnable, and carried
through checkpoints and ``init_from``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from splitvit.config import ModelConfig, PolicyConfig
from splitvit.model import SplitViT
from splitvit.model.aggregation import FineAggregation
from splitvit.model.splitvit import _LevelEmbeddings
from splitvit.train.checkpoints import init_weights
from splitvit.train.experiment import build_model

from .helpers import TINY_TIMM, tiny_model


def tiny(policy: str = "learned", **kwargs) -> SplitViT:
    """The tests' tiny SplitViT with fixed thresholds (coarse 16 px, 8 px, fine 4 px)."""
    return tiny_model(policy, thresholds=[0.4, 0.6], **kwargs)


def randomise(aggregation: FineAggregation, seed: int = 1) -> None:
    """Give the zero-initialised projections random weights, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for proj in aggregation.proj:
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) * 0.1)
            proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("policy", ["learned", "coarse", "entropy", "full"])
def test_at_initialisation_the_aggregation_changes_nothing(policy):
    """A model fine-tuned from a reference starts exactly where the reference is: with
    the reference's weights, the aggregating model gives the same logits."""
    plain = tiny(policy).eval()
    aggregating = tiny(policy, fine_aggregation=True).eval()
    missing, unexpected = aggregating.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(k.startswith("fine_aggregation.") for k in missing) and not unexpected
    images = torch.rand(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(aggregating(images).logits, plain(images).logits, rtol=0, atol=0)


def test_trained_aggregation_changes_coarse_tokens_but_not_full_resolution():
    model = tiny("learned", fine_aggregation=True).eval()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        before = [_LevelEmbeddings(model, images, model.geometry)[level] for level in range(3)]
        full_before = model(images, decisions=model.full_decisions(images)).logits
        randomise(model.fine_aggregation)
        after = [_LevelEmbeddings(model, images, model.geometry)[level] for level in range(3)]
        full_after = model(images, decisions=model.full_decisions(images)).logits
    for level in (0, 1):
        assert not torch.allclose(before[level], after[level])
    assert torch.equal(before[2], after[2])  # the finest tokens are the patch embedding itself
    assert torch.equal(full_before, full_after)


def test_a_node_aggregates_only_the_fine_patches_it_covers():
    """Changing the pixels of one 8-pixel node changes that node, its 16-pixel parent,
    and nothing else at the coarse levels."""
    model = tiny("learned", fine_aggregation=True).eval()
    randomise(model.fine_aggregation)
    images = torch.rand(1, 3, 32, 32)
    changed = images.clone()
    changed[..., 8:16, 16:24] = torch.rand(3, 8, 8)  # level-1 node (1, 2), under level-0 node (0, 1)
    with torch.no_grad():
        # the aggregation terms alone: the area-resized patch embedding is local by construction
        a = model.fine_aggregation(model.patch_tokens(images))
        b = model.fine_aggregation(model.patch_tokens(changed))
    moved1 = (a[1] - b[1]).abs().sum(-1)[0] > 0
    moved0 = (a[0] - b[0]).abs().sum(-1)[0] > 0
    expected1 = torch.zeros(4, 4, dtype=torch.bool)
    expected1[1, 2] = True
    expected0 = torch.zeros(2, 2, dtype=torch.bool)
    expected0[0, 1] = True
    assert torch.equal(moved1, expected1) and torch.equal(moved0, expected0)


def test_the_task_loss_trains_the_aggregation():
    """The zero projection gets a gradient at once; the convolutions once it is non-zero."""
    model = tiny("coarse", fine_aggregation=True).train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(images).logits, labels).backward()
    assert model.fine_aggregation.proj[0].weight.grad.abs().sum() > 0
    model.zero_grad()
    randomise(model.fine_aggregation)
    torch.nn.functional.cross_entropy(model(images).logits, labels).backward()
    # the coarsest level's term folds level 1's: both convolutions learn from coarse tokens
    assert all(conv.weight.grad.abs().sum() > 0 for conv in model.fine_aggregation.down)


def test_aggregation_survives_save_and_load(tmp_path):
    model = tiny("learned", fine_aggregation=True).eval()
    randomise(model.fine_aggregation)
    model.save(tmp_path / "m.pt")
    loaded = SplitViT.load(tmp_path / "m.pt").eval()
    assert loaded.fine_aggregation is not None and loaded.spec.fine_aggregation is True
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(images).logits, loaded(images).logits)


def test_init_from_a_reference_without_aggregation_starts_it_at_zero(tmp_path):
    """A study's methods start from a full-resolution reference that has no aggregation:
    its backbone is copied, the aggregation stays zero, the logits are the reference's."""
    reference = tiny("full").eval()
    reference.save(tmp_path / "reference.pt")
    config = ModelConfig(
        policy=PolicyConfig(kind="coarse", depth=1),
        name="vit_tiny_patch16_224",
        timm_kwargs=TINY_TIMM,
        image_size=32,
        num_classes=5,
        fine_aggregation=True,
    )
    model = build_model(config).eval()
    left = init_weights(model, tmp_path / "reference.pt")
    assert any(k.startswith("fine_aggregation.proj") for k in left)
    assert all(not p.detach().any() for p in model.fine_aggregation.proj.parameters())
    images = torch.rand(2, 3, 32, 32)
    coarse_reference = build_model(replace(config, fine_aggregation=False)).eval()
    init_weights(coarse_reference, tmp_path / "reference.pt")
    with torch.no_grad():
        assert torch.equal(model(images).logits, coarse_reference(images).logits)


def test_aggregation_needs_two_levels():
    with pytest.raises(ValueError, match="at least 2 quadtree levels, got 1"):
        FineAggregation(8, 1)
