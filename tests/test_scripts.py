"""The scripts under scripts/: each table script run on the committed JSON, its figures
checked against what the JSON holds; the measurement scripts' pure parts on inputs whose
answer is known; every script importable; every relative link in the docs resolving."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
MEASUREMENTS = ROOT / "docs" / "measurements"
CLASSIFICATION = MEASUREMENTS / "cpu-2026-12-02-scratch10" / "study_fashion_scratch10.json"
DENSE = MEASUREMENTS / "cpu-2026-12-05-seg-speed" / "study_fashion_seg.json"
# the dense ablation's 12-epoch rows (the default before its 2026-12-05 rerun)
DENSE_2026_12_03 = MEASUREMENTS / "cpu-2026-12-03-seg" / "study_fashion_seg_scratch12.json"
DETECTION = MEASUREMENTS / "cpu-2026-12-05-det-ref28" / "study_fashion_det.json"
# the v2 defaults' evidence: their studies' headline since, the teacher on every 2nd step
CLASSIFICATION_V2 = MEASUREMENTS / "cpu-2026-12-07-cls-v2" / "study_fashion_v2_side.json"
DENSE_V2 = MEASUREMENTS / "cpu-2026-12-05-seg-speed" / "study_fashion_seg_t2_side.json"
RECIPE = "split-0.5-agg-mixed-ctx"
RECIPE_V2 = "split-0.5-agg-mixed-ctx-t2"
DETECTION_RECIPE = "split-0.7-objects-d2-lead4-policy4-batch-fgrad-fine"  # policy, fine-tune, policy


def run_script(name: str, *args: str) -> str:
    """A script's stdout, run from the repository root as the docs say to run it."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


def study(path: Path) -> dict:
    return json.loads(path.read_text())


def gap_line(output: str, name: str, method: str, ratio: str) -> str:
    """The seed-by-seed gap line of ``method`` at ``ratio`` in the section of study ``name``."""
    section = output.split(f"## {name} ")[1].split("\n## ")[0]
    return next(line for line in section.splitlines() if line.startswith(f"* {method} at {ratio}:"))


def test_study_tables_print_the_default_studies_figures_from_their_json():
    output = run_script("study_tables.py")  # default: the default recipes' studies, then the v1 ones
    defaults = [(CLASSIFICATION_V2, RECIPE_V2), (DENSE_V2, RECIPE_V2), (DETECTION, DETECTION_RECIPE)]
    for path, method in defaults + [(CLASSIFICATION, RECIPE), (DENSE, RECIPE)]:
        data = study(path)
        metric = data["metric"]
        rows = {(r["method"], r["target_ratio"]): r for r in data["rows"]}
        recipe = rows[(method, 0.5)]
        assert f"| 0.50 | {recipe[metric] * 100:.1f} ± {recipe[metric + '_std'] * 100:.1f} |" in output
        # the seed-by-seed gap, as calibrated, is the study's own goal line (its sign: SPLIT minus control)
        goal = data["goals"]["match_also"][0]
        line = gap_line(output, data["name"], method, "50%")
        assert f"({-goal['gap_points']:+.2f} ± {goal['gap_std_points']:.2f}) as calibrated" in line
        # the speed table beside it: each timed point's measured speed-up over the control
        section = output.split(f"## {data['name']} ")[1].split("\n## ")[0]
        speed = section.split("measured side by side")[1]
        for point in data["point_speed"]["points"]:
            if point["method"] == method:
                row = next(line for line in speed.splitlines() if line.startswith(f"| {point['target_ratio']:.2f} |"))
                assert f"{point['speedup_vs_full']:.2f}x" in row


def test_study_tables_print_a_detectors_mask_ap_and_backbone_speed_beside_its_box_ap():
    data = study(DETECTION)
    section = run_script("study_tables.py", str(DETECTION)).split("mask_ap (%):")[1].split("Speed-up")[0]
    recipe = next(r for r in data["rows"] if (r["method"], r["target_ratio"]) == (DETECTION_RECIPE, 0.7))
    row = next(line for line in section.splitlines() if line.startswith("| 0.70 |"))
    assert f"| 0.70 | {recipe['mask_ap'] * 100:.1f} ± {recipe['mask_ap_std'] * 100:.1f} |" in row
    speed = run_script("study_tables.py", str(DETECTION)).split("measured side by side")[1]
    assert f"(backbone {recipe['backbone_speedup_vs_full']:.2f}x)" in speed


def test_study_tables_read_each_seed_at_exactly_the_ratio_asked_for():
    """The 'at exactly 50%' gaps: each seed's points interpolated at 50% of the tokens,
    here recomputed with numpy from the JSON's runs."""
    data = study(DENSE)
    control = next(r for r in data["rows"] if r["method"] == "full")["per_seed"]
    expected = []
    for seed in ("0", "1"):
        run = next(r for r in data["runs"] if r["method"] == RECIPE and str(r["seed"]) == seed)
        points = sorted((p["token_ratio"], p["quality"]) for p in run["points"])
        shares, qualities = zip(*points)
        expected.append((np.interp(0.5, shares, qualities) - control[seed]) * 100)
    line = gap_line(run_script("study_tables.py", str(DENSE)), data["name"], RECIPE, "50%")
    exact = re.search(r"at exactly 50%: ([-+.\d]+), ([-+.\d]+) ", line)
    assert [float(g) for g in exact.groups()] == pytest.approx(expected, abs=0.006)
    assert "(+0.39 ± 0.40)" in line  # the figure docs/results.md quotes


def test_ablation_table_gaps_match_the_studies_own_lever_tables():
    output = run_script("ablation_table.py")
    rows = [line.split(" | ") for line in output.splitlines()[2:]]
    recipe_at_10 = next(r for r in rows if r[0] == "| 10 epochs" and r[1] == RECIPE)
    lever = next(lever for lever in study(CLASSIFICATION)["levers"] if lever["method"] == RECIPE)
    for column, key in ((4, "r0.5"), (5, "r0.7")):
        cell = lever[key]
        assert recipe_at_10[column] == f"{-cell['gap_points']:+.2f} ± {cell['gap_std_points']:.2f}"
    # one control row per fine-tune, however many JSON hold it
    lengths = [r[0] for r in rows if r[1] == "full (the control)"]
    assert len(lengths) == len(set(lengths))
    assert {"| 2 epochs", "| 4 epochs", "| 8 epochs", "| 8 epochs, lr 6e-4", "| 10 epochs", "| 12 epochs"} == set(
        lengths
    )


def test_ablation_table_dense_rows_are_the_studies_rows():
    output = run_script("ablation_table.py", "--study", "dense")
    for path, fine_tune in ((DENSE_2026_12_03, "12 epochs"), (DENSE, "12 epochs, rerun 2026-12-05")):
        entropy = {r["target_ratio"]: r for r in study(path)["rows"] if r["method"] == "entropy"}
        row = next(line for line in output.splitlines() if line.startswith(f"| {fine_tune} | entropy |"))
        cells = row.split(" | ")[2:7]
        assert cells == [
            f"{entropy[t]['miou'] * 100:.1f} ± {entropy[t]['miou_std'] * 100:.1f}" for t in (0.1, 0.3, 0.5, 0.7, 0.8)
        ]
    # a lever beside the control of its own invocation: the teacher on every 2nd step
    lever = study(DENSE.with_name("study_fashion_seg_t2.json"))["goals"]["match_also"][0]
    row = next(line for line in output.splitlines() if "| split-0.5-agg-mixed-ctx-t2 |" in line)
    assert f"| {-lever['gap_points']:+.2f} ± {lever['gap_std_points']:.2f} |" in row


def test_policy_cost_table_is_the_mean_of_each_variants_seeds():
    output = run_script("policy_cost_ablation.py", "table")
    data = study(MEASUREMENTS / "cpu-2026-11-30" / "policy-cost-ablation" / "ablation.json")
    seeds = data["results"]["teacher every 4th step"]
    mean = sum(r["accuracy"] for r in seeds) / len(seeds) * 100
    row = next(line for line in output.splitlines() if line.startswith("| teacher every 4th step |"))
    assert f"| {mean:.1f}% ({seeds[0]['accuracy'] * 100:.1f}, {seeds[1]['accuracy'] * 100:.1f}) |" in row
    assert "| attention teacher | 93.5% (96.3, 90.6) | 41.3% |" in output  # the second JSON's variant


def test_the_oracle_counts_the_coarsest_tree_that_shows_every_masked_pixel_fine():
    oracle = load_script("oracle_item_coverage.py")
    mask = np.zeros((64, 64), dtype=bool)
    assert oracle.oracle_tokens(mask) == (4, 0)  # nothing to see: 4 coarse tokens
    mask[40, 3] = True  # one pixel: its 32-px cell splits, then its 16-px cell
    assert oracle.oracle_tokens(mask) == (3 + 3 + 4, 4)
    assert oracle.object_cells(mask) == 1
    assert oracle.oracle_tokens(np.ones((64, 64), dtype=bool)) == (64, 64)  # full resolution
    # another tree: 4-px patches, 2 levels (8-px coarse cells) on a 16-px canvas
    assert oracle.oracle_tokens(mask[:16, :16], fine=4, levels=2) == (4, 0)
    assert oracle.oracle_tokens(np.ones((16, 16), dtype=bool), fine=4, levels=2) == (16, 16)


@pytest.mark.parametrize("name", ["study_fashion.yaml", "study_fashion_det.yaml"])
def test_the_shipped_studies_canvases_leave_their_parity_goal_room(name, tmp_path, monkeypatch):
    """An oracle that keeps exactly the items' boxes fine fits, on average, in the token
    share the study asks SPLIT to match full resolution at: a goal below that would ask
    more than any policy can give (the first detection study's 2-4 items of 14-30 px
    needed 78%). Boxes, not pixels: the fake items fill their boxes less than real ones."""
    from splitvit.data.fashion_mnist import DATA_DIR_ENV
    from splitvit.study.spec import load_study

    from .helpers import write_fake_fashion_mnist

    monkeypatch.setenv(DATA_DIR_ENV, str(write_fake_fashion_mnist(tmp_path / "fmnist", train=5100, test=40)))
    oracle = load_script("oracle_item_coverage.py")
    study_file = ROOT / "studies" / name
    header, shares = oracle.canvas_shares(study_file, samples=200)
    boxes = [share for share, _, _ in shares["item boxes"]]
    assert "canvases of 64 px, 8-px finest patches, 3 levels (64 tokens" in header
    assert len(boxes) == 200 and min(boxes) >= 4 / 64
    assert sum(boxes) / len(boxes) <= load_study(study_file, settings_only=True).goals.match_ratio


def test_level_ranking_spearman_is_plus_one_for_the_same_order_and_minus_one_reversed():
    import torch

    ranking = load_script("policy_level_ranking.py")
    scores = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.2, 0.8, 0.4, 0.6]])
    assert ranking._spearman(scores, scores * 10).tolist() == pytest.approx([1.0, 1.0])
    assert ranking._spearman(scores, -scores).tolist() == pytest.approx([-1.0, -1.0])


def test_headroom_auc_is_the_chance_that_a_positive_outscores_a_negative():
    import math

    import torch

    headroom = load_script("policy_headroom.py")
    labels = torch.tensor([[True, False, True, False]])
    assert headroom.roc_auc(torch.tensor([[0.9, 0.1, 0.8, 0.2]]), labels) == 1.0
    assert headroom.roc_auc(torch.tensor([[0.1, 0.9, 0.2, 0.8]]), labels) == 0.0
    assert headroom.roc_auc(torch.tensor([[0.9, 0.5, 0.5, 0.1]]), labels) == 0.875  # 3 of 4 pairs won, 1 tied
    assert math.isnan(headroom.roc_auc(torch.tensor([0.3, 0.7]), torch.tensor([True, True])))


def test_dilated_scores_spread_each_finest_node_over_its_neighbours():
    import torch

    dilation = load_script("score_dilation.py")
    coarse, finest = torch.tensor([[[0.4]]]), torch.zeros(1, 3, 3)
    finest[0, 0, 0] = 0.8
    assert dilation.dilate_scores([coarse, finest], "none")[1] is finest
    spread = dilation.dilate_scores([coarse, finest], "max:0.5")
    assert spread[0] is coarse
    assert torch.equal(spread[1], torch.tensor([[[0.8, 0.4, 0.0], [0.4, 0.4, 0.0], [0.0, 0.0, 0.0]]]))
    blended = dilation.dilate_scores([coarse, finest], "mean:0.5")[1]
    assert blended[0, 0, 0].item() == pytest.approx(0.5 * 0.8 + 0.5 * 0.8 / 4)  # the corner's 4 neighbours
    assert blended[0, 2, 2].item() == 0.0
    with pytest.raises(ValueError, match="unknown variant 'ring:1'"):
        dilation.dilate_scores([coarse, finest], "ring:1")


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_script_imports(name):
    """The measurement scripts need checkpoints or data to run; importing them at least
    checks that the library names they use still exist."""
    assert callable(load_script(name).main)


def test_every_relative_link_in_the_docs_resolves():
    done = subprocess.run([sys.executable, str(SCRIPTS / "check_links.py")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_the_link_check_finds_a_missing_file_a_missing_anchor_and_a_link_outside(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with `code`\n")
    (tmp_path / "doc.md").write_text(
        "# Doc\n[ok](other.md#a-heading-with-code) [self](#doc) `[code](gone.md)`\n"
        "[missing](gone.md) [anchor](other.md#nope) [web](https://example.org)\n"
    )
    checker = load_script("check_links.py")
    problems = checker.broken_links(tmp_path / "doc.md", tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "gone.md: no such file",
        "other.md#nope: no heading with anchor #nope",
        "https://example.org: points outside the repository",
    ]


CLS_V2_STUDY = "cpu-2026-12-07-cls-v2/study_fashion_v2_side.json"


@pytest.mark.parametrize(
    "folder, sweep, comparison, control_study",
    [
        ("cpu-2026-12-06-sweep", "sweep_classification_cpu.json", "comparison.json", None),
        ("cpu-2026-12-06-sweep-v2", "sweep_classification_cpu_v2.json", "comparison.json", None),
        # the second run's frontier chosen again on 5,000 validation images (scripts/reselect_frontier.py)
        ("cpu-2026-12-06-sweep-v2", "frontier_val5000.json", "comparison_val5000.json", None),
        # the third: every point measured on 5,000 validation images by the sweep itself
        ("cpu-2026-12-06-sweep-v3", "sweep_classification_cpu_v3.json", "comparison.json", None),
        # the fourth, on classification-v2 without its baselines: the control from the study
        ("cpu-2026-12-07-sweep-v5", "sweep_classification_cpu_v5.json", "comparison.json", CLS_V2_STUDY),
    ],
)
def test_sweep_vs_recipe_prints_the_committed_sweeps_table_from_its_json(folder, sweep, comparison, control_study):
    """Each classification CPU sweep's committed JSON and recipe points give its committed
    comparison: its rows, goal lines and hypervolumes (no evaluation: the recipe's
    points are read back, not computed again)."""
    measurements = ROOT / "docs" / "measurements"
    folder = measurements / folder
    committed = json.loads((folder / comparison).read_text())
    control = ["--study", str(measurements / control_study)] if control_study else []
    output = run_script(
        "sweep_vs_recipe.py",
        str(folder / sweep),
        "--recipe-points",
        str(folder / "recipe_points.json"),
        *control,
    )
    for row in committed["rows"]:
        gap = (row["sweep"] - row["recipe"]) * 100
        assert (
            f"| {row['ratio']:.1f} | {row['sweep'] * 100:.2f} | {row['recipe'] * 100:.2f} | "
            f"{row['control'] * 100:.2f} | {gap:+.2f} |" in output
        )
    for goal in committed["goals"]:
        assert f"* {goal['goal']}: {goal['points']:+.2f} points: {'met' if goal['met'] else 'NOT met'}" in output
    hv = committed["hypervolume"]
    assert f"the sweep {hv['sweep']:.4f}, the recipe {hv['recipe']:.4f}" in output
    assert f"every goal line: {'met' if committed['met'] else 'NOT met'}" in output
