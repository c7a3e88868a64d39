"""Multi-objective sweeps end to end: real Ray Tune + Optuna + Ray Train, real MLflow.

One sweep serves the frontier, failure and resume tests (one sweep, because each
trial costs Ray several process starts): five tiny trials — three good, one that
diverges, one that raises — whose driver process is killed (SIGKILL) after its
first completed trial and then resumed. Models are tiny (16-pixel images, one ViT
block, one epoch of 64 images).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402

from splitvit.cli import main  # noqa: E402
from splitvit.tune import SweepError, dominates, hypervolume, run_sweep  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

# 16x16 images, 4-pixel base patches, two levels: 4 coarse or 16 fine tokens (the library's
# plain settings: the recipes' level context needs three levels)
BASE = {
    "recipe": "none",
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
        "image_size": 16,
        "levels": 2,
        "num_classes": 4,
        "policy": {"depth": 1},
    },
    "data": {
        "name": "synthetic",
        "options": {"train_samples": 64, "val_samples": 32, "object_size": 4},
        "batch_size": 16,
    },
    # one epoch of random-split warm-up: a learning rate of 1e30 then gives a non-finite
    # loss (the diverged path; in the policy phase NaN split probabilities end the same way)
    "train": {"epochs": 1, "lr": 0.002, "max_failures": 0, "policy": {"warmup_epochs": 1}},
    # half a logical CPU per worker and a quarter per trial driver: the session's 4
    # logical CPUs run all five trials of a sweep at once (they mostly start processes)
    "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 0.5}},
    "tracking": {"split_map_images": 0},
}
GOOD = [
    {"train.budget.weight": 1.0, "model.thresholds[0]": 0.4, "train.lr": 0.002, "data.options.object_size": 4},
    {"train.budget.weight": 2.0, "model.thresholds[0]": 0.5, "train.lr": 0.003, "data.options.object_size": 4},
    {"train.budget.weight": 3.0, "model.thresholds[0]": 0.6, "train.lr": 0.001, "data.options.object_size": 4},
]
DIVERGES = {"train.budget.weight": 1.0, "model.thresholds[0]": 0.5, "train.lr": 1.0e30, "data.options.object_size": 4}
RAISES = {"train.budget.weight": 1.0, "model.thresholds[0]": 0.5, "train.lr": 0.0025, "data.options.object_size": 64}


def write_space(folder: Path, mlflow_uri: str, experiment: str, points: list[dict], concurrent: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = json.loads(json.dumps(BASE))
    base["storage"] = {"path": str(folder / "runs")}
    base["tracking"]["tracking_uri"] = mlflow_uri
    (folder / "base.yaml").write_text(yaml.safe_dump(base))
    space = {
        "base": "base.yaml",
        "parameters": {
            "train.budget.weight": {"distribution": "loguniform", "low": 0.5, "high": 4.0},
            "model.thresholds[0]": {"distribution": "uniform", "low": 0.3, "high": 0.7},
            # the top of this range diverges, and a 64-pixel object does not fit a
            # 16-pixel image: both are here to make trials fail on purpose
            "train.lr": {"distribution": "loguniform", "low": 1.0e-3, "high": 1.0e31},
            "data.options.object_size": {"distribution": "categorical", "choices": [4, 64]},
        },
        "search": {
            "num_samples": len(points),
            "max_concurrent": concurrent,
            "sampler": "tpe",
            "seed": 0,
            "trial_resources": {"CPU": 0.25},
            "initial_points": points,
        },
        "stage_two": {"points": 2, "sampler": "random"},
        "baselines": {"entropy_thresholds": [0.5], "random_budgets": 1},
        "mlflow": {"experiment": experiment, "log_models": 1, "split_map_images": 4},
    }
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def runs_of(client: MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000) if exp else []


def wait_for_dead_driver_actors(timeout: float = 60.0) -> None:
    """Wait until Ray has ended the actors of drivers other than this one (a killed
    driver's trials, Train controllers and workers); detached actors stay."""
    import ray
    from ray._private import state

    ours = ray.get_runtime_context().get_job_id()
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [
            a for a in state.actors(actor_state_name="ALIVE").values() if not a["IsDetached"] and a["JobID"] != ours
        ]
        if not alive:
            return
        time.sleep(0.5)
    raise AssertionError(f"actors of the killed driver still alive: {[a['ActorClassName'] for a in alive]}")


@pytest.fixture(scope="module")
def sweep(ray_session, mlflow_uri, tmp_path_factory):
    """One sweep of five trials (three good, one that diverges, one that raises), two
    at a time, killed and resumed like a crashed driver would be:

    1. ``splitvit sweep`` starts in a driver process of its own (joining the session's
       Ray) and is killed with SIGKILL as soon as MLflow records a completed trial;
    2. ``splitvit sweep --resume`` finishes it in this process.
    """
    import ray

    folder = tmp_path_factory.mktemp("sweep")
    space = write_space(folder, mlflow_uri, "sweep-e2e", [GOOD[0], DIVERGES, GOOD[1], RAISES, GOOD[2]], concurrent=2)
    client = MlflowClient(mlflow_uri)
    started = time.time()
    log_path = folder / "driver.log"
    with open(log_path, "w") as log_file:
        driver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitvit.cli",
                "sweep",
                str(space),
                "--name",
                "e2e",
                "--address",
                ray.get_runtime_context().gcs_address,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=folder,
            start_new_session=True,
            env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"),
        )
        first = None
        deadline = time.time() + 300
        try:
            while time.time() < deadline and driver.poll() is None:
                try:
                    done = [
                        r
                        for r in runs_of(client, "sweep-e2e")
                        if r.data.tags.get("splitvit.kind") == "trial"
                        and r.data.tags.get("splitvit.status") == "completed"
                    ]
                except Exception:  # noqa: BLE001 - the driver may hold the SQLite lock for a moment
                    done = []
                if done:
                    first = done[0]
                    break
                time.sleep(0.5)
        finally:
            os.killpg(driver.pid, signal.SIGKILL)  # the driver and anything it started, as a crash would
            driver.wait()
    assert first is not None, log_path.read_text()[-5000:]
    console = log_path.read_text()
    wait_for_dead_driver_actors()
    killed = {
        "first": first,
        "runs": runs_of(client, "sweep-e2e"),
        "folder": folder / "runs" / "e2e" / "train" / first.data.tags["splitvit.trial_id"],
    }
    killed["files"] = {
        p.relative_to(killed["folder"]): p.stat().st_mtime_ns for p in killed["folder"].rglob("*") if p.is_file()
    }

    out = folder / "sweep.json"
    code = run_cli(["sweep", str(space), "--name", "e2e", "--resume", "--json", str(out)])
    return {
        "code": code,
        "json": json.loads(out.read_text()),
        "client": client,
        "folder": folder,
        "seconds": time.time() - started,
        "uri": mlflow_uri,
        "killed": killed,
        "console": console,
    }


def test_sweep_console_is_one_line_per_trial_event_without_rays_boxes(sweep):
    """The first driver's console: the project's lines per trial (started, each epoch,
    finished with its objectives), and none of Ray Tune's own: no configuration box,
    no status table, no TensorBoard hint."""
    console = sweep["console"]
    assert "tensorboard" not in console.lower()
    assert "Configuration for experiment" not in console and "Trial status" not in console
    assert "╭" not in console and "+-----" not in console  # Ray's boxes and tables
    assert re.search(r"trial \S+ started: ", console)
    assert re.search(r"trial \S+ epoch \d+: accuracy [0-9.]+, [0-9.]+ tokens/image", console)
    assert re.search(r"trial \S+ finished \(\d+/5\): accuracy [0-9.]+ at [0-9.]+ tokens/image", console)


def test_sweep_records_trials_points_and_frontier_in_mlflow(sweep, tmp_path):
    from splitvit.tracking.provenance import source_name

    data, client = sweep["json"], sweep["client"]
    assert sweep["code"] == 0
    runs = runs_of(client, "sweep-e2e")
    parents = [r for r in runs if r.data.tags.get("splitvit.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert data["mlflow"]["parent_run_id"] == parent.info.run_id
    assert data["mlflow"]["experiment_id"] == parent.info.experiment_id

    # one child per trial, linked to the parent; three completed with two threshold points each
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 5 and all(r.data.tags["splitvit.kind"] == "trial" for r in children)
    completed = [r for r in children if r.data.tags["splitvit.status"] == "completed"]
    assert len(completed) == 3
    for trial_run in completed:
        assert trial_run.info.status == "FINISHED"
        assert trial_run.data.params["sampled.train.budget.weight"] in {"1.0", "2.0", "3.0"}
        assert trial_run.data.params["train.epochs"] == "1"  # the whole trial config as params
        assert "tracking.enabled" not in trial_run.data.params  # the sweep tracks it: no "False" to mislead
        assert {"accuracy", "tokens_per_image", "token_ratio", "epoch"} <= set(trial_run.data.metrics)
        points = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == trial_run.info.run_id]
        assert len(points) == 2
        for point in points:
            assert point.data.tags["splitvit.kind"] == "threshold_point" and point.info.status == "FINISHED"
            assert {"accuracy", "tokens_per_image"} <= set(point.data.metrics)
            assert 0.0 <= float(point.data.params["threshold_level_0"]) <= 1.0
        # MLflow's own records: the trial's data as dataset inputs (trials train with tracking
        # off: the sweep logs them), the command in the Source column, no empty tag
        for run in [trial_run, *points]:
            assert {d.dataset.name for d in client.get_run(run.info.run_id).inputs.dataset_inputs} == {
                "synthetic/train",
                "synthetic/val",
            }
            # the driver made it (splitvit sweep), or the resume this test ran in-process
            assert run.data.tags["mlflow.source.name"] in ("splitvit sweep", source_name()), run.data.tags
            assert all(v != "" for v in run.data.tags.values()), run.data.tags
    assert len(data["points"]) == 3 * (1 + 2)
    # every point's configuration: the base config plus its searched values
    assert data["base_config"]["train.epochs"] == 1 and data["base_config"]["tracking.experiment"]
    assert all(
        set(p["params"]) == {"train.budget.weight", "model.thresholds[0]", "train.lr", "data.options.object_size"}
        for p in data["points"]
    )

    # the frontier, read back from the parent, is non-dominated and dominates the rest;
    # its table is rounded for people (the JSON is not)
    frontier_file = client.download_artifacts(parent.info.run_id, "frontier.json", str(tmp_path))
    table = json.loads(Path(frontier_file).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert rows and len(rows) == len(data["frontier"])
    for row, point in zip(rows, data["frontier"]):
        assert row["run_id"] == point["run_id"]
        assert row["tokens_per_image"] == round(point["tokens_per_image"], 1)
        assert row["accuracy"] == float(f"{point['accuracy']:.4g}")
        assert row["token_ratio"] == float(f"{point['token_ratio']:.4g}")
    pairs = [(p["accuracy"], p["tokens_per_image"]) for p in data["frontier"]]
    for a, b in itertools.permutations(pairs, 2):
        assert not dominates(a, b)
    point_runs = [
        r
        for r in runs
        if r.data.tags.get("splitvit.kind") in ("trial", "threshold_point")
        and r.data.tags.get("splitvit.status") == "completed"
    ]
    assert len(point_runs) == 9
    frontier_ids = {r["run_id"] for r in rows}
    for run in point_runs:
        value = (run.data.metrics["accuracy"], run.data.metrics["tokens_per_image"])
        if run.info.run_id not in frontier_ids:
            assert any(dominates(p, value) or p == value for p in pairs), value
    assert all(r["run_id"] in {p.info.run_id for p in point_runs} for r in rows)
    csv_file = client.download_artifacts(parent.info.run_id, "frontier.csv", str(tmp_path))
    assert len(Path(csv_file).read_text().strip().splitlines()) == len(rows) + 1

    # the hypervolume metric is the table's, against the documented reference point (0, 1)
    hv = parent.data.metrics["hypervolume"]
    assert hv == pytest.approx(data["hypervolume"])
    assert hv == pytest.approx(hypervolume([(p["accuracy"], p["token_ratio"]) for p in data["frontier"]], (0.0, 1.0)))
    assert hv > 0

    # the plot, the best point's split maps, the frontier's logged models
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"pareto.png", "frontier.json", "frontier.csv", "points.csv", "baselines.json", "sweep.json"} <= artifacts
    png = Path(client.download_artifacts(parent.info.run_id, "pareto.png", str(tmp_path))).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "split_maps")] == ["split_maps/best_point.png"]
    logged = [r["model_uri"] for r in rows if r.get("model_uri")]
    assert len(logged) == 1  # mlflow.log_models: 1, the largest hypervolume contribution
    best_run = parent.data.tags["splitvit.best_run"]
    for uri in logged:
        model = client.get_logged_model(uri.split("/", 1)[1])
        assert model.source_run_id in frontier_ids
        # named by its point: the best one, its trial and its token ratio in percent
        best = next(p for p in data["frontier"] if p["run_id"] == best_run)
        assert model.source_run_id == best_run
        assert model.name == f"best-{best['trial_id']}-tr{best['token_ratio'] * 100:.0f}pct"

    # the frontier the MLflow way: point runs say whether they are on it (a search the
    # UI runs), are named by their budget, and the logged models are registered with
    # an alias per budget, `best` on the best point
    on_front = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.splitvit.sweep = '{parent.info.run_id}' and tags.splitvit.frontier = 'true'",
    )
    assert {r.info.run_id for r in on_front} == frontier_ids
    assert all(r.data.tags["splitvit.frontier"] == "false" for r in point_runs if r.info.run_id not in frontier_ids)
    for run in on_front:
        assert run.info.run_name.startswith(f"{run.data.metrics['token_ratio'] * 100:.0f}% tokens · "), (
            run.info.run_name
        )
    registered = data["registered_models"]
    assert registered["name"] == "splitvit-space"  # one name per search space (space.yaml), every sweep of it
    assert set(registered["aliases"]) == {"best", f"tokens-{best['token_ratio'] * 100:.0f}pct"}
    version = client.get_model_version_by_alias(registered["name"], "best")
    # the version is the best point's logged model (a SQL store reads it back by its source, not model_id)
    assert version.run_id == best_run and logged[0].split("/", 1)[1] in (version.model_id or version.source)
    assert registered["aliases"]["best"] == f"models:/{registered['name']}@best"
    assert set(registered["sweep_aliases"]) == {f"e2e-{a}" for a in registered["aliases"]}
    # registered as MLflow registers: the logged model's page names its version; a signature
    model = client.get_logged_model(logged[0].split("/", 1)[1])
    linked = json.loads(model.tags["mlflow.modelVersions"])
    assert linked == [{"name": registered["name"], "version": int(version.version)}]
    from mlflow.models import get_model_info

    signature = get_model_info(logged[0]).signature
    assert signature.inputs.input_names() == ["images"] and "logits" in signature.outputs.input_names()
    # a budget is loaded by its alias: `splitvit eval models:/...@best` evaluates the best
    # point's checkpoint at the thresholds its model was registered with
    out = tmp_path / "eval.json"
    argv = ["eval", registered["aliases"]["best"], "--tracking-uri", client.tracking_uri, "--samples", "64"]
    assert main([*argv, "--json", str(out)]) == 0
    evaluated = json.loads(out.read_text())
    assert evaluated["thresholds"] == pytest.approx(best["thresholds"])
    assert evaluated["checkpoint"] == best["checkpoint"]
    missing = main(["eval", f"models:/{registered['name']}@tokens-0pct", "--tracking-uri", client.tracking_uri])
    assert missing == 2
    # the experiment explains itself: opened on its runs (not MLflow 3's traces), its
    # description names the latest sweep and how to filter to the frontier
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment.tags["splitvit.latest_sweep_run"] == parent.info.run_id
    assert experiment.tags["splitvit.registered_model"] == registered["name"]
    description = experiment.tags["mlflow.note.content"]
    assert data["name"] in description and "tags.`splitvit.frontier` = 'true'" in description
    # the frontier one click away: the link opens a saved view of the frontier's point runs
    assert data["mlflow"]["frontier_url"].endswith(f"viewStateShareKey=splitvit-frontier-{parent.info.run_id}")
    view = json.loads(experiment.tags[f"mlflow.sharedViewState.splitvit-frontier-{parent.info.run_id}"])
    listed = client.search_runs([parent.info.experiment_id], filter_string=view["searchFilter"])
    assert {r.info.run_id for r in listed} == frontier_ids
    assert f"models:/{registered['name']}@" in description
    # the interactive chart: one hover title per point, the best point's alias in its title
    chart = Path(client.download_artifacts(parent.info.run_id, "pareto.html", str(tmp_path))).read_text()
    marks = re.findall(r"class='point'[^>]*><title>", chart)
    assert len(marks) == len([p for p in data["points"] if math.isfinite(p["accuracy"])])
    assert f"load: models:/{registered['name']}@best (also @tokens-" in chart

    # the parent reads at a glance: a handful of params, the space as one YAML file,
    # a markdown description with the hypervolume, the best point and the links
    assert len(parent.data.params) <= 8, sorted(parent.data.params)
    assert parent.data.params["space_file"].endswith("/space.yaml") and parent.data.params["metric"] == "accuracy"
    assert parent.data.params["base_config"].endswith("/base.yaml"), parent.data.params  # not both one file name
    assert not any(k.startswith(("parameters.", "fixed.", "search.")) for k in parent.data.params)
    assert "search_space.yaml" in artifacts
    stored = yaml.safe_load(
        Path(client.download_artifacts(parent.info.run_id, "search_space.yaml", str(tmp_path))).read_text()
    )
    assert set(stored["parameters"]) >= {"train.budget.weight", "model.thresholds[0]", "train.lr"}
    assert stored["search"]["num_samples"] == 5
    # the base point's config, each key with its layer: this space's base file says recipe: none
    layers = json.loads(
        Path(client.download_artifacts(parent.info.run_id, "config_layers.json", str(tmp_path))).read_text()
    )
    assert layers["recipe"] == "none" and layers["keys"]["model.levels"]["layer"].endswith("/base.yaml")
    trial_run = next(r for r in runs if r.data.tags.get("splitvit.kind") == "trial")
    trial_layers = json.loads(
        Path(client.download_artifacts(trial_run.info.run_id, "config_layers.json", str(tmp_path))).read_text()
    )
    assert trial_layers["keys"]["train.budget.weight"]["layer"] == "sampled"
    note = parent.data.tags["mlflow.note.content"]
    assert f"Hypervolume {hv:.4g}" in note and f"`{best['trial_id']}`" in note
    assert f"runs/{parent.info.run_id}/artifacts/pareto.png" in note and logged[0] in note
    assert "Trials: 5 (" in note and "random @" in note

    # MLflow's chart view scatters points without set-up: every point run has both figures
    for run in point_runs:
        assert {"accuracy", "tokens_per_image"} <= set(run.data.metrics)

    # baselines on the same axes: full resolution, entropy, random at a frontier budget
    kinds = sorted(b["baseline"] for b in data["baselines"])
    assert kinds == ["entropy", "full", "random"]
    full = next(b for b in data["baselines"] if b["baseline"] == "full")
    assert full["token_ratio"] == pytest.approx(1.0) and full["tokens_per_image"] == pytest.approx(16.0)

    # `splitvit pareto` prints the same frontier from MLflow
    out = tmp_path / "pareto.json"
    assert run_cli(["pareto", "sweep-e2e", "--tracking-uri", sweep["uri"], "--json", str(out)]) == 0
    again = json.loads(out.read_text())
    assert {p["run_id"] for p in again["frontier"]} == frontier_ids
    assert again["hypervolume"] == pytest.approx(hv)
    # the one sweep read brings its baselines back, and the library draws the lot
    from splitvit.tune import frontier_from_mlflow
    from splitvit.tune.plot import save_frontier_plot

    read = frontier_from_mlflow("sweep-e2e", sweep["uri"])
    assert read.sweeps == [parent.info.run_id] and read.sweep_names == {parent.info.run_id: "e2e"}
    assert sorted(b.baseline for b in read.baselines) == ["entropy", "full", "random"]
    # the record is what `splitvit pareto --json` wrote
    assert {p.run_id for p in read.frontier} == frontier_ids and read.hypervolume == pytest.approx(hv)
    drawn = save_frontier_plot(read, tmp_path / "read" / "frontier.png")
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontier_is_timed_against_full_resolution_and_read_back(sweep, tmp_path, capsys):
    """After the frontier is known the sweep times its points against the full-resolution
    model, side by side on one device; the speed-ups land in the JSON, the frontier
    table, each point's run, the parent run and its plot, and `splitvit pareto`
    reads them back. Structure and consistency only: no figure is judged."""
    data, client = sweep["json"], sweep["client"]
    speed = data["frontier_speed"]
    assert speed["device"].startswith("cpu") and speed["batch_size"] == 32 and speed["rounds"] == 5
    assert speed["machine"]["torch_version"] and "interleaved" in speed["method"]
    (full,) = speed["full"]  # one architecture, one full-resolution model: the reference backbone
    assert full["speedup_vs_full"] == 1.0 and full["images_per_s"] > 0
    assert full["tokens_per_image"] == pytest.approx(16.0) and full["token_ratio"] == 1.0
    best = max(data["frontier"], key=lambda p: (round(p["hv_contribution"], 12), p["accuracy"], -p["tokens_per_image"]))
    assert full["checkpoint"] == best["checkpoint"]
    timed = {row["run_id"]: row for row in speed["points"]}
    assert set(timed) == {p["run_id"] for p in data["frontier"]}  # every frontier point (max_points 16)
    for row in speed["points"]:
        assert row["full"] == "full0" and row["images_per_s"] > 0 and row["speedup_vs_full"] > 0
        # the ratio of medians of the same run: the full model's median over the point's
        assert row["speedup_vs_full"] == pytest.approx(full["median_s"] / row["median_s"])
        assert row["images_per_s"] == pytest.approx(32 / row["median_s"])
        q = row["speedup_vs_full_per_round"]
        assert q["q1"] <= q["median"] <= q["q3"]
        assert 0 < row["token_ratio"] <= 1.0 and row["tokens_per_image"] == pytest.approx(16 * row["token_ratio"])
    for point in data["frontier"]:
        assert point["extras"]["speedup_vs_full"] == pytest.approx(timed[point["run_id"]]["speedup_vs_full"])
        assert point["extras"]["timed_token_ratio"] == pytest.approx(timed[point["run_id"]]["token_ratio"])
    off = [p for p in data["points"] if not p["on_frontier"]]
    assert off and not any("speedup_vs_full" in p["extras"] for p in off)

    # MLflow: a metric on every frontier point's run, a column in the frontier table,
    # the figures, the device and the summary metrics on the parent
    parent = client.get_run(data["mlflow"]["parent_run_id"])
    for run_id, row in timed.items():
        metrics = client.get_run(run_id).data.metrics
        assert metrics["speedup_vs_full"] == pytest.approx(row["speedup_vs_full"])
        assert metrics["timed_images_per_s"] == pytest.approx(row["images_per_s"])
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "frontier.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert {r["run_id"]: r["speedup_vs_full"] for r in rows} == pytest.approx(
        {k: r["speedup_vs_full"] for k, r in timed.items()},
        rel=1e-3,  # the table is rounded to 4 digits
    )
    header = (
        Path(client.download_artifacts(parent.info.run_id, "frontier.csv", str(tmp_path))).read_text().splitlines()[0]
    )
    assert "speedup_vs_full" in header.split(",")
    assert parent.data.metrics["speedup_max"] == pytest.approx(max(r["speedup_vs_full"] for r in speed["points"]))
    assert parent.data.metrics["speedup_best_point"] == pytest.approx(timed[best["run_id"]]["speedup_vs_full"])
    assert parent.data.metrics["speed_full_images_per_s"] == pytest.approx(full["images_per_s"])
    assert parent.data.tags["splitvit.speed_device"] == speed["device"]
    assert "batch 32, 5 interleaved rounds" in parent.data.tags["splitvit.speed_timing"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"pareto_speed.png", "frontier_speed.json"} <= artifacts
    png = Path(client.download_artifacts(parent.info.run_id, "pareto_speed.png", str(tmp_path))).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert Path(data["speed_plot"]).is_file()

    # `splitvit pareto` reads the speed-ups back from MLflow and prints them beside the tokens
    out = tmp_path / "pareto.json"
    capsys.readouterr()
    assert run_cli(["pareto", "sweep-e2e", "--tracking-uri", sweep["uri"], "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    again = json.loads(out.read_text())
    assert {p["run_id"]: p["extras"]["speedup_vs_full"] for p in again["frontier"]} == pytest.approx(
        {k: r["speedup_vs_full"] for k, r in timed.items()}
    )
    assert again["speed"][0]["device"] == speed["device"] and again["speed"][0]["sweep"] == parent.info.run_id
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tokens/image"))
    assert (
        lines[head].split()[:4] == ["tokens/image", "accuracy", "token", "ratio"] and "speed-up" in lines[head].split()
    )
    shown = len(again["frontier"])  # exact ties are one frontier point (its `ties` name the others)
    assert shown == len({(p["tokens_per_image"], p["accuracy"]) for p in again["frontier"]})
    printed_speedups = [line.split()[3] for line in lines[head + 1 : head + 1 + shown]]
    assert set(printed_speedups) <= {f"{r['speedup_vs_full']:.2f}x" for r in speed["points"]}
    assert len(printed_speedups) == shown
    assert f"on {speed['device']}" in printed and "not recorded" not in printed


def test_pareto_says_when_a_sweep_recorded_no_speed_ups(tmp_path, capsys):
    """A sweep recorded before frontier timing (points without speed-up metrics):
    `splitvit pareto` prints its frontier and says the speed-up was not recorded."""
    uri = f"sqlite:///{tmp_path}/old.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("old-sweep")
    parent = client.create_run(exp, tags={"splitvit.kind": "sweep", "splitvit.metric": "accuracy"})
    for accuracy, tokens in ((0.8, 8.0), (0.9, 16.0)):
        run = client.create_run(
            exp,
            tags={
                "splitvit.kind": "trial",
                "splitvit.sweep": parent.info.run_id,
                "splitvit.status": "completed",
                "splitvit.trial_id": f"t{tokens:.0f}",
                "splitvit.thresholds": "[0.5]",
            },
        )
        for key, value in (("accuracy", accuracy), ("tokens_per_image", tokens), ("token_ratio", tokens / 16)):
            client.log_metric(run.info.run_id, key, value)
    from splitvit.tune.pareto import Baseline

    full = Baseline("full", "full resolution", 0.91, 16.0, 1.0, [0.0], "t16")
    client.log_dict(parent.info.run_id, [full.to_dict("accuracy")], "baselines.json")
    out = tmp_path / "pareto.json"
    assert run_cli(["pareto", "old-sweep", "--tracking-uri", uri, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "speed-up: not recorded" in printed
    # the sweep's baselines come back without MLflow's download bar in the printout
    assert json.loads(out.read_text())["baselines"] == [full.to_dict("accuracy")]
    assert "Downloading artifacts" not in captured.err + printed
    head = next(line for line in printed.splitlines() if line.startswith("tokens/image"))
    assert "speed-up" not in head
    data = json.loads(out.read_text())
    assert len(data["frontier"]) == 2 and data["speed"] == []
    assert all("speedup_vs_full" not in p["extras"] for p in data["frontier"])


def test_failing_trials_are_recorded_and_the_sweep_goes_on(sweep):
    data, client = sweep["json"], sweep["client"]
    statuses = {t["params"]["train.lr"]: t["status"] for t in data["trials"]}
    assert sorted(statuses.values()) == ["completed", "completed", "completed", "diverged", "failed"]
    assert statuses[1.0e30] == "diverged"  # a non-finite loss
    failed = next(t for t in data["trials"] if t["params"]["data.options.object_size"] == 64)
    assert failed["status"] == "failed" and "object_size 64 exceeds image_size 16" in failed["error"]

    runs = {
        r.data.tags.get("splitvit.trial_id"): r
        for r in runs_of(client, "sweep-e2e")
        if r.data.tags.get("splitvit.kind") == "trial"
    }
    bad = [t for t in data["trials"] if t["status"] != "completed"]
    for trial in bad:
        run = runs[trial["trial_id"]]
        assert run.info.status == "FAILED" and run.data.tags["splitvit.status"] == trial["status"]
        assert run.data.tags["splitvit.error"]
    # no point of a failed trial anywhere: not in the points, not on the frontier
    bad_ids = {t["trial_id"] for t in bad}
    assert not bad_ids & {p["trial_id"] for p in data["points"]}
    assert not bad_ids & {p["trial_id"] for p in data["frontier"]}
    assert data["status"] == "ok" and data["sweep_status"] == "completed" and data["error"] is None
    assert data["mlflow"]["run_id"] == data["mlflow"]["parent_run_id"]


def test_resume_after_the_driver_is_killed(sweep):
    """The driver died with trials unfinished; --resume restored the Tuner: the
    finished trial was not trained or evaluated again and no MLflow run is duplicated."""
    killed, data, client = sweep["killed"], sweep["json"], sweep["client"]
    # it really was interrupted: the parent was still running, trials were missing
    parents = [r for r in killed["runs"] if r.data.tags.get("splitvit.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "RUNNING"
    assert sum(r.data.tags.get("splitvit.kind") == "trial" for r in killed["runs"]) < 5
    assert sweep["code"] == 0 and data["resumed"]
    assert len(data["trials"]) == 5 and all(t["status"] != "unfinished" for t in data["trials"])

    # the finished trial's run folder is untouched: no checkpoint, no stage-two result rewritten
    after = {p.relative_to(killed["folder"]): p.stat().st_mtime_ns for p in killed["folder"].rglob("*") if p.is_file()}
    assert after == killed["files"]
    assert Path("sweep_trial.json") in after and any(p.name == "model.pt" for p in after)

    # one parent (the same), one child per trial, two threshold points per completed trial
    runs = runs_of(client, "sweep-e2e")
    parents_now = [r for r in runs if r.data.tags.get("splitvit.kind") == "sweep"]
    assert [r.info.run_id for r in parents_now] == [parents[0].info.run_id]
    assert parents_now[0].info.status == "FINISHED"
    trials = [r for r in runs if r.data.tags.get("splitvit.kind") == "trial"]
    # a trial the killed driver had started but Tune had not saved yet is rerun under a
    # new id; its run is taken over (tag splitvit.adopted_from), not duplicated
    assert sorted(r.data.tags["splitvit.trial_id"] for r in trials) == sorted(t["trial_id"] for t in data["trials"])
    assert not [r for r in trials if r.data.tags["splitvit.status"] == "superseded"]
    assert killed["first"].info.run_id in {r.info.run_id for r in trials}
    points = [r for r in runs if r.data.tags.get("splitvit.kind") == "threshold_point"]
    assert len(points) == 6 and len({r.data.tags["splitvit.run_uri"] for r in points}) == 6
    # the finished trial's epochs were logged once
    history = client.get_metric_history(killed["first"].info.run_id, "epoch")
    assert [m.step for m in history] == [0]


def test_resume_and_restart_guards(ray_session, mlflow_uri, tmp_path):
    """Nothing to resume, or a sweep name already taken: a clear error, no Tune run."""
    space = write_space(tmp_path, mlflow_uri, "sweep-guards", [GOOD[0]], concurrent=1)
    with pytest.raises(SweepError, match="holds no sweep to resume"):
        run_sweep(space, name="nothing", resume=True)
    taken = tmp_path / "runs" / "taken"
    taken.mkdir(parents=True)
    (taken / "tuner.pkl").write_bytes(b"")  # what marks a Tune experiment folder
    with pytest.raises(SweepError, match="already exists: pass --resume"):
        run_sweep(space, name="taken")


def test_a_trial_trains_through_run_training(monkeypatch, tmp_path):
    """A trial is the same fit as ``splitvit train`` (run_training), its epochs
    reported to Tune; Ray Train giving up is the trial's TrialFailed."""
    import ray.tune.integration.ray_train as tune_integration

    import splitvit.train.ray_trainer as ray_trainer
    from splitvit.config import ExperimentConfig
    from splitvit.train.checkpoints import write_history
    from splitvit.train.ray_trainer import TrainingError, TrainResult
    from splitvit.train.trial import TrainedRun, TrialFailed, fit_trial

    calls: list[dict] = []
    checkpoint = tmp_path / "t" / "checkpoint_epoch0000"
    checkpoint.mkdir(parents=True)
    write_history(checkpoint, [{"epoch": 0, "accuracy": 0.5}])

    def fake_run_training(config, **kwargs):
        calls.append({"tracking": config.tracking.enabled, **kwargs})
        if config.train.max_failures == 9:
            raise TrainingError("training t failed: boom") from RuntimeError("boom")
        return TrainResult(
            name="t",
            status="diverged",
            metrics={"accuracy": 0.5},
            checkpoint_uri=str(checkpoint),
            run_uri=str(checkpoint.parent),
            message="non-finite loss",
        )

    class TuneReportCallback:  # the real one wants a Tune session
        pass

    monkeypatch.setattr(tune_integration, "TuneReportCallback", TuneReportCallback)
    monkeypatch.setattr(ray_trainer, "run_training", fake_run_training)
    config = ExperimentConfig.from_dict(BASE, ["tracking.enabled=true"])
    assert fit_trial(config) == TrainedRun(
        status="diverged",
        metrics={"accuracy": 0.5},
        checkpoint=str(checkpoint),
        message="non-finite loss",
        history=[{"epoch": 0, "accuracy": 0.5}],  # the checkpoint's per-epoch figures
    )
    assert [type(c) for c in calls[0]["callbacks"]] == [TuneReportCallback]
    assert calls[0]["tracking"] is False and config.tracking.enabled  # the trial's copy only: MLflow is the driver's
    with pytest.raises(TrialFailed, match="^training failed: boom$"):
        fit_trial(ExperimentConfig.from_dict(BASE, ["train.max_failures=9"]))
