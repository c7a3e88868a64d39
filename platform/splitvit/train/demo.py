"""The demo: a tiny SPLIT model and a full-resolution ViT trained side by side on
the synthetic object-among-clutter task, then compared at SPLIT's token budget with
entropy (APT-style), random and all-coarse splitting on SPLIT's own backbone.

``run_recipe`` is also the short CPU training the test suite uses to check that the
learned policy finds what matters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ..config import BudgetConfig, PolicyConfig, PolicyTrainingConfig, TeacherConfig
from ..data.synthetic import SyntheticObjects
from ..jsontypes import JsonObject
from ..model import SplitViT
from .local import fit_local
from .steps import SplitLossConfig, calibrate_thresholds, evaluate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """Everything that defines a demo run (model, data, schedule, objective)."""

    image_size: int = 48
    patch_size: int = 4
    levels: int = 3
    embed_dim: int = 64
    depth: int = 4
    num_heads: int = 4
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(depth=1))
    train_samples: int = 2048
    test_samples: int = 512
    epochs: int = 6
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0
    loss: SplitLossConfig = field(
        default_factory=lambda: SplitLossConfig(
            budget=BudgetConfig(weight=2.0, target_ratio=0.3),
            teacher=TeacherConfig(weight=1.0),
            policy=PolicyTrainingConfig(warmup_epochs=4),
        )
    )


def build_demo_model(policy: str = "learned", recipe: Recipe | None = None) -> SplitViT:
    """The demo's tiny ViT (timm ``vit_tiny`` layout, shrunk) wrapped as a SplitViT."""
    recipe = recipe or Recipe()
    torch.manual_seed(recipe.seed)
    return SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=recipe.levels,
        policy=replace(recipe.policy, kind=policy),
        image_size=recipe.image_size,
        num_classes=4,
        timm_kwargs=dict(
            patch_size=recipe.patch_size, embed_dim=recipe.embed_dim, depth=recipe.depth, num_heads=recipe.num_heads
        ),
    )


def train_recipe(policy: str, recipe: Recipe) -> tuple[SplitViT, list[dict[str, float]]]:
    """Train a demo model with ``policy`` on the recipe's training set."""
    model = build_demo_model(policy, recipe)
    data = SyntheticObjects(recipe.train_samples, image_size=recipe.image_size, seed=recipe.seed * 1000)
    history = fit_local(
        model, data, recipe.loss, epochs=recipe.epochs, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed
    )
    return model, history


def held_out_batches(recipe: Recipe, batch_size: int = 128) -> list:
    """The held-out images (a different seed from training), with object masks."""
    data = SyntheticObjects(recipe.test_samples, image_size=recipe.image_size, seed=recipe.seed * 1000 + 2)
    return list(DataLoader(data, batch_size=batch_size))


def compare_at_budget(
    model: SplitViT, batches: list, target_ratio: float
) -> dict[str, dict[str, float | list[float] | None]]:
    """Evaluate the model's backbone under every policy; thresholded policies are
    calibrated (on the first batch) to ``target_ratio`` of full-resolution tokens.
    Returns each policy's figures and its ``thresholds`` (``None``: not thresholded)."""
    calibration = batches[0][0]
    learned = model.policy
    results: dict[str, dict[str, float | list[float] | None]] = {}
    try:
        for name in ("learned", "entropy", "random", "coarse", "full"):
            if name == "learned":
                if not learned.learned:
                    continue
                model.set_policy(learned)
            else:
                model.set_policy(name)
                if name == "random":
                    model.policy.seed = 0
            thresholds = calibrate_thresholds(model, calibration, target_ratio) if model.policy.thresholded else None
            metrics = evaluate(model, batches, thresholds=thresholds, object_masks=True)
            results[name] = {**metrics, "thresholds": thresholds}
    finally:
        model.set_policy(learned)
    return results


def run_demo(
    out_dir: str | Path = "runs/demo",
    epochs: int | None = None,
    samples: int | None = None,
    target_ratio: float = 0.3,
    recipe: Recipe | None = None,
) -> JsonObject:
    """Train SPLIT and a full-resolution ViT, compare them; returns the figures."""
    recipe = recipe or Recipe()
    recipe = replace(
        recipe,
        epochs=epochs or recipe.epochs,
        train_samples=samples or recipe.train_samples,
        loss=replace(recipe.loss, budget=replace(recipe.loss.budget, target_ratio=target_ratio)),
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = held_out_batches(recipe)
    start = time.perf_counter()
    split_model, split_history = train_recipe("learned", recipe)
    split_seconds = time.perf_counter() - start
    start = time.perf_counter()
    full_model, full_history = train_recipe("full", recipe)
    full_seconds = time.perf_counter() - start
    comparison = compare_at_budget(split_model, batches, target_ratio)
    # the checkpoint keeps the thresholds calibrated to the budget, so `splitvit viz`
    # and `eval` on it see the model as compared here, not at the 0.5 it trained with
    split_model.set_thresholds(comparison["learned"]["thresholds"])
    split_model.save(out / "split.pt")
    full_model.save(out / "full.pt")
    baseline = evaluate(full_model, batches, object_masks=True)
    rows = [{"method": "full-resolution ViT (own training)", **baseline}]
    labels = {
        "learned": "SPLIT (learned policy)",
        "entropy": "entropy (APT-style), same backbone",
        "random": "random, same backbone",
        "coarse": "all-coarse, same backbone",
        "full": "full resolution, same backbone",
    }
    rows += [{"method": labels[name], **metrics} for name, metrics in comparison.items()]

    from ..tracking.split_maps import split_map_grid

    images = batches[0][0][:8]
    split_model.eval()
    with torch.no_grad():
        decided = split_model(images, thresholds=comparison["learned"]["thresholds"])
    split_map = out / "split_maps.png"
    split_map_grid(images, decided.decisions, split_model.geometry, [f"{int(t)} tok" for t in decided.tokens]).save(
        split_map
    )
    return {
        "recipe": asdict(recipe),
        "rows": rows,
        "train_seconds": {"split": split_seconds, "full": full_seconds},
        "history": {"split": split_history, "full": full_history},
        "split_map": str(split_map),
        "checkpoints": {"split": str(out / "split.pt"), "full": str(out / "full.pt")},
    }
