"""Operating points timed against full resolution (``splitvit.bench.speed``) on tiny
models: the structure and consistency of the figures, never a speed-up target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitvit.bench.speed import OperatingPoint, SpeedRecord, spread, time_operating_points
from splitvit.config import ExperimentConfig, PolicyConfig
from splitvit.model import SplitViT
from splitvit.tune.pareto import Point
from splitvit.tune.space import SearchSpaceError, load_space

ROOT = Path(__file__).resolve().parents[1]

# 16x16 images, 4-pixel base patches, two levels: 4 coarse or 16 fine tokens
MODEL = {
    "name": "vit_tiny_patch16_224",
    "image_size": 16,
    "levels": 2,
    "policy": {"depth": 1},
    "num_classes": 4,
    "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
}


def checkpoint(folder: Path, embed_dim: int = 16, budget_conditioned: bool = False) -> str:
    """A checkpoint folder as training writes it: the model and its experiment config.
    A budget-conditioned policy gets random weights in its budget embedding's
    zero-initialised last layer, as training would give it, so the budget matters."""
    model_cfg = json.loads(json.dumps(MODEL))
    model_cfg["timm_kwargs"]["embed_dim"] = embed_dim
    model_cfg["policy"]["budget_conditioned"] = budget_conditioned
    config = ExperimentConfig.from_dict(
        {
            "recipe": "none",  # two levels: the library's plain settings
            "model": model_cfg,
            "data": {
                "name": "synthetic",
                "options": {"train_samples": 32, "val_samples": 16, "object_size": 4},
                "batch_size": 8,
            },
        }
    )
    model = SplitViT.from_timm(
        MODEL["name"],
        policy=PolicyConfig(kind="learned", depth=1, budget_conditioned=budget_conditioned),
        levels=2,
        image_size=16,
        num_classes=4,
        timm_kwargs=model_cfg["timm_kwargs"],
    )
    if budget_conditioned:
        import torch

        last = model.policy.budget_embed[-1]
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            last.weight.copy_(4 * torch.randn(last.weight.shape, generator=gen))
            last.bias.copy_(4 * torch.randn(last.bias.shape, generator=gen))
    folder.mkdir(parents=True)
    model.save(folder / "model.pt", extra={"config": config.to_dict(redact=True)})
    return str(folder)


def test_points_are_timed_against_full_resolution_in_one_interleaved_run(tmp_path):
    small, wide = checkpoint(tmp_path / "small"), checkpoint(tmp_path / "wide", embed_dim=32)
    points = [
        OperatingPoint(small, [1.0], label="coarse"),  # nothing splits: 4 of 16 tokens
        OperatingPoint(small, [0.0], label="fine"),  # everything splits: 16 of 16
        OperatingPoint(small, [0.5], policy="entropy"),  # another policy on the same backbone
        OperatingPoint(wide, [1.0], label="wide"),  # another architecture
    ]
    result = time_operating_points(points, full_checkpoint=small, batch_size=8, rounds=3, warmup=1)
    assert result.device == "cpu" and result.batch_size == 8 and result.rounds == 3 and result.warmup == 1
    assert result.precision == "float32" and result.machine.torch_threads >= 1
    # one full-resolution model per architecture: the given checkpoint first
    full = {f.key: f for f in result.full}
    assert [f.checkpoint for f in result.full] == [small, wide]
    assert all(f.speedup_vs_full == 1.0 and f.tokens_per_image == 16.0 and f.images_per_s > 0 for f in full.values())
    rows = result.points
    assert [r.label for r in rows] == ["coarse", "fine", "point2", "wide"]
    assert [r.full for r in rows] == ["full0", "full0", "full0", "full1"]
    assert [r.policy for r in rows] == ["learned", "learned", "entropy", "learned"]
    assert rows[0].token_ratio == 0.25 and rows[0].tokens_per_image == 4.0 and rows[1].token_ratio == 1.0
    assert rows[3].token_ratio == 0.25
    for row in rows:
        ref = full[row.full]
        assert row.speedup_vs_full > 0 and row.images_per_s == pytest.approx(8 / row.median_s)
        assert row.speedup_vs_full == pytest.approx(ref.median_s / row.median_s)  # same run's medians
        assert row.speedup_vs_full_fastest == pytest.approx(ref.min_s / row.min_s)
        assert row.full_images_per_s == pytest.approx(ref.images_per_s)
        q = row.speedup_vs_full_per_round
        assert q["q1"] <= q["median"] <= q["q3"]
    assert result.seconds > 0 and isinstance(result.warnings, list)
    # the JSON form reads back as the same record
    assert SpeedRecord.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_timing_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="no operating points"):
        time_operating_points([])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        time_operating_points([OperatingPoint("unused")], rounds=0)


def test_spread_keeps_both_ends():
    assert spread(list(range(10)), 4) == [0, 3, 6, 9]
    assert spread(list(range(3)), 4) == [0, 1, 2] and spread(list(range(5)), None) == list(range(5))
    assert spread(list(range(5)), 1) == [0] and spread(list(range(5)), 0) == []


def test_speed_figure_puts_timed_frontier_points_at_their_speed_up():
    from splitvit.tune.plot import speed_figure

    points = [
        Point(0.8, 4.0, 0.25, on_frontier=True, extras={"speedup_vs_full": 2.5, "timed_token_ratio": 0.25}),
        Point(0.9, 16.0, 1.0, on_frontier=True, extras={"speedup_vs_full": 0.95}),
        Point(0.7, 8.0, 0.5, on_frontier=False),
    ]
    fig = speed_figure(points, full_quality=0.9)
    ax = fig.axes[0]
    offsets = sorted(tuple(map(float, xy)) for c in ax.collections for xy in c.get_offsets())
    assert offsets == [(0.95, 0.9), (1.0, 0.9), (2.5, 0.8)]  # the two timed points and full resolution at 1.0x
    assert "speed-up" in ax.get_xlabel()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_search_space_speed_settings_are_validated_by_key():
    space = load_space(ROOT / "search_spaces" / "smoke.yaml")
    assert space.speed.enabled and space.speed.rounds >= 1 and space.to_dict()["speed"]["batch_size"] >= 1
    assert not load_space(ROOT / "search_spaces" / "smoke.yaml", ["speed.enabled=false"]).speed.enabled
    for item, key in (
        ("speed.rounds=0", "speed.rounds"),
        ("speed.max_points=-1", "speed.max_points"),
        ("speed.batch=4", "speed.batch"),
        ("speed.enabled=sometimes", "speed.enabled"),
    ):
        with pytest.raises(SearchSpaceError) as err:
            load_space(ROOT / "search_spaces" / "smoke.yaml", [item])
        assert err.value.key == key


def test_resuming_a_sweep_saved_before_speed_settings_existed(tmp_path):
    from splitvit.tune.location import PLAN_FILE, check_plan
    from splitvit.tune.state import SweepError

    space = load_space(ROOT / "search_spaces" / "smoke.yaml")
    saved = {k: v for k, v in space.to_dict().items() if k not in ("source", "speed")}
    (tmp_path / PLAN_FILE).write_text(
        json.dumps({"space": saved, "overrides": [], "source": space.source}, default=str)
    )
    assert check_plan(space, str(tmp_path), None, resume=True) is space
    changed = {**saved, "speed": {**space.to_dict()["speed"], "rounds": 99}}
    (tmp_path / PLAN_FILE).write_text(
        json.dumps({"space": changed, "overrides": [], "source": space.source}, default=str)
    )
    with pytest.raises(SweepError, match="speed"):
        check_plan(space, str(tmp_path), None, resume=True)


def test_a_sweep_resumes_from_another_checkout_of_the_same_files_but_not_from_another_base(tmp_path):
    """The plan keeps the base config's contents: a resume from a moved checkout (the
    base at another path, the same settings) continues; a changed base is refused."""
    import shutil

    from splitvit.tune.location import check_plan
    from splitvit.tune.state import SweepError

    first, second = tmp_path / "first", tmp_path / "second"
    for checkout in (first, second):
        shutil.copytree(ROOT / "search_spaces", checkout / "search_spaces")
        shutil.copytree(ROOT / "jobs" / "configs", checkout / "jobs" / "configs")
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    started = load_space(first / "search_spaces" / "smoke.yaml")
    check_plan(started, str(sweep_dir), None, resume=False)
    moved = load_space(second / "search_spaces" / "smoke.yaml")
    assert moved.base != started.base
    assert check_plan(moved, str(sweep_dir), None, resume=True) is moved
    base = Path(moved.base)
    base.write_text(base.read_text().replace("seed: 0", "seed: 7", 1))
    with pytest.raises(SweepError, match=r"differs .* \(in base\)"):
        check_plan(load_space(second / "search_spaces" / "smoke.yaml"), str(sweep_dir), None, resume=True)


def test_a_budget_conditioned_point_is_timed_at_the_budget_it_was_evaluated_at(tmp_path):
    """The thresholds of a budget-conditioned model were calibrated with the policy told
    the target ratio; timing the point with the checkpoint's own budget instead would
    time another operating point (a study once timed '@0.1' at 93% of the tokens)."""
    import torch

    from splitvit.train.evaluation import CheckpointEvaluator

    torch.manual_seed(0)
    folder = Path(checkpoint(tmp_path / "any", budget_conditioned=True))
    model = SplitViT.load(folder / "model.pt").eval()
    assert model.uses_budget
    images = CheckpointEvaluator(str(folder), samples=8, cache=False).first_images(8)  # the batch timed
    budgets = (0.05, 1.0)
    with torch.no_grad():
        # a threshold between the split scores the two budgets give, so the budget decides
        means = [float(model(images, budget=b).split_probs[0].mean()) for b in budgets]
        threshold = sum(means) / 2
        expected = [float(model(images, thresholds=[threshold], budget=b).tokens.float().mean()) for b in budgets]
    assert expected[0] != expected[1]
    points = [OperatingPoint(str(folder), [threshold], budget=b, label=f"b{b}") for b in budgets]
    rows = time_operating_points(points, batch_size=8, rounds=1, warmup=0).points
    assert [r.budget for r in rows] == list(budgets)
    assert [r.tokens_per_image for r in rows] == pytest.approx(expected)


def test_an_evaluation_reads_the_samples_asked_for_even_where_the_config_sets_num_samples(tmp_path):
    """``splitvit eval --samples`` once lost to a checkpoint's ``data.options.num_samples``
    (which wins over the split's own count), while the sweeps' evaluator honoured it."""
    import torch

    from splitvit.train.evaluation import CheckpointEvaluator, evaluate_checkpoint

    folder = Path(checkpoint(tmp_path / "n"))
    payload = torch.load(folder / "model.pt", weights_only=False)
    payload["config"]["data"]["options"]["num_samples"] = 24
    torch.save(payload, folder / "model.pt")
    assert evaluate_checkpoint(str(folder), samples=8)["images"] == 8
    assert len(CheckpointEvaluator(str(folder), samples=5).dataset) == 5
    assert evaluate_checkpoint(str(folder))["images"] == 24  # without --samples, the config's count


def test_stage_two_calibrates_every_checkpoint_to_the_ratios_asked_for(tmp_path):
    """``stage_two.ratios``: one point per ratio, its thresholds calibrated on validation
    images, each keeping the ratio it was calibrated to, before the Optuna points (which
    the calibrated points seed); without ratios and points, nothing is evaluated."""
    from splitvit.train.evaluation import CheckpointEvaluator
    from splitvit.tune.stage_two import stage_two

    folder = checkpoint(tmp_path / "c")
    rows = stage_two(
        folder,
        points=2,
        low=0.0,
        high=1.0,
        sampler="qmc",
        seed=0,
        samples=16,
        ratios=[0.3, 0.9],
        calibration_samples=16,
    )
    assert len(rows) == 4 and [r.target_ratio for r in rows] == [0.3, 0.9, None, None]
    evaluator = CheckpointEvaluator(folder, samples=16, cache=False)
    for row in rows[:2]:
        thresholds = evaluator.calibrate(evaluator.first_images(16), row.target_ratio)
        assert row.thresholds == pytest.approx(thresholds)
        assert row.token_ratio == pytest.approx(evaluator.evaluate(thresholds).token_ratio)
    assert rows[0].token_ratio < rows[1].token_ratio  # calibrated to 30% and to 90%
    assert stage_two(folder, points=0, low=0.0, high=1.0, sampler="qmc", seed=0, samples=16) == []


def test_stage_two_measures_the_trials_own_thresholds_first_on_its_images(tmp_path):
    """``own``: the trial's thresholds evaluated on stage two's images lead the points
    (before the calibrated ones), with the figures an evaluation on those images gives;
    asked for alone, they are the one point."""
    from splitvit.train.evaluation import CheckpointEvaluator
    from splitvit.tune.stage_two import stage_two

    folder = checkpoint(tmp_path / "c")
    rows = stage_two(
        folder,
        points=1,
        low=0.0,
        high=1.0,
        sampler="qmc",
        seed=0,
        samples=12,
        own=[0.4],
        ratios=[0.5],
        calibration_samples=12,
    )
    assert [r.target_ratio for r in rows] == [None, 0.5, None] and rows[0].thresholds == [0.4]
    expected = CheckpointEvaluator(folder, samples=12, cache=False).evaluate([0.4])
    assert (rows[0].quality, rows[0].tokens_per_image, rows[0].images) == (
        pytest.approx(expected.quality),
        pytest.approx(expected.tokens_per_image),
        12,
    )
    alone = stage_two(folder, points=0, low=0.0, high=1.0, sampler="qmc", seed=0, samples=12, own=[0.4])
    assert len(alone) == 1 and alone[0].tokens_per_image == pytest.approx(expected.tokens_per_image)


def test_stage_two_ratios_are_validated_and_a_sweep_started_without_them_resumes(tmp_path):
    """A sweep whose stored plan lacks a key added later (stage_two.ratios,
    calibration_samples, baselines.reuse) resumes where the space leaves it at its
    default, and is refused where the space sets it otherwise."""
    from splitvit.tune.location import PLAN_FILE, check_plan
    from splitvit.tune.state import SweepError

    with pytest.raises(SearchSpaceError) as err:
        load_space(ROOT / "search_spaces" / "smoke.yaml", ["stage_two.ratios=[0.5,0]"])
    assert err.value.key == "stage_two.ratios[1]"
    with pytest.raises(SearchSpaceError) as err:
        load_space(ROOT / "search_spaces" / "smoke.yaml", ["stage_two.calibration_samples=0"])
    assert err.value.key == "stage_two.calibration_samples"
    space = load_space(ROOT / "search_spaces" / "smoke.yaml")
    saved = json.loads(json.dumps({k: v for k, v in space.to_dict().items() if k != "source"}, default=str))
    del saved["stage_two"]["ratios"]  # as a sweep started before the key existed stored it
    (tmp_path / PLAN_FILE).write_text(json.dumps({"space": saved, "overrides": [], "source": space.source}))
    assert check_plan(space, str(tmp_path), None, resume=True) is space
    asked = load_space(ROOT / "search_spaces" / "smoke.yaml", ["stage_two.ratios=[0.5]"])
    with pytest.raises(SweepError, match="stage_two"):
        check_plan(asked, str(tmp_path), None, resume=True)
    # a plan saved before stage_two.calibration_samples resumes where the space leaves it unset
    del saved["stage_two"]["calibration_samples"]
    saved["stage_two"]["ratios"] = []
    (tmp_path / PLAN_FILE).write_text(json.dumps({"space": saved, "overrides": [], "source": space.source}))
    assert check_plan(space, str(tmp_path), None, resume=True) is space
    asked = load_space(ROOT / "search_spaces" / "smoke.yaml", ["stage_two.calibration_samples=512"])
    with pytest.raises(SweepError, match="stage_two"):
        check_plan(asked, str(tmp_path), None, resume=True)
    # and one saved before baselines.reuse: the same rule, section by section
    saved["stage_two"]["calibration_samples"] = None
    del saved["baselines"]["reuse"]
    (tmp_path / PLAN_FILE).write_text(json.dumps({"space": saved, "overrides": [], "source": space.source}))
    assert check_plan(space, str(tmp_path), None, resume=True) is space
    asked = load_space(ROOT / "search_spaces" / "smoke.yaml", ["baselines.reuse=false"])
    with pytest.raises(SweepError, match="baselines"):
        check_plan(asked, str(tmp_path), None, resume=True)


def test_stage_two_calibrates_on_the_spaces_count_else_the_datas_evaluation_batch():
    """``stage_two.calibration_samples`` where set (the classification CPU space: 512, as the
    study calibrates its curves), else the data's evaluation batch, else its batch."""
    from splitvit.tune.trial import calibration_samples

    space = load_space(ROOT / "search_spaces" / "classification_cpu.yaml")
    assert calibration_samples(space, space.config()) == 512
    unset = load_space(ROOT / "search_spaces" / "classification_cpu.yaml", ["stage_two.calibration_samples=null"])
    assert calibration_samples(unset, unset.config()) == 256  # its data.eval_batch_size
    no_eval_batch = load_space(
        ROOT / "search_spaces" / "classification_cpu.yaml",
        ["stage_two.calibration_samples=null", "data.eval_batch_size=null"],
    )
    assert calibration_samples(no_eval_batch, no_eval_batch.config()) == 32  # its data.batch_size


def test_reselect_frontier_chooses_the_frontier_again_on_more_validation_images(tmp_path):
    """``scripts/reselect_frontier.py``: a sweep's points are evaluated again on the
    validation images asked for, the frontier is chosen on those figures (a point that
    only stored figures made look good drops out), and each frontier point gets held-out
    figures: kept where the sweep had them, evaluated where it had none."""
    import subprocess
    import sys

    from splitvit.train.evaluation import CheckpointEvaluator

    folder = checkpoint(tmp_path / "c")
    coarse, fine = [1.0], [0.0]  # 4 of 16 tokens; all 16
    stored = {"test_accuracy": 0.123, "test_token_ratio": 0.25, "test_tokens_per_image": 4.0}
    points = [  # the stored validation figures are made up: only their thresholds count
        {
            "trial_id": "a",
            "kind": "trial",
            "checkpoint": folder,
            "thresholds": coarse,
            "accuracy": 0.9,
            "extras": stored,
        },
        {"trial_id": "a", "kind": "threshold", "checkpoint": folder, "thresholds": fine, "accuracy": 0.1, "extras": {}},
        {"trial_id": "b", "kind": "trial", "checkpoint": folder, "thresholds": coarse, "accuracy": 0.2, "extras": {}},
    ]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"name": "s", "metric": "accuracy", "points": points, "frontier": points[:1]}))
    out = tmp_path / "out.json"
    args = ["--val-samples", "16", "--test-samples", "8", "--jobs", "1", "--json", str(out)]
    script = ROOT / "scripts" / "reselect_frontier.py"
    subprocess.run([sys.executable, str(script), str(sweep), *args], cwd=ROOT, check=True, capture_output=True)
    result = json.loads(out.read_text())
    val = CheckpointEvaluator(folder, split="val", samples=16, cache=False)
    figures = {tuple(t): val.evaluate(t) for t in (coarse, fine)}
    expected = [  # both coarse points tie (the same checkpoint and thresholds); fine is kept if it is more accurate
        (p["trial_id"], p["thresholds"])
        for p in points
        if p["thresholds"] == coarse or figures[(0.0,)].quality > figures[(1.0,)].quality
    ]
    assert [(p["trial_id"], p["thresholds"]) for p in result["frontier"]] == sorted(
        expected, key=lambda e: figures[tuple(e[1])].token_ratio
    )
    assert "points" not in result and result["name"] == "s (frontier on 16 validation images)"
    for p in result["frontier"]:
        own = figures[tuple(p["thresholds"])]
        assert (p["accuracy"], p["token_ratio"]) == (own.quality, own.token_ratio)
    test = CheckpointEvaluator(folder, split="test", samples=8, cache=False).evaluate(coarse)
    by_trial = {p["trial_id"]: p for p in result["frontier"] if p["thresholds"] == coarse}
    assert by_trial["a"]["extras"] == stored  # held-out figures the sweep had are kept
    assert by_trial["b"]["extras"]["test_accuracy"] == test.quality  # new ones evaluated on the test split
    # a file without a sweep's points: one line naming it, nothing written
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"name": "s", "metric": "accuracy", "points": []}))
    done = subprocess.run(
        [sys.executable, str(script), str(empty), "--json", str(tmp_path / "none.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and f"{empty}: no point with a checkpoint and thresholds" in done.stderr
    assert not (tmp_path / "none.json").exists()


def test_paired_difference_compares_two_points_image_by_image(tmp_path):
    """``scripts/paired_difference.py``: each point's accuracy and token ratio are its
    evaluation's; the difference is theirs, with the paired standard error of the
    per-image difference; a point against itself differs by nothing; a point without
    thresholds, a model that is not a classifier and two splits of different images are
    each one line naming the problem."""
    import math
    import subprocess
    import sys

    import torch

    from splitvit.train.evaluation import CheckpointEvaluator

    folder = checkpoint(tmp_path / "c")
    script = ROOT / "scripts" / "paired_difference.py"
    out = tmp_path / "paired.json"
    coarse, fine = f"{folder}:1.0", f"{folder}:0.0"
    args = ["--split", "val", "--samples", "16", "--json", str(out)]
    subprocess.run([sys.executable, str(script), coarse, fine, *args], cwd=ROOT, check=True, capture_output=True)
    result = json.loads(out.read_text())
    val = CheckpointEvaluator(folder, split="val", samples=16, cache=False)
    a, b = val.evaluate([1.0]), val.evaluate([0.0])
    assert result["images"] == 16
    assert (result["accuracy_a"], result["accuracy_b"]) == (pytest.approx(a.quality), pytest.approx(b.quality))
    assert (result["token_ratio_a"], result["token_ratio_b"]) == (pytest.approx(0.25), pytest.approx(1.0))
    assert result["difference_points"] == pytest.approx((a.quality - b.quality) * 100)
    # per image the difference is -1, 0 or 1: its variance follows from the disagreements
    d, mean = result["discordant"], (a.quality - b.quality)
    variance = (d - mean**2) * 16 / 15
    assert result["standard_error_points"] == pytest.approx(math.sqrt(max(variance, 0.0) / 16) * 100)
    subprocess.run([sys.executable, str(script), coarse, coarse, *args], cwd=ROOT, check=True, capture_output=True)
    same = json.loads(out.read_text())
    assert (same["difference_points"], same["standard_error_points"], same["discordant"]) == (0.0, 0.0, 0.0)
    bad = subprocess.run([sys.executable, str(script), str(folder), fine], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "is not CHECKPOINT:T1,T2" in bad.stderr
    # a segmentation model has no accuracy to pair: refused in one line, before any image is read
    dense = SplitViT.from_timm(
        MODEL["name"],
        policy=PolicyConfig(depth=1),
        levels=2,
        image_size=16,
        num_classes=4,
        task="dense",
        timm_kwargs=MODEL["timm_kwargs"],
    )
    (tmp_path / "dense").mkdir()
    payload = torch.load(Path(folder) / "model.pt", map_location="cpu", weights_only=False)
    dense.save(tmp_path / "dense" / "model.pt", extra={"config": payload["config"]})
    refused = subprocess.run(
        [sys.executable, str(script), f"{tmp_path / 'dense'}:0.5", fine], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "is a dense model; accuracy needs a classifier" in refused.stderr
    # two checkpoints whose splits hold different images cannot be paired: refused in one line
    (tmp_path / "fewer").mkdir()
    payload["config"]["data"]["options"]["val_samples"] = 12
    torch.save(payload, tmp_path / "fewer" / "model.pt")
    differ = subprocess.run(
        [sys.executable, str(script), f"{tmp_path / 'fewer'}:0.5", fine, "--split", "val"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert differ.returncode != 0 and "the two checkpoints' val splits differ (12 vs 16 images)" in differ.stderr
