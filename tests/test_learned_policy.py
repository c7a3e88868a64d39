"""The learned policy finds what matters (issue: SPLIT model library, test 9).

A synthetic task whose label is the 1-pixel texture of one small object placed
among high-entropy noise clutter. After a short CPU training of the demo recipe
(backbone warm-up first, then the policy), at ~30% of full-resolution tokens:

* the share of fine tokens on the object is at least twice the entropy policy's;
* accuracy beats entropy splitting and all-coarse on the same backbone.
"""

from __future__ import annotations

import pytest

from splitvit.demo import Recipe, compare_at_budget, held_out_batches, train_recipe

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
