"""The study on one machine without Ray (``splitvit.study.local`` and its command
line, ``infra/gpu-check/single_gpu_study.py``): the study's own code path with a local
executor, end to end on the CPU on the tiny study of ``tests/test_study.py``; a second
invocation reuses every finished run; changed settings stop before anything runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from splitvit.study.local import LocalStudyResult, load_local_study, run_study_local
from splitvit.study.runs import STUDY_RESULT_FILE
from tests.test_study import RESULT_KEYS, ROOT, RUN_KEYS, TIMED_ROW_KEYS, untimed, write_study

LOCAL_EXTRAS = {
    "executor",
    "machine",
    "render_seconds",
    "backbone_seconds",
    "backbone_epochs",
    "method_epochs",
    "backbones",
}
METHODS = {("full", None), ("entropy", 0.25), ("entropy", 0.5), ("split", 0.25), ("split", 0.5)}
TRAIN_IMAGES = 64  # two steps of 32 per epoch


def tiny_study(folder: Path, **changes) -> Path:
    """The tiny study of ``tests/test_study.py`` (its Ray run's keys are those checked
    here) with half its training images: the same shape of result in half the time."""
    path = write_study(folder, **changes)
    raw = yaml.safe_load(path.read_text())
    raw["config"]["data.options"]["train_samples"] = TRAIN_IMAGES
    path.write_text(yaml.safe_dump(raw))
    return path


def _runner():
    """``infra/gpu-check/single_gpu_study.py``, imported as a module (it is a script, not a package module)."""
    path = ROOT / "infra" / "gpu-check" / "single_gpu_study.py"
    spec = importlib.util.spec_from_file_location("single_gpu_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def local_study(tmp_path_factory):
    """The tiny study (1 seed, a 2-block ViT on 64 synthetic images, 1 epoch per run),
    run once in this process on the CPU: its file, output folder and result."""
    folder = tmp_path_factory.mktemp("local-study")
    path = tiny_study(folder)
    out = folder / "out"
    return path, out, run_study_local(load_local_study(path, out), out, device="cpu", workers=1).to_dict()


def test_local_study_runs_the_study_path_end_to_end(local_study):
    path, out, data = local_study
    assert not data["failed"] and data["seeds"] == [0] and data["study_dir"] == str(out)
    # the shape of `splitvit study --json` (tests/test_study.py), plus the local runner's own keys
    assert set(data) == RESULT_KEYS | LOCAL_EXTRAS
    assert data["mlflow_run_id"] is None and data["tracking_uri"] is None and "no MLflow" in data["executor"]
    assert {(r["method"], r["target_ratio"]) for r in data["rows"]} == METHODS
    for row in data["rows"]:
        # every point was timed (the point speed below): its speed beside its accuracy
        assert set(row) == TIMED_ROW_KEYS and row["seeds"] == 1 and 0.0 <= row["accuracy"] <= 1.0
        if row["target_ratio"] is not None:  # calibrated on validation images, measured on test images
            assert abs(row["token_ratio"] - row["target_ratio"]) < 0.2
    assert next(r for r in data["rows"] if r["method"] == "full")["token_ratio"] == 1.0
    assert {"match", "above_baselines", "margin_over_entropy"} <= set(data["goals"])
    assert data["speed"]["ratio"] > 0 and data["speed"]["device"] == "cpu"
    ps = data["point_speed"]
    assert ps["seed"] == 0 and {(p["method"], p["target_ratio"]) for p in ps["points"]} == METHODS - {("full", None)}

    # every run as on Ray, plus its training curves (one epoch each)
    assert len(data["runs"]) == 3
    (backbone,) = data["backbones"]
    assert backbone["seed"] == 0 and len(backbone["history"]) == 2 and "config" not in backbone
    reference = data["goals"]["reference_converged"]["seeds"]["0"]
    assert reference["curve"] == [h["accuracy"] for h in backbone["history"]]
    for run in data["runs"]:
        assert set(run) == RUN_KEYS | {"steps"} and not run["reused"]
        assert run["steps"] == TRAIN_IMAGES // 32 and [h["epoch"] for h in run["history"]] == [0]
        assert {"train_loss", "train_images_per_s", "accuracy", "tokens_per_image"} <= set(run["history"][0])
        assert run["train_metrics"] == run["history"][-1]
        assert Path(run["checkpoint"]) == out / "train" / f"{run['method']}-s0" / "model.pt"
        assert len(run["points"]) == (1 if run["method"] == "full" else 2)
        # every method started from the seed's backbone, and its stored result says so
        stored = json.loads((Path(run["run_uri"]) / STUDY_RESULT_FILE).read_text())
        assert stored["config"]["model.init_from"] == backbone["checkpoint"]
        assert stored["config"]["data.seed"] == 0 and stored["config"]["train.policy.warmup_epochs"] == 0
    assert (out / "study.png").is_file()
    # its JSON reads back (as --plan reads a smaller run's) to the same JSON
    written = json.loads(json.dumps(data, default=float))
    assert json.loads(json.dumps(LocalStudyResult.from_dict(written).to_dict(), default=float)) == written


def test_second_invocation_through_the_command_line_reuses_every_finished_run(
    local_study, tmp_path, capsys, mlflow_uri
):
    path, out, first = local_study
    runner = _runner()
    checkpoints = {p: p.stat().st_mtime_ns for p in (out / "train").rglob("model.pt")}
    assert len(checkpoints) == 4  # the backbone and three methods
    # the same study with one more method, in a pool of two processes: only the new run trains (in the pool);
    # recorded in MLflow this time
    methods = {**yaml.safe_load(path.read_text())["methods"], "random": {"model.policy.kind": "random"}}
    more = tiny_study(tmp_path, methods=methods, mlflow={"experiment": "study-local"})
    result = tmp_path / "again.json"
    assert (
        runner.main(
            [
                str(more),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--workers",
                "2",
                "--json",
                str(result),
                "--tracking-uri",
                mlflow_uri,
            ]
        )
        == 0
    )
    again = json.loads(result.read_text())
    assert not again["failed"] and {r["method"]: r["reused"] for r in again["runs"]} == {
        "split": True,
        "full": True,
        "entropy": True,
        "random": False,
    }
    assert untimed([r for r in again["rows"] if r["method"] != "random"]) == untimed(first["rows"])
    assert {r["target_ratio"] for r in again["rows"] if r["method"] == "random"} == {0.25, 0.5}
    by_method = {r["method"]: r for r in again["runs"]}
    assert [by_method[r["method"]]["history"] for r in first["runs"]] == [r["history"] for r in first["runs"]]
    assert len(by_method["random"]["history"]) == 1 and by_method["random"]["steps"] == TRAIN_IMAGES // 32
    trained = {p: p.stat().st_mtime_ns for p in (out / "train").rglob("model.pt")}
    assert {p: t for p, t in trained.items() if p in checkpoints} == checkpoints  # nothing retrained
    assert set(trained) - set(checkpoints) == {out / "train" / "random-s0" / "model.pt"}
    printed = capsys.readouterr().out
    assert "4 runs (3 finished earlier, reused)" in printed and "SPLIT vs full resolution" in printed
    assert "fine-tune pace vs full" in printed  # the runs reused from the first invocation starred
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(again["mlflow_run_id"])
    assert again["tracking_uri"] == mlflow_uri and parent.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"study_table.json", "study.json", "study.png"} <= artifacts
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["entropy-s0", "full-s0", "random-s0", "split-s0"]
    checkpoints = trained

    # other settings on the same folder: one clear error, before anything runs
    assert runner.main([str(path), "--out", str(out), "--device", "cpu", "--workers", "1", "--method-epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert "split-s0 (train.epochs)" in err and "backbone-s0" not in err
    assert {p: p.stat().st_mtime_ns for p in (out / "train").rglob("model.pt")} == checkpoints

    # other evaluation settings only: every finished run is evaluated again, none retrained,
    # and MLflow's child runs get the new points
    evaluation = {**yaml.safe_load(more.read_text())["evaluation"], "ratios": [0.25, 0.5, 0.75]}
    remeasured = tiny_study(tmp_path, methods=methods, mlflow={"experiment": "study-local"}, evaluation=evaluation)
    argv = [str(remeasured), "--out", str(out), "--device", "cpu", "--workers", "1", "--json", str(result)]
    assert runner.main([*argv, "--tracking-uri", mlflow_uri]) == 0
    third = json.loads(result.read_text())
    assert all(r["reused"] and r["reevaluated"] for r in third["runs"])
    assert {r["target_ratio"] for r in third["rows"] if r["method"] == "split"} == {0.25, 0.5, 0.75}
    assert "4 runs (4 finished earlier, reused; 4 evaluated again)" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (out / "train").rglob("model.pt")} == checkpoints
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{third['mlflow_run_id']}'"
    )
    split_child = next(c for c in children if c.info.run_name == "split-s0")
    latest = {m.step for m in client.get_metric_history(split_child.info.run_id, "accuracy")}
    assert latest == {0, 1, 2}  # three evaluated ratios now

    # --plan: the largest epochs whose training fits a budget, from this run's measured speeds
    assert runner.main([str(path), "--out", str(out), "--plan", str(result), "--budget-s", "600"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backbone_epochs"] == 2 * plan["method_epochs"] >= 2 and plan["estimated_s"] <= 600
    assert plan["train_images"] == TRAIN_IMAGES
    assert runner.main([str(path), "--out", str(out), "--plan", str(result), "--budget-s", "1"]) == 2
    assert "not even one method epoch fits" in capsys.readouterr().err


def test_a_config_whose_data_holds_no_batch_is_refused_before_training():
    """``fit_config`` (the one way a config trains in one process: local studies, ``bench
    train``'s plain loop): fewer training images than one batch is one line naming both
    counts, before the model is touched."""
    from splitvit.config import ExperimentConfig
    from splitvit.train.local import fit_config

    config = ExperimentConfig.from_dict({"data": {"name": "synthetic", "batch_size": 8}})
    with pytest.raises(ValueError, match=r"^data: 3 training images give no batch of 8$"):
        fit_config(None, list(range(3)), config)  # type: ignore[arg-type]  # never reached
