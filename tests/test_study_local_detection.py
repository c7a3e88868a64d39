"""Every recipe on one machine (issue 57, item 5): the local loop (``fit_config_local``,
``run_study_local``) trains a detector through the Ray loop's phases (the policy's
lead epochs, the fine-tune, the policy's epochs after it), routed and scheduled by the
same code (``splitvit.train.phases``), and validates it by COCO's box and mask AP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitvit.study.local import fit_config_local, load_local_study, run_study_local
from splitvit.train.experiment import build_model, load_experiment
from splitvit.train.local import param_groups
from splitvit.train.phases import lr_schedule

from .helpers import write_fake_fashion_mnist
from .test_detection_study import CONFIG, tiny_settings, write_detection_study

STEPS_PER_EPOCH = 2  # 8 training canvases in batches of 4


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory) -> Path:
    """Fashion-MNIST files of item-like images (16 training and validation, 8 test)."""
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fmnist"), train=16, test=8)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_fit_config_local_trains_a_detectors_policy_lead_fine_tune_and_policy_epochs(fmnist_root, tmp_path):
    """A detector with an epoch of each phase: the policy-only epochs move the policy's
    weights and nothing else (but the thresholds calibrated after them), the fine-tune
    moves the rest, each epoch is validated by box and mask AP, and the learning rates
    are those of the scheduler the Ray loop builds for the same config."""
    overrides = [f"{k}={json.dumps(v)}" for k, v in tiny_settings(fmnist_root).items()]
    config = load_experiment(
        CONFIG,
        [
            *overrides,
            "model.policy.kind=learned",
            "train.policy.lead_epochs=1",
            "train.epochs=1",
            "train.policy.epochs=1",
            "train.policy.warmup_epochs=0",  # the fine-tune's epoch trains the policy and the detector
            "train.teacher.kind=objects",
            "train.policy.lr_scale=10.0",
            "train.lr_warmup_epochs=0.5",
            f"storage.path={tmp_path / 'runs'}",
            "storage.name=phases",
        ],
    )
    starts: list[dict[str, torch.Tensor]] = []
    trained = fit_config_local(config, "cpu", epoch_hook=lambda epoch, model: starts.append(_snapshot(model)))
    assert trained.status == "completed" and trained.steps == 3 * STEPS_PER_EPOCH
    history = trained.history
    assert [h["epoch"] for h in history] == [0, 1, 2] and len(starts) == 3
    lead, tuned, tail = history
    assert "train_task_loss" in tuned and all("train_task_loss" not in e for e in (lead, tail))
    assert all("train_teacher_loss" in e for e in (lead, tail))
    for epoch in history:  # validated as the Ray loop validates a detector
        assert 0.0 <= epoch["box_ap"] <= 1.0 and 0.0 <= epoch["mask_ap"] <= 1.0 and epoch["val_images"] == 4

    final = torch.load(trained.checkpoint, weights_only=False)["state_dict"]
    ends = [*starts[1:], final]
    policy = {k for k in final if k.startswith("backbone.policy.")}
    assert policy
    for phase in (0, 2):  # the policy alone: its weights move, every other stays (thresholds: calibrated)
        moved = _changed(starts[phase], ends[phase])
        assert moved & policy, phase
        assert moved - policy == {"backbone.thresholds"}, (phase, sorted(moved - policy))
    tuned_moved = _changed(starts[1], ends[1])
    assert "backbone.vit.blocks.0.attn.qkv.weight" in tuned_moved
    assert "roi_heads.box_predictor.cls_score.weight" in tuned_moved

    # the Ray loop's scheduler for this config, stepped as many batches: the same rates after every epoch
    optimizer = torch.optim.AdamW(param_groups(build_model(config.model), config.train.lr, 10.0), lr=config.train.lr)
    schedule = lr_schedule(optimizer, config.train, STEPS_PER_EPOCH)
    expected = []
    for _ in history:
        for _ in range(STEPS_PER_EPOCH):
            optimizer.step()
            schedule.step()
        expected += schedule.get_last_lr()
    assert [rate for h in history for rate in (h["lr"], h["lr_policy"])] == pytest.approx(expected)
    # the lead shifts the fine-tune's warm-up and cosine: without it the rates differ
    assert expected[::2] == pytest.approx([config.train.lr, config.train.lr, 0.0])


def test_run_study_local_runs_a_detection_study_with_the_policys_own_epochs(fmnist_root, tmp_path):
    """The tiny detection study of ``tests/test_detection_study.py`` (its SPLIT method has
    a lead and a tail epoch of its policy alone), formerly refused by the local study
    loop: box AP ranks the rows, mask AP beside it, the SPLIT run trained all three
    phases and its checkpoint is evaluated at the matched ratio."""
    path = write_detection_study(tmp_path, fmnist_root)
    out = tmp_path / "out"
    data = run_study_local(load_local_study(path, out), out, device="cpu", workers=1).to_dict()
    assert not data["failed"] and data["metric"] == "box_ap" and len(data["runs"]) == 2
    rows = {(r["method"], r["target_ratio"]): r for r in data["rows"]}
    assert set(rows) == {("full", None), ("split", 0.5)}
    for row in rows.values():
        assert 0.0 <= row["box_ap"] <= 1.0 and 0.0 <= row["mask_ap"] <= 1.0 and set(row["per_seed_mask_ap"]) == {"0"}
    assert rows[("split", 0.5)]["backbone_speedup_vs_full"] > 0
    assert [c["metric"] for c in data["goals"]["match"]["companions"]] == ["mask_ap"]
    (backbone,) = data["backbones"]
    assert [h["epoch"] for h in backbone["history"]] == [0] and "box_ap" in backbone["history"][0]

    runs = {r["method"]: r for r in data["runs"]}
    lead, tuned, tail = runs["split"]["history"]
    assert "train_task_loss" in tuned and all("train_teacher_loss" in e for e in (lead, tail))
    assert runs["split"]["steps"] == 3 * STEPS_PER_EPOCH and len(runs["full"]["history"]) == 1
    assert all(e["lr_policy"] == pytest.approx(10 * e["lr"]) for e in (lead, tuned, tail))
    (point,) = runs["split"]["points"]
    assert point["quality"] == point["box_ap"] and point["images"] == 4 and 0 < point["token_ratio"] < 1
    assert (out / "study.png").is_file()
