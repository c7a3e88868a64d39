"""``splitvit bench train`` on a tiny model: structure and consistency of the figures,
no timing thresholds. One run through the CLI covers both parts (Ray part on the
session's shared Ray)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from splitvit.bench.training import (
    RAY_OVERHEAD_TARGET,
    STEP_NAMES,
    benchmark_config,
    run_train_benchmark,
)
from splitvit.cli import main
from splitvit.cli.app import build_parser
from splitvit.cli.bench import run_forward

from .helpers import walk_numbers

TINY_ARGS = [
    "--image-size",
    "16",
    "--patch-size",
    "4",
    "--levels",
    "2",
    "--embed-dim",
    "16",
    "--depth",
    "1",
    "--heads",
    "1",
    "--policy-depth",
    "1",
    "--batch-size",
    "8",
    "--repeats",
    "2",
    "--epochs",
    "2",
    "--samples",
    "16",
    "--val-samples",
    "8",
    "--threads",
    "1",
    "--teacher-every",
    "2",
]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, ray_session):
    """The JSON ``splitvit bench train --json`` wrote, and the report it printed."""
    out = tmp_path_factory.mktemp("bench-train") / "train.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["bench", "train", *TINY_ARGS, "--json", str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def cli_result(cli_run):
    return cli_run[0]


def test_json_structure_and_finite(cli_result):
    for key in ("benchmark", "model", "machine", "steps", "ray_overhead", "targets", "warnings"):
        assert key in cli_result, key
    assert cli_result["benchmark"] == "train"
    json.dumps(cli_result, allow_nan=False)
    for path, value in walk_numbers(cli_result):
        assert math.isfinite(value), path
    model = cli_result["model"]
    assert model["full_tokens"] == 16 and model["min_tokens"] == 4 and model["batch_size"] == 8


def test_step_throughput_figures(cli_result):
    steps = cli_result["steps"]["steps"]
    assert set(steps) == set(STEP_NAMES)
    for name, t in steps.items():
        assert len(t["samples_s"]) == 2 and all(s > 0 for s in t["samples_s"]), name
        assert t["min_s"] <= t["median_s"] <= t["max_s"]
        assert t["images_per_s"] == pytest.approx(8 / t["median_s"])
        assert t["ratio_to_full"] == pytest.approx(steps["full"]["median_s"] / t["median_s"])
        assert t["ratio_to_full_fastest"] > 0
    assert steps["full"]["token_fraction"] == 1.0 and steps["full"]["ratio_to_full"] == 1.0
    for name in ("split_warmup", "split_learned", "split_learned_every_step"):
        f = steps[name]["token_fraction"]
        assert 4 / 16 <= f <= 1.0 and steps[name]["ideal_ratio"] == pytest.approx(1 / f)
    assert cli_result["steps"]["config"]["policy_aim"]["expected_ratio"] == pytest.approx(0.5, abs=0.05)
    assert 0 < steps["teacher"]["share_of_split_learned"]


def test_ray_overhead_figures(cli_result):
    b = cli_result["ray_overhead"]
    assert b["config"]["threads"] == 1 and b["config"]["experiment"]["scaling"]["num_workers"] == 1
    assert b["config"]["experiment"]["scaling"]["resources_per_worker"] == {"CPU": 1.0}
    assert b["worker_threads"]["torch_threads"] == 1  # checked inside the Ray worker
    (pair,) = b["runs"]
    for kind in ("plain", "ray"):
        run = pair[kind]
        assert [e["epoch"] for e in run["epochs"]] == [0, 1]
        assert all(e["images"] == 16 and e["images_per_s"] > 0 and e["train_s"] > 0 for e in run["epochs"])
        assert run["steady"]["epochs"] == [1]
        assert run["steady"]["images_per_s"] == pytest.approx(run["epochs"][1]["images_per_s"])
        assert run["wall_s"] > 0
        assert run["epochs"][0]["whole_epoch_s"] > 0 and run["epochs"][0]["whole_epoch_cpu_s"] >= 0
    assert b["ratio_steady"] == pytest.approx(pair["ratio"])
    assert b["ratio_steady"] == pytest.approx(b["ray"]["steady_images_per_s"] / b["plain"]["steady_images_per_s"])
    assert b["ray"]["end_to_end_s"] >= pair["ray"]["wall_s"] > 0
    target = b["target"]
    assert target["bound"] == RAY_OVERHEAD_TARGET and target["passed"] == (target["value"] >= RAY_OVERHEAD_TARGET)
    assert cli_result["targets"] == [target]


def test_report_labels(cli_run):
    cli_result, report = cli_run
    for label in (
        "A. training-step throughput",
        "SPLIT learned",
        "ideal (1/fraction)",
        "B. Ray Train overhead",
        "END TO END (incl. Ray start-up)",
        "PASS" if cli_result["targets"][0]["passed"] else "MISS",
    ):
        assert label in report


def test_validation_and_each_benchmarks_own_options(capsys):
    """Each benchmark parses only its own options, and `splitvit bench` alone names the three."""
    with pytest.raises(ValueError, match="parts"):
        run_train_benchmark(benchmark_config(), parts=("nope",))
    for argv, unknown in (
        (["bench", "forward", "--epochs", "2"], "--epochs 2"),
        (["bench", "train", "--ratios", "0.5", "--buckets", "1"], "--ratios 0.5 --buckets 1"),
    ):
        with pytest.raises(SystemExit) as stopped:
            build_parser().parse_args(argv)
        assert stopped.value.code == 2 and f"unrecognized arguments: {unknown}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--ratios: expected comma-separated floats, got 'half'"):
        run_forward(build_parser().parse_args(["bench", "forward", "--ratios", "half"]))
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["bench"])
    assert stopped.value.code == 2 and "required: {forward,parts,train,data}" in capsys.readouterr().err


def test_the_benchmark_config_takes_a_recipes_settings_only_when_named():
    """By default the step is the one the options describe (no recipe); a recipe's name
    adds its settings where the options leave them; a dense recipe on the classification
    benchmark is one error naming the recipe key."""
    from splitvit.config import ConfigError

    plain = benchmark_config(levels=3, teacher="attention")
    assert plain.recipe == "none" and not plain.model.fine_aggregation and not plain.model.policy.level_context
    recipe = benchmark_config(levels=3, teacher="attention", recipe="classification-v1")
    assert recipe.model.fine_aggregation and recipe.model.policy.level_context
    assert recipe.train.teacher.targets == "mixed" and recipe.train.teacher.kind == "attention"
    with pytest.raises(ConfigError, match="recipe"):
        benchmark_config(recipe="dense-v1")


def test_part_bs_records_write_its_json_and_ray_counts_its_start_up_end_to_end():
    """Part B's typed records without training: a round's runs under their kinds in the
    order they ran, the plain run's saves and the whole epochs only where measured, and
    the totals (Ray's end to end includes its start-up; its last epoch's end is unmarked)."""
    from splitvit.bench.training import (
        EpochFigures,
        OverheadPair,
        PlainRun,
        RayRun,
        WorkerThreads,
        _overhead_figures,
        _steady,
        _whole_epochs,
    )

    def epochs(save_s):
        return [EpochFigures(e, 100, 2.0, 50.0, 3.0, save_s, 0.5, 0.4) for e in range(2)]

    plain = PlainRun(epochs(0.1), 8.0, 1, None, 1.0)
    worker = WorkerThreads(
        pid=1, omp_num_threads="1", torch_threads_found=1, torch_threads=1, interop_threads=1, forced=False
    )
    ray = RayRun(epochs(None), 9.0, 1.0, 10.0, True, worker, 1.5, 0.2)
    _whole_epochs([{"epoch": e, "wall": 4.0 * e, "cpu": 3.0 * e} for e in range(3)], plain.epochs)
    _whole_epochs([{"epoch": e, "wall": 5.0 * e, "cpu": 2.0 * e} for e in range(2)], ray.epochs)
    plain.steady, ray.steady = _steady(plain.epochs, 1), _steady(ray.epochs, 1)
    pair = OverheadPair(("ray", "plain"), plain, ray, 1.0)
    data = pair.to_dict()
    assert list(data) == ["order", "ray", "plain", "ratio"] and data["order"] == ["ray", "plain"]
    assert data["plain"]["steady"] == {"epochs": [1], "images": 100, "train_s": 2.0, "images_per_s": 50.0}
    whole = {"whole_epoch_s", "whole_epoch_cpu_s"}
    assert [set(e) - set(data["ray"]["epochs"][1]) for e in data["plain"]["epochs"]] == [{"save_s", *whole}] * 2
    assert whole <= set(data["ray"]["epochs"][0])  # the Ray run's last epoch has no end mark: only the first
    figures = _overhead_figures([pair], skip_epochs=0).to_dict()
    assert figures["plain"]["whole_epochs"] == figures["ray"]["whole_epochs"] == 1  # epoch 0, marked in both
    assert figures["ratio_whole_epoch"] == pytest.approx(4.0 / 5.0)
    assert figures["ratio_whole_epoch_cpu_time"] == pytest.approx(3.0 / 2.0)
    assert figures["ratio_end_to_end"] == pytest.approx(8.0 / 10.0) and figures["ratio_steady"] == 1.0
    assert data["ray"]["worker_threads"]["omp_num_threads"] == "1"
    assert json.loads(json.dumps(data)) == data
