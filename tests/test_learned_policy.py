"""The learned policy finds what matters (issue: SPLIT model library, test 9).

A synthetic task whose label is the 1-pixel texture of one small object placed
among high-entropy noise clutter. After a short CPU training of the demo recipe
(backbone warm-up first, then the policy), at ~30% of full-resolution tokens:

* the share of fine tokens on the object is at least twice the entropy policy's;
* accuracy beats entropy splitting and all-coarse on the same backbone.
"""

from __future__ import annotations

import pytest

from splitvit.train.demo import Recipe, compare_at_budget, held_out_batches, train_recipe

TARGET_RATIO = 0.3


@pytest.fixture(scope="module")
def comparison():
    recipe = Recipe()
    model, history = train_recipe("learned", recipe)
    results = compare_at_budget(model, held_out_batches(recipe), TARGET_RATIO)
    for name, metrics in results.items():
        print(name, {k: v for k, v in metrics.items() if k != "thresholds"})
    return results


@pytest.mark.slow
def test_policies_are_compared_at_the_same_budget(comparison):
    for name in ("learned", "entropy", "random"):
        assert comparison[name]["token_ratio"] == pytest.approx(TARGET_RATIO, abs=0.05), name


@pytest.mark.slow
def test_learned_fine_tokens_fall_on_the_object(comparison):
    learned, entropy = comparison["learned"]["fine_on_object"], comparison["entropy"]["fine_on_object"]
    assert learned >= 2 * entropy, (learned, entropy)
    assert learned > comparison["random"]["fine_on_object"]


@pytest.mark.slow
def test_learned_accuracy_beats_entropy_and_coarse_at_the_budget(comparison):
    learned = comparison["learned"]["accuracy"]
    assert learned > comparison["entropy"]["accuracy"]
    assert learned > comparison["coarse"]["accuracy"]


def test_fit_local_reports_each_epoch_once(caplog):
    """The epoch is logged by fit_local, or, when a caller's on_epoch takes it (with
    its own validation figures), by the caller alone: one line per epoch, not two."""
    import logging

    import torch
    from torch.utils.data import TensorDataset

    from splitvit.train.local import fit_local
    from splitvit.train.steps import SplitLossConfig
    from tests.test_model import tiny_model

    data = TensorDataset(torch.rand(8, 3, 32, 32), torch.randint(0, 5, (8,)))  # tiny_model has 5 classes
    seen = []
    with caplog.at_level(logging.INFO, logger="splitvit.train.local"):
        history = fit_local(
            tiny_model("full"),
            data,
            SplitLossConfig(),
            epochs=2,
            batch_size=4,
            on_epoch=lambda epoch, stats: seen.append((epoch, stats["loss"])),
        )
    assert [e for e, _ in seen] == [0, 1] and [h["loss"] for h in history] == [loss for _, loss in seen]
    assert not [r for r in caplog.records if r.name == "splitvit.train.local"]
    with caplog.at_level(logging.INFO, logger="splitvit.train.local"):
        fit_local(tiny_model("full"), data, SplitLossConfig(), epochs=2, batch_size=4)
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "splitvit.train.local"] == [
        "epoch 0",
        "epoch 1",
    ]


def test_object_figures_count_where_the_budget_went_and_what_of_the_object_is_fine():
    """``fine_on_object`` is the share of fine tokens on the object, ``object_coverage``
    the share of the object's fine cells kept fine: exact on a hand-made mask (one
    8x8-px object on a 32-px image with 4-px fine patches: 4 of 64 fine cells), with
    every cell fine (``full``) and none (``coarse``); without masks neither is reported."""
    import torch

    from splitvit.train.steps import evaluate
    from tests.helpers import tiny_model

    images = torch.rand(2, 3, 32, 32)
    masks = torch.zeros(2, 32, 32, dtype=torch.bool)
    masks[:, 8:16, 12:20] = True  # rows: cells 2-3; columns: 3-4 -> 2 x 2 fine cells
    batches = [(images, torch.tensor([0, 1]), masks)]
    full = evaluate(tiny_model("full"), batches, object_masks=True)
    assert full["object_coverage"] == 1.0 and full["fine_on_object"] == pytest.approx(4 / 64)
    coarse = evaluate(tiny_model("coarse"), batches, object_masks=True)
    assert coarse["object_coverage"] == 0.0 and coarse["fine_on_object"] == 0.0
    plain = evaluate(tiny_model("full"), [(images, torch.tensor([0, 1]))], object_masks=True)
    assert "object_coverage" not in plain and "fine_on_object" not in plain
