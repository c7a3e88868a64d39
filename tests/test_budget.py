"""Budget-conditioned training (issue #12): each batch draws its target ratio from a
range and the learned policy is told it, so one model serves every budget."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from splitvit.config import BudgetConfig, ModelConfig, PolicyConfig, PolicyTrainingConfig, TeacherConfig
from splitvit.model import SplitViT
from splitvit.model.policies import LearnedPolicy, PolicyContext
from splitvit.train import losses
from splitvit.train.experiment import build_model
from splitvit.train.losses import budget_penalty
from splitvit.train.steps import SplitLossConfig, calibrate_thresholds, training_step

from .helpers import TINY_TIMM, tiny_model


@contextmanager
def one_thread() -> Iterator[None]:
    """Train the tiny models on one thread: their ops are too small to share, and a
    second OpenMP thread on a busy machine made a 1-second training take minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def condition(model: SplitViT, seed: int = 1) -> SplitViT:
    """Give the budget embedding's zero-initialised last layer random weights, as
    training would, so that the budget changes the scores."""
    gen = torch.Generator().manual_seed(seed)
    last = model.policy.budget_embed[-1]
    with torch.no_grad():
        last.weight.copy_(torch.randn(last.weight.shape, generator=gen))
        last.bias.copy_(torch.randn(last.bias.shape, generator=gen))
    return model


def scores(model: SplitViT, images: torch.Tensor, budget=None) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.eval().split_scores(images, budget=budget)


# ------------------------------------------------------------------ the policy
@pytest.mark.parametrize("width", [None, 16])
def test_conditioned_policy_scores_as_the_unconditioned_one_at_init(width):
    """The budget embedding's last layer starts at zero: with the same other weights, a
    conditioned policy scores exactly (bit for bit) as an unconditioned one, whatever
    the budget; with that layer trained the budget changes the scores."""
    plain = tiny_model(width=width).eval()
    conditioned = tiny_model(width=width, budget_conditioned=True).eval()
    assert conditioned.uses_budget and not plain.uses_budget
    missing, unexpected = conditioned.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("policy.budget_embed.") for k in missing)
    images = torch.rand(3, 3, 32, 32)
    reference = scores(plain, images)
    for budget in (0.2, 0.9, None):
        assert all(torch.equal(a, b) for a, b in zip(scores(conditioned, images, budget), reference))
    condition(conditioned)
    low, high = scores(conditioned, images, 0.2), scores(conditioned, images, 0.9)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(low, high))
    # one ratio per image: each image is scored at its own budget
    mixed = scores(conditioned, images, torch.tensor([0.2, 0.9, 0.2]))
    for level, m in enumerate(mixed):
        assert torch.allclose(m[0], low[level][0]) and torch.allclose(m[1], high[level][1])


def test_unconditioned_model_ignores_the_budget():
    model = tiny_model().eval()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        a, b = model(images), model(images, budget=0.9)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.split_probs, b.split_probs))


def test_the_budget_buffer_is_what_the_model_is_told_by_default():
    model = condition(tiny_model(budget_conditioned=True))
    assert float(model.budget) == 0.5
    images = torch.rand(2, 3, 32, 32)
    model.set_budget(0.3)
    assert float(model.budget) == pytest.approx(0.3)
    told = scores(model, images, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(scores(model, images), told))
    with torch.no_grad():
        out = model(images, budget=torch.tensor(0.3))
    assert all(torch.equal(a, b) for a, b in zip(out.split_probs, told))


# ------------------------------------------------------------------ saving and loading
def test_budget_and_conditioning_survive_save_and_load(tmp_path):
    model = condition(tiny_model(budget_conditioned=True))
    model.set_budget(0.3)
    model.save(tmp_path / "model.pt")
    loaded = SplitViT.load(tmp_path / "model.pt")
    assert loaded.policy_config.budget_conditioned and loaded.uses_budget
    assert float(loaded.budget) == pytest.approx(0.3)
    images = torch.rand(2, 3, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(scores(loaded, images), scores(model, images)))


def test_state_dict_without_budget_loads(tmp_path):
    """A checkpoint written before the ``budget`` buffer existed (spec without
    ``budget_conditioned``) loads strictly, with the default budget."""
    model = tiny_model()
    model.save(tmp_path / "model.pt")
    payload = torch.load(tmp_path / "model.pt", weights_only=False)
    del payload["state_dict"]["budget"]
    payload["spec"].pop("budget_conditioned", None)
    torch.save(payload, tmp_path / "model.pt")
    old = SplitViT.load(tmp_path / "model.pt")
    assert not old.uses_budget and float(old.budget) == 0.5
    # a conditioned model keeps the budget it has when the state dict brings none
    conditioned = tiny_model(budget_conditioned=True)
    conditioned.set_budget(0.7)
    state = conditioned.state_dict()
    del state["budget"]
    conditioned.load_state_dict(state)
    assert float(conditioned.budget) == pytest.approx(0.7)


def test_build_model_passes_budget_conditioned():
    config = ModelConfig(policy=PolicyConfig(depth=1), image_size=32, levels=3, num_classes=5, timm_kwargs=TINY_TIMM)
    assert not build_model(config).uses_budget
    model = build_model(replace(config, policy=replace(config.policy, budget_conditioned=True)))
    assert model.uses_budget and model.spec.policy.budget_conditioned is True


# ------------------------------------------------------------------ training
def test_training_step_draws_a_target_ratio_per_batch(monkeypatch):
    """With ``target_ratio_range`` each batch draws its ratio uniformly from the range,
    reproducibly with a seeded generator; the budget penalty and the teacher's targets
    use the drawn ratio, and a conditioned policy is told it."""
    model = condition(tiny_model(budget_conditioned=True)).train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=0),
        teacher=TeacherConfig(weight=0.0),
        budget=BudgetConfig(ratio_range=[0.2, 0.8]),
    )

    def draws(seed: int) -> list[float]:
        gen = torch.Generator().manual_seed(seed)
        return [training_step(model, images, labels, cfg, epoch=0, generator=gen)[1]["target_ratio"] for _ in range(5)]

    with one_thread():
        first = draws(0)
        assert draws(0) == first and draws(1) != first
    assert all(0.2 <= r <= 0.8 for r in first) and len(set(first)) == 5

    told, fractions = [], []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: told.append(k.get("budget")) or forward(*a, **k))
    fraction = losses.split_fraction_for_ratio
    monkeypatch.setattr(losses, "split_fraction_for_ratio", lambda r, g: fractions.append(r) or fraction(r, g))
    _, stats = training_step(model, images, labels, replace(cfg, teacher=replace(cfg.teacher, weight=1.0)), epoch=0)
    drawn = stats["target_ratio"]
    assert told[0] == drawn and fractions == [drawn]
    with torch.no_grad():
        out = forward(images, budget=drawn)  # expected tokens come from the probabilities, not the samples
    expected_ratio = out.expected_tokens / out.full_tokens
    assert stats["budget_penalty"] == pytest.approx(float(budget_penalty(expected_ratio, drawn)), rel=1e-5)
    assert stats["budget_penalty"] != pytest.approx(float(budget_penalty(expected_ratio, cfg.budget.target_ratio)))


def test_training_step_without_a_range_or_in_warm_up_draws_nothing():
    model = tiny_model().train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    _, stats = training_step(
        model,
        images,
        labels,
        SplitLossConfig(policy=PolicyTrainingConfig(warmup_epochs=0), teacher=TeacherConfig(weight=0.0)),
        epoch=0,
    )
    assert "target_ratio" not in stats
    ranged = SplitLossConfig(policy=PolicyTrainingConfig(warmup_epochs=1), budget=BudgetConfig(ratio_range=[0.2, 0.8]))
    assert "target_ratio" not in training_step(model, images, labels, ranged, epoch=0)[1]


def test_a_conditioned_policy_learns_to_follow_its_budget():
    """A short budget-conditioned training (budget penalty only, no teacher): told 0.8,
    the policy splits more than told 0.2, and meets each budget roughly. An
    unconditioned policy scores the same whatever it is told. Only the policy trains:
    the backbone's drift would only blur a 100-step check."""
    model = tiny_model(budget_conditioned=True).train()  # seeds torch's RNG: the sampled decisions repeat
    opt = torch.optim.AdamW(model.policy.parameters(), lr=1e-2)
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=0),
        teacher=TeacherConfig(weight=0.0),
        budget=BudgetConfig(weight=50.0, ratio_range=[0.2, 0.8]),
    )
    gen = torch.Generator().manual_seed(0)
    with one_thread():
        for _ in range(100):
            images, labels = torch.rand(8, 3, 32, 32, generator=gen), torch.randint(0, 5, (8,), generator=gen)
            loss, _ = training_step(model, images, labels, cfg, epoch=0, generator=gen)
            opt.zero_grad()
            loss.backward()
            opt.step()
    images = torch.rand(16, 3, 32, 32, generator=gen)
    low, high = (float(torch.cat([s.flatten() for s in scores(model, images, r)]).mean()) for r in (0.2, 0.8))
    assert high > low + 0.2  # measured: 0.49 told 0.2, 0.86 told 0.8
    with torch.no_grad():
        ratios = [float(model(images, budget=r).token_ratio.mean()) for r in (0.2, 0.8)]
    assert ratios[1] > ratios[0] + 0.2


def test_calibration_tells_a_conditioned_model_its_budget():
    images = torch.rand(4, 3, 32, 32)
    conditioned = condition(tiny_model(budget_conditioned=True))
    calibrate_thresholds(conditioned, images, 0.3)
    assert float(conditioned.budget) == pytest.approx(0.3)
    plain = tiny_model()
    before = plain.state_dict()["budget"].clone()
    calibrate_thresholds(plain, images, 0.3)
    assert torch.equal(plain.budget, before)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_a_budget_outside_0_1_is_refused(bad):
    model = tiny_model(budget_conditioned=True)
    with pytest.raises(ValueError, match=r"budget \(target token ratio\) must be in \(0, 1\]"):
        model.set_budget(bad)
    with pytest.raises(ValueError, match=r"budget \(target token ratio\) must be in \(0, 1\]"):
        model(torch.rand(2, 3, 32, 32), budget=bad)
    with pytest.raises(ValueError, match=r"budget \(target token ratio\) must be in \(0, 1\]"):
        model.split_scores(torch.rand(2, 3, 32, 32), budget=bad)


def test_a_budget_of_the_wrong_shape_is_refused():
    model = tiny_model(budget_conditioned=True)
    with pytest.raises(ValueError, match=r"one ratio per image \(2,\), got shape \(3,\)"):
        model(torch.rand(2, 3, 32, 32), budget=torch.full((3,), 0.5))
    policy = LearnedPolicy(8, 2, budget_conditioned=True)
    geometry = model.geometry
    context = PolicyContext(
        coarse_features=torch.zeros(2, 2, 2, 8),
        node_embeddings=[torch.zeros(2, 2, 2, 8)],
        budget=torch.full((3,), 0.5),
    )
    with pytest.raises(ValueError, match=r"one target ratio per image, shape \(2,\), got \(3,\)"):
        policy(torch.rand(2, 3, 32, 32), geometry, context)


def test_a_conditioned_policy_without_a_budget_is_refused():
    policy = LearnedPolicy(8, 2, budget_conditioned=True)
    context = PolicyContext(coarse_features=torch.zeros(2, 2, 2, 8), node_embeddings=[torch.zeros(2, 2, 2, 8)])
    with pytest.raises(ValueError, match=r"budget-conditioned policy needs the target token ratio"):
        policy(torch.rand(2, 3, 32, 32), tiny_model().geometry, context)
