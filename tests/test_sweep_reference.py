"""A sweep that fine-tunes from a reference, end to end on the local Ray and MLflow.

One sweep, killed and resumed: its reference (full resolution, no recipe) is trained
once by the driver; three searched trials and three fine-tuned baselines (full,
entropy, random) start from its weights; the driver is killed (SIGKILL, as a crash)
while a trial is between epochs, and ``--resume`` finishes the sweep, that trial
continuing its own checkpoint. At the end the frontier and the baselines are
evaluated once on the test split. Models are tiny (16-pixel images, one ViT block).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402

from tests.helpers import run_cli  # noqa: E402

BASE = {
    "recipe": "none",
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
        "image_size": 16,
        "levels": 2,
        "num_classes": 4,
        "thresholds": "auto",
        "policy": {"depth": 1},
    },
    "data": {
        "name": "synthetic",
        # epochs of a few seconds even on a quiet machine: the driver is killed between two
        "options": {"train_samples": 8192, "val_samples": 64, "test_samples": 64, "object_size": 4},
        "batch_size": 16,
    },
    "train": {"epochs": 4, "lr": 0.003, "max_failures": 0, "policy": {"warmup_epochs": 0}},
    "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 0.5}},
    "tracking": {"split_map_images": 0},
}
# a learning rate this small leaves every fine-tuned weight within 1e-4 of where it
# started: the trials' weights show which model they started from
FINE_TUNE_LR = 1.0e-7
STAGE_TWO_SAMPLES = 48


def write_space(folder: Path, mlflow_uri: str) -> Path:
    base = json.loads(json.dumps(BASE))
    base["storage"] = {"path": str(folder / "runs"), "num_to_keep": 5}
    base["tracking"]["tracking_uri"] = mlflow_uri
    (folder / "base.yaml").write_text(yaml.safe_dump(base))
    space = {
        "base": "base.yaml",
        "reference": {"train": {"train.epochs": 2, "train.lr": 0.003}},
        "parameters": {
            "train.budget.weight": {"distribution": "loguniform", "low": 0.5, "high": 4.0},
            "train.budget.target_ratio": {"distribution": "uniform", "low": 0.3, "high": 0.7},
            "train.lr": FINE_TUNE_LR,
            "train.weight_decay": 0.0,
        },
        "search": {
            "num_samples": 3,
            "max_concurrent": 2,
            "sampler": "random",
            "seed": 0,
            "trial_resources": {"CPU": 0.25},
        },
        # fewer images than the data's 64 validation canvases: a trial's own point is measured again on them
        "stage_two": {"points": 2, "sampler": "random", "ratios": [0.5], "samples": STAGE_TWO_SAMPLES},
        "baselines": {"ratios": [0.5]},
        "evaluation": {"split": "test", "samples": 32},
        "speed": {"enabled": False},
        "mlflow": {"experiment": "sweep-reference", "log_models": 1, "split_map_images": 0},
    }
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def _between_epochs(train: Path) -> Path | None:
    """A trial's run folder that has its first epoch's checkpoint but is unfinished,
    begun long enough ago that Tune has saved its state (so a resume keeps its id)."""
    for run in sorted(train.glob("*")) if train.exists() else []:
        first = run / "checkpoint_epoch0000"
        if (first / "model.pt").exists() and not (run / "sweep_trial.json").exists():
            if time.time() - first.stat().st_mtime > 1.5 and not (run / "checkpoint_epoch0003").exists():
                return run
    return None


@pytest.fixture(scope="module")
def sweep(ray_session, mlflow_uri, tmp_path_factory):
    """The sweep, killed between a trial's epochs and resumed (see the module docstring)."""
    import ray

    folder = tmp_path_factory.mktemp("sweep-reference")
    space = write_space(folder, mlflow_uri)
    log_path = folder / "driver.log"
    killed_run = None
    with open(log_path, "w") as log_file:
        driver = subprocess.Popen(
            [sys.executable, "-m", "splitvit.cli", "sweep", str(space), "--name", "ref"]
            + ["--address", ray.get_runtime_context().gcs_address],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=folder,
            start_new_session=True,
            env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"),
        )
        deadline = time.time() + 300
        try:
            while time.time() < deadline and driver.poll() is None and killed_run is None:
                killed_run = _between_epochs(folder / "runs" / "ref" / "train")
                time.sleep(0.2)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert killed_run is not None, log_path.read_text()[-5000:]
    before = {p.relative_to(killed_run): p.stat().st_mtime_ns for p in killed_run.rglob("*") if p.is_file()}
    time.sleep(2)  # the killed driver's actors end
    out = folder / "sweep.json"
    code = run_cli(["sweep", str(space), "--name", "ref", "--resume", "--json", str(out)])
    return {
        "code": code,
        "json": json.loads(out.read_text()),
        "folder": folder,
        "space": space,
        "killed_run": killed_run,
        "before": before,
        "client": MlflowClient(mlflow_uri),
        "uri": mlflow_uri,
    }


def _backbone(checkpoint: str) -> dict:
    from splitvit.train.checkpoints import load_payload

    state = load_payload(checkpoint)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("vit.blocks.")}


def test_trials_and_baselines_start_from_the_reference(sweep):
    """Every trial and fine-tuned baseline ends within 1e-4 of the reference's block
    weights (it fine-tuned from them at a tiny learning rate), while a fresh model of
    the same shape is far from them."""

    from splitvit.train.experiment import build_model, load_experiment

    data = sweep["json"]
    assert sweep["code"] == 0 and data["resumed"]
    reference = data["reference"]
    # trained by the killed driver, found by the resumed one (a later sweep would reuse it too)
    assert reference["source"].startswith("trained ") and reference["epochs"] == 2
    ref = _backbone(reference["checkpoint"])
    trials = data["trials"]
    assert sorted(t["baseline"] for t in trials) == ["", "", "", "entropy", "full", "random"]
    assert all(t["status"] == "completed" for t in trials)
    for trial in trials:
        weights = _backbone(trial["checkpoint"])
        assert weights.keys() == ref.keys()
        assert max((weights[k] - ref[k]).abs().max().item() for k in ref) < 1e-4, trial
    config = load_experiment(sweep["folder"] / "base.yaml")
    fresh = {k: v for k, v in build_model(config.model, pretrained=False).state_dict().items() if k in ref}
    assert max((fresh[k] - ref[k]).abs().max().item() for k in ref) > 1e-2


def test_a_resumed_trial_continues_its_own_checkpoint(sweep):
    """The trial killed between epochs kept its first epoch's checkpoint untouched and
    trained the rest: every epoch once in its history, none trained twice."""
    from splitvit.train.checkpoints import read_history

    run, before = sweep["killed_run"], sweep["before"]
    data = sweep["json"]
    trial = next(t for t in data["trials"] if t["trial_id"] == run.name)
    assert trial["status"] == "completed" and trial["checkpoint"].endswith("checkpoint_epoch0003")
    first = {p: m for p, m in before.items() if p.parts[0] == "checkpoint_epoch0000"}
    assert first and all((run / p).stat().st_mtime_ns == m for p, m in first.items())
    assert [h["epoch"] for h in read_history(trial["checkpoint"])] == [0, 1, 2, 3]


def test_the_frontier_and_baselines_are_evaluated_on_the_test_split(sweep):
    """Test-split figures beside the validation ones: in the JSON (frontier points and
    baselines), on each frontier point's MLflow run, and in the frontier table."""
    data, client = sweep["json"], sweep["client"]
    assert data["held_out_split"] == "test"
    front = data["frontier"]
    assert front and all({"test_accuracy", "test_token_ratio"} <= set(p["extras"]) for p in front)
    assert all(0.0 <= p["extras"]["test_accuracy"] <= 1.0 for p in front)
    baselines = {b["baseline"] for b in data["baselines"]}
    assert baselines == {"full", "entropy", "random"}
    assert all("test_accuracy" in b for b in data["baselines"])
    full = next(b for b in data["baselines"] if b["baseline"] == "full")
    assert full["test_token_ratio"] == pytest.approx(1.0)
    for point in front:
        metrics = client.get_run(point["run_id"]).data.metrics
        assert metrics["test_accuracy"] == pytest.approx(point["extras"]["test_accuracy"])
    table = (Path(data["frontier_csv"])).read_text().splitlines()[0]
    assert "test_accuracy" in table and "test_token_ratio" in table
    # the parent's description: the best point's and the baselines' held-out figures
    note = client.get_run(data["mlflow"]["parent_run_id"]).data.tags["mlflow.note.content"]
    assert "on the held-out split: accuracy" in note and "| test accuracy | test ratio |" in note
    # stage two calibrated every searched trial to the ratio asked for (stage_two.ratios)
    searched = {t["trial_id"] for t in data["trials"] if not t["baseline"]}
    calibrated = [p for p in data["points"] if (p.get("extras") or {}).get("target_ratio") == 0.5]
    assert searched and {p["trial_id"] for p in calibrated} == searched
    # baseline trials are never frontier points (Optuna never heard of them either)
    baseline_ids = {t["trial_id"] for t in data["trials"] if t["baseline"]}
    assert not baseline_ids & {p["trial_id"] for p in data["points"]}


def test_a_trials_own_point_is_measured_on_stage_two_images(sweep):
    """With ``stage_two.samples`` (48) below the data's validation count (64), each
    searched trial's own point carries its checkpoint's figures on stage two's 48
    images, like its stage-two points, not its training's last validation on 64: the
    frontier is chosen among figures of one image count."""
    from splitvit.train.evaluation import CheckpointEvaluator

    own = [p for p in sweep["json"]["points"] if p["kind"] == "trial"]
    assert len(own) == 3
    moved = 0
    for point in own:
        stage_two = CheckpointEvaluator(point["checkpoint"], samples=STAGE_TWO_SAMPLES, cache=False)
        figure = stage_two.evaluate(point["thresholds"])
        assert point["accuracy"] == pytest.approx(figure.quality)
        assert point["tokens_per_image"] == pytest.approx(figure.tokens_per_image)
        training = CheckpointEvaluator(point["checkpoint"], samples=64, cache=False).evaluate(point["thresholds"])
        moved += (training.quality, training.tokens_per_image) != pytest.approx(
            (figure.quality, figure.tokens_per_image)
        )
    assert moved  # the 64-image figures differ: the check above can tell the two apart
    # each point says what it was measured on, and the sweep's count is read from them
    assert {p["extras"]["images"] for p in sweep["json"]["points"]} == {STAGE_TWO_SAMPLES}
    assert sweep["json"]["validation_images"] == STAGE_TWO_SAMPLES


def test_the_parent_run_links_its_reference_and_a_later_sweep_reuses_it(sweep):
    """The reference is an MLflow run of its own in the sweep's experiment, linked from
    the parent (tag and description); a later sweep with the same reference settings
    finds it without training."""
    from splitvit.tune.reference import locate_reference
    from splitvit.tune.space import load_space

    data, client = sweep["json"], sweep["client"]
    parent = client.get_run(data["mlflow"]["parent_run_id"])
    ref_run_id = parent.data.tags["splitvit.reference_run"]
    assert ref_run_id == data["reference"]["run_id"]
    ref_run = client.get_run(ref_run_id)
    assert ref_run.info.status == "FINISHED" and ref_run.info.experiment_id == parent.info.experiment_id
    assert ref_run.data.params["model.policy.kind"] == "full"
    assert f"runs/{ref_run_id}" in parent.data.tags["mlflow.note.content"]
    assert parent.data.tags["splitvit.reference_checkpoint"] == data["reference"]["checkpoint"]
    baseline_runs = [
        r
        for r in client.search_runs([parent.info.experiment_id], max_results=100)
        if r.data.tags.get("splitvit.baseline")
    ]
    assert sorted(r.data.tags["splitvit.baseline"] for r in baseline_runs) == ["entropy", "full", "random"]

    space = load_space(sweep["space"])
    again = locate_reference(space, space.config(), sweep["uri"])
    assert again is not None and again.source.startswith("trained earlier")
    assert again.checkpoint == data["reference"]["checkpoint"] and again.run_id == ref_run_id


def test_the_best_registered_model_evaluates_on_the_test_split_to_the_recorded_figure(sweep, tmp_path):
    """``splitvit eval models:/<space>@best --split test`` loads the frontier's best model
    at its thresholds and measures the test figure the sweep recorded for that point."""
    data = sweep["json"]
    best = max(data["frontier"], key=lambda p: p["hv_contribution"])
    out = tmp_path / "eval.json"
    code = run_cli(
        ["eval", "models:/splitvit-space@best", "--split", "test", "--samples", "32"]
        + ["--tracking-uri", sweep["uri"], "--json", str(out)]
    )
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["split"] == "test"
    assert figures["accuracy"] == pytest.approx(best["extras"]["test_accuracy"])
    assert figures["token_ratio"] == pytest.approx(best["extras"]["test_token_ratio"])


def test_a_later_sweep_reuses_the_fine_tuned_baselines(sweep):
    """The finished sweep kept its baselines under the storage path; a later sweep over
    the same space (one searched trial) trains none: it takes the first sweep's, with
    their figures, records them as baseline runs saying where they came from, and
    evaluates them on the test split. (Last in the file: it adds runs to the experiment.)"""
    folder, first, client = sweep["folder"], sweep["json"], sweep["client"]
    kept = sorted(p.name.split("-")[0] for p in (folder / "runs" / "baselines").glob("*.json"))
    assert kept == ["entropy", "full", "random"]

    out = folder / "again.json"
    args = ["sweep", str(sweep["space"]), "--name", "again", "--set", "search.num_samples=1", "--json", str(out)]
    assert run_cli(args) == 0
    again = json.loads(out.read_text())
    baselines = {t["baseline"]: t for t in again["trials"] if t["baseline"]}
    first_ids = {t["baseline"]: t["trial_id"] for t in first["trials"] if t["baseline"]}
    assert {p: t["trial_id"] for p, t in baselines.items()} == first_ids
    assert all(t["reused_from"] == f"sweep ref, trial {t['trial_id']}" for t in baselines.values())
    # Tune ran the searched trial alone
    searched = [t["trial_id"] for t in again["trials"] if not t["baseline"]]
    assert len(searched) == 1
    assert sorted(p.name for p in (folder / "runs" / "again" / "train").iterdir() if p.is_dir()) == searched

    def figures(data: dict) -> list[tuple]:
        return sorted((b["baseline"], b["label"], b["accuracy"], b["tokens_per_image"]) for b in data["baselines"])

    assert figures(again) == figures(first)
    assert all("test_accuracy" in b for b in again["baselines"])
    parent = again["mlflow"]["parent_run_id"]
    runs = client.search_runs(
        [client.get_run(parent).info.experiment_id], f"tags.`splitvit.sweep` = '{parent}'", max_results=100
    )
    tagged = {
        r.data.tags["splitvit.baseline"]: r.data.tags.get("splitvit.reused_from")
        for r in runs
        if r.data.tags.get("splitvit.baseline")
    }
    assert tagged == {p: f"sweep ref, trial {i}" for p, i in first_ids.items()}
