"""The frontier in numbers: its hypervolume against an independent reference (the area
of the union of each point's dominated box), and its figures at their true MLflow steps."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from splitvit.tune import hypervolume

ROOT = Path(__file__).resolve().parents[1]


def union_area(values: list[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Area of the union of the boxes [reference quality, q] x [r, reference ratio]."""
    boxes = [(reference[0], q, r, reference[1]) for q, r in values if q > reference[0] and r < reference[1]]
    xs = sorted({x for b in boxes for x in b[:2]})
    ys = sorted({y for b in boxes for y in b[2:]})
    area = 0.0
    for x0, x1 in zip(xs, xs[1:]):
        for y0, y1 in zip(ys, ys[1:]):
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            if any(b[0] <= cx <= b[1] and b[2] <= cy <= b[3] for b in boxes):
                area += (x1 - x0) * (y1 - y0)
    return area


@pytest.mark.parametrize("seed", range(20))
def test_hypervolume_equals_the_union_of_dominated_boxes(seed):
    rng = random.Random(seed)
    values = [(rng.uniform(-0.1, 1.0), rng.uniform(0.0, 1.2)) for _ in range(rng.randint(1, 12))]
    values += [values[0]]  # a duplicate adds nothing
    reference = (rng.choice([0.0, 0.3]), rng.choice([1.0, 0.8]))
    assert hypervolume(values, reference) == pytest.approx(union_area(values, reference), abs=1e-12)


def test_hypervolume_ignores_points_that_are_not_finite():
    assert hypervolume([(0.9, 0.5), (float("nan"), 0.1), (0.95, float("inf"))]) == pytest.approx(0.45)
    assert hypervolume([]) == 0.0


def test_a_trials_final_figures_sit_at_its_last_epoch(tmp_path):
    """The final images/s belongs to the last epoch's step, not on top of epoch 0's."""
    from mlflow import MlflowClient

    from splitvit.tune.mlflow_records import SweepRecorder
    from splitvit.tune.trial import TrialFinal

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recorder, _ = SweepRecorder.open(uri, "steps", str(tmp_path / "sweep"), "sweep", "accuracy", params={}, tags={})
    run_uri = str(tmp_path / "sweep" / "trial0")
    recorder.trial_started("t0", run_uri, {"train.lr": 0.1}, {})
    for epoch in range(3):
        recorder.trial_epoch("t0", run_uri, {"epoch": epoch, "images_per_s": 100.0 + epoch, "accuracy": 0.5})
    final = {
        "epochs": 3,
        "accuracy": 0.6,
        "tokens_per_image": 10.0,
        "token_ratio": 0.5,
        "images_per_s": 90.0,
        "train_seconds": 4.0,
        "threshold_points": [],
    }
    run_id, _ = recorder.trial_completed(
        "t0", run_uri, {"train.lr": 0.1}, {}, TrialFinal.from_report(final, "accuracy")
    )
    history = MlflowClient(uri).get_metric_history(run_id, "images_per_s")
    assert sorted((m.step, m.value) for m in history) == [(0, 100.0), (1, 101.0), (2, 90.0), (2, 102.0)]
    assert {m.step for m in MlflowClient(uri).get_metric_history(run_id, "train_seconds")} == {2}


def _recorded_sweep(uri: str, root, name: str, points: list[tuple[float, float]]) -> str:
    """A finished sweep in the store at ``uri``: one trial per ``(accuracy, tokens)``
    pair (16 tokens at full resolution); returns the parent run id."""
    from splitvit.tune.mlflow_records import SweepRecorder
    from splitvit.tune.trial import TrialFinal

    recorder, _ = SweepRecorder.open(uri, "sweeps", str(root / name), name, "accuracy", params={}, tags={})
    for i, (accuracy, tokens) in enumerate(points):
        run_uri = str(root / name / f"trial{i}")
        final = {
            "epochs": 1,
            "accuracy": accuracy,
            "tokens_per_image": tokens,
            "token_ratio": tokens / 16,
            "thresholds": [0.5],
            "threshold_points": [],
        }
        recorder.trial_started(f"{name}-t{i}", run_uri, {"train.lr": 0.1}, {})
        recorder.trial_completed(
            f"{name}-t{i}", run_uri, {"train.lr": 0.1}, {}, TrialFinal.from_report(final, "accuracy")
        )
    recorder.close("completed")
    return recorder.parent_run_id


def test_frontier_from_mlflow_reads_the_latest_sweep_unless_asked_for_all(tmp_path):
    import time

    from splitvit.tune import frontier_from_mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = _recorded_sweep(uri, tmp_path, "first", [(0.9, 8.0)])
    time.sleep(0.01)  # start times are in milliseconds: the second sweep is the later one
    second = _recorded_sweep(uri, tmp_path, "second", [(0.7, 4.0), (0.6, 6.0)])

    latest = frontier_from_mlflow("sweeps", uri).to_dict()  # `splitvit pareto --json`
    assert latest["sweeps"] == [second]
    assert latest["sweep_names"] == {second: "second"}
    assert sorted(p["accuracy"] for p in latest["points"]) == [0.6, 0.7]
    assert [p["accuracy"] for p in latest["frontier"]] == [0.7]

    merged = frontier_from_mlflow("sweeps", uri, all_sweeps=True).to_dict()
    assert sorted(merged["sweeps"]) == sorted([first, second])
    assert sorted(p["accuracy"] for p in merged["points"]) == [0.6, 0.7, 0.9]
    assert [p["accuracy"] for p in merged["frontier"]] == [0.7, 0.9]
    assert merged["hypervolume"] > latest["hypervolume"]

    one = frontier_from_mlflow("sweeps", uri, first)
    assert one.sweeps == [first] and [p.quality for p in one.points] == [0.9]
    assert [p.quality for p in one.frontier] == [0.9] and one.baselines == []
    assert latest["speed"] == [] and latest["reference_point"] == {"quality": 0.0, "token_ratio": 1.0}

    # a sweep that timed its frontier says where and how, its figures after the names
    from mlflow import MlflowClient

    from splitvit.tracking.runs import SPEED_DEVICE_TAG, SPEED_TIMING_TAG

    MlflowClient(uri).set_tag(second, SPEED_DEVICE_TAG, "cpu")
    MlflowClient(uri).set_tag(second, SPEED_TIMING_TAG, "batch 32")
    MlflowClient(uri).log_metric(second, "speedup_max", 2.5)
    timed = frontier_from_mlflow("sweeps", uri, all_sweeps=True).to_dict()["speed"]
    assert timed == [{"sweep": second, "device": "cpu", "timing": "batch 32", "speedup_max": 2.5}]
    assert list(timed[0]) == ["sweep", "device", "timing", "speedup_max"]


def test_frontier_from_mlflow_names_a_missing_store_and_creates_none(tmp_path):
    from splitvit.tune import SweepError, frontier_from_mlflow

    db = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(SweepError, match=r"no MLflow store at .*mlflow\.db"):
        frontier_from_mlflow("sweeps", f"sqlite:///{db}")
    assert not db.exists() and not db.parent.exists()
    with pytest.raises(SweepError, match="no MLflow store"):
        frontier_from_mlflow("sweeps", str(tmp_path / "mlruns"))
    assert not (tmp_path / "mlruns").exists()


def test_frontier_from_mlflow_names_a_missing_experiment_or_sweep(tmp_path):
    from splitvit.tune import SweepError, frontier_from_mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _recorded_sweep(uri, tmp_path, "only", [(0.8, 8.0)])
    with pytest.raises(SweepError, match="no MLflow experiment 'elsewhere'"):
        frontier_from_mlflow("elsewhere", uri)
    with pytest.raises(SweepError, match="is not a sweep"):
        frontier_from_mlflow("sweeps", uri, "0" * 32)


def test_the_frontier_plot_keeps_its_legend_off_the_data(tmp_path):
    """The legend sits outside the axes (no marker under it) and inside the image."""
    import matplotlib.pyplot as plt

    from splitvit.tune.pareto import Baseline, Point, annotate
    from splitvit.tune.plot import pareto_figure, save_frontier_plot
    from splitvit.tune.read_back import FrontierReadBack

    points = [Point(q, t, t / 16, "trial", f"t{i}") for i, (q, t) in enumerate([(0.5, 2.0), (0.8, 8.0), (0.9, 15.0)])]
    baselines = [
        Baseline("full", "full resolution", 0.91, 16.0, 1.0, [0.0], "t2"),
        Baseline("random", "random @ 0.50", 0.6, 8.0, 0.5, [0.4], "t2", target_ratio=0.5),
    ]
    hv = annotate(points)
    fig = pareto_figure(points, baselines, hypervolume=hv, full_tokens=16.0)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent())
        assert fig.bbox.contains(legend.x1 - 1, legend.y0 + 1)  # not cut off on the right
    finally:
        plt.close(fig)

    read = FrontierReadBack(
        experiment="sweeps",
        experiment_id="1",
        tracking_uri="sqlite:///mlflow.db",
        sweeps=["abc"],
        sweep_names={"abc": "first"},
        metric="accuracy",
        hypervolume=hv,
        reference_point=(0.0, 1.0),
        points=points,
        baselines=baselines,
        speed=[],
    )
    out = save_frontier_plot(read, tmp_path / "plots" / "frontier.png")
    assert out == tmp_path / "plots" / "frontier.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_description_names_the_hypervolume_best_point_baselines_and_links():
    from splitvit.tune.mlflow_records import sweep_note
    from splitvit.tune.pareto import Baseline, Point, annotate, best_point

    points = [
        Point(0.3, 2.0, 0.125, "trial", "t0", [0.3]),
        Point(0.812345678, 8.123456, 0.5, "threshold", "t1", [0.55555], run_id="r1"),
        Point(0.9, 15.0, 0.9375, "trial", "t2", [0.9]),
        Point(0.4, 9.0, 0.5625, "trial", "t3", [0.5]),  # dominated
    ]
    hv = annotate(points)
    best = best_point(points)
    best.model_uri = "models:/m-123"
    note = sweep_note(
        name="demo",
        metric="accuracy",
        hypervolume=hv,
        reference=(0.0, 1.0),
        points=points,
        best=best,
        baselines=[
            Baseline("full", "full resolution", 0.91, 16.0, 1.0, [0.0], "t1"),
            Baseline("random", "random @ 0.50", 0.6, 8.5, 0.53125, [0.4], "t1", target_ratio=0.5),
        ],
        trial_status={"completed": 3, "failed": 1},
        experiment_id="7",
        parent_run_id="p1",
        best_uris=["models:/splitvit-s@best", "models:/splitvit-s@demo-best"],
    )
    assert "load it as `models:/splitvit-s@best` (also `models:/splitvit-s@demo-best`)" in note
    assert f"Hypervolume {hv:.4g}" in note and "token ratio 1" in note
    assert best.trial_id == "t1" and "Best point" in note and "`t1`" in note and "0.8123" in note
    assert "0.812345678" not in note and "8.123456" not in note  # rounded
    assert "| 8.1 | 0.8123 | 0.5 |" in note  # tokens to one decimal, the rest to four digits
    # every link opens MLflow 3's model-training view (not its GenAI overview)
    view = "?workflowType=machine_learning"
    assert f"(#/experiments/7/runs/p1/artifacts/pareto.png{view})" in note
    assert f"(#/experiments/7/models/m-123{view})" in note and f"(#/experiments/7/runs/r1{view})" in note
    links = re.findall(r"\]\((#/[^)]*)\)", note)
    assert len(links) >= 6 and all("workflowType=machine_learning" in link for link in links), links
    # the frontier one click away: its saved runs view
    assert f"(#/experiments/7/runs{view}&viewStateShareKey=splitvit-frontier-p1)" in note
    assert "Trials: 4 (3 completed, 1 failed)" in note
    # random at 8.5 tokens meets the frontier point at 8.1 tokens (0.8123): 0.2123 better
    assert "| random @ 0.50 | 8.5 | 0.6 | 0.8123 | 0.2123 |" in note
    assert len(note) < 8000
    # the table headed "largest hypervolume contributions" lists them largest first
    heading = note.index("largest hypervolume contributions")
    rows = [line for line in note[heading:].split("###")[0].splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = rows[0].strip("| ").split(" | "), rows[1:]
    column = header.index("HV contribution")
    contributions = [float(r.strip("| ").split(" | ")[column]) for r in rows]
    assert len(contributions) == 3 and contributions == sorted(contributions, reverse=True), contributions
    assert "@best" in rows[0]  # the best point is the largest contribution


def test_the_frontier_view_lists_point_runs_with_their_columns():
    """The saved view the frontier's link opens: the frontier filter, ordered by the
    metric (MLflow then lists the child runs as rows, not under their sweep), its
    figure columns shown; the link carries the model-training view."""
    from splitvit.tune.mlflow_records import frontier_filter, frontier_link, frontier_view

    view = frontier_view("accuracy", "abc")
    assert (
        view["searchFilter"]
        == frontier_filter("abc")
        == ("tags.`splitvit.frontier` = 'true' and tags.`splitvit.sweep` = 'abc'")
    )
    assert view["orderByKey"] == "metrics.`accuracy`" and view["orderByAsc"] is False
    assert {"metrics.`accuracy`", "metrics.`tokens_per_image`", "metrics.`token_ratio`"} <= set(view["selectedColumns"])
    assert view["columnOrder"][:3] == ["metrics.`accuracy`", "metrics.`tokens_per_image`", "metrics.`token_ratio`"]
    link = frontier_link("3", "abc")
    assert link == "#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey=splitvit-frontier-abc"


def test_run_descriptions_tell_apart_figures_of_similar_names():
    from splitvit.tune.mlflow_records import EVAL_THROUGHPUT, point_note

    point = point_note("accuracy", "threshold_point", "t1", [0.4963, 0.5321])
    assert "0.496/0.532" in point and f"`{EVAL_THROUGHPUT}`" in point and "`timed_images_per_s`" in point
    assert "`sampled.model.thresholds.*`" in point and "not the ones evaluated here" in point
    trial = point_note("accuracy", "trial", "t1", [0.5, 0.5], points=6)
    assert "`images_per_s`: validation throughput while training" in trial and "6 more threshold points" in trial


# Rows as stage_two.baselines returns them plus the trial (what sweep.json held as
# plain dicts): a classification row; a random one with its target; a dense one with
# object figures; one written before evaluations counted their images.
BASELINE_ROWS = [
    (
        "accuracy",
        {"baseline": "full", "label": "full resolution", "tokens_per_image": 16.0, "token_ratio": 1.0,
         "images_per_s": 812.5, "images": 64, "accuracy": 0.90625, "thresholds": [0.0, 0.0],
         "quality": 0.90625, "trial_id": "abc_00001"},
    ),
    (
        "accuracy",
        {"baseline": "random", "label": "random @ 0.42", "target_ratio": 0.42, "tokens_per_image": 6.75,
         "token_ratio": 0.421875, "images_per_s": 1200.0, "images": 64, "accuracy": 0.5,
         "thresholds": [0.61, 0.58], "quality": 0.5, "trial_id": "abc_00001"},
    ),
    (
        "miou",
        {"baseline": "entropy", "label": "entropy t=0.5", "tokens_per_image": 9.5, "token_ratio": 0.59375,
         "images_per_s": 300.0, "images": 32, "miou": 0.41, "fine_on_object": 0.7, "object_coverage": 0.95,
         "thresholds": [0.5, 0.5], "quality": 0.41, "trial_id": "seg_00000"},
    ),
    (
        "accuracy",
        {"baseline": "full", "label": "full resolution", "tokens_per_image": 16.0, "token_ratio": 1.0,
         "images_per_s": 99.0, "accuracy": 0.75, "thresholds": [0.0], "quality": 0.75, "trial_id": "old_00000"},
    ),
]  # fmt: skip


@pytest.mark.parametrize("metric, row", BASELINE_ROWS)
def test_a_baseline_writes_the_json_it_was_read_from(metric, row):
    """sweep.json's and baselines.json's baseline rows: the same keys, in the same order,
    with the same values, as the plain dicts they were before they were typed."""
    from splitvit.tune.pareto import Baseline

    baseline = Baseline.from_dict(row)
    assert baseline.quality == row["quality"] and baseline.baseline == row["baseline"]
    assert list(baseline.to_dict(metric).items()) == list(row.items())


def test_frontier_rows_are_the_table_of_the_frontier():
    """The frontier table's rows by tokens per image: the quality under the metric's name,
    thresholds and list parameters as JSON, the speed columns only when a point was timed."""
    from splitvit.tune import frontier_rows
    from splitvit.tune.pareto import Point, annotate

    points = [
        Point(0.5, 2.0, 0.125, "trial", "t0", [0.71234567], {"train.lr": 0.01, "model.levels": [2]}, run_id="r0"),
        Point(0.9, 15.0, 0.9375, "threshold", "t1", [0.2], {"train.lr": 0.02, "model.levels": [3]}, run_id="r1"),
        Point(0.4, 9.0, 0.5625, "trial", "t2", [0.5], {"train.lr": 0.03, "model.levels": [2]}),  # dominated
    ]
    annotate(points)
    rows = [row.to_dict("miou") for row in frontier_rows(points)]
    assert rows == [
        {"rank": 0, "tokens_per_image": 2.0, "miou": 0.5, "token_ratio": 0.125, "kind": "trial", "trial_id": "t0",
         "thresholds": "[0.7123]", "hv_contribution": points[0].hv_contribution, "run_id": "r0", "model_uri": None,
         "train.lr": 0.01, "model.levels": "[2]"},
        {"rank": 1, "tokens_per_image": 15.0, "miou": 0.9, "token_ratio": 0.9375, "kind": "threshold",
         "trial_id": "t1", "thresholds": "[0.2]", "hv_contribution": points[1].hv_contribution, "run_id": "r1",
         "model_uri": None, "train.lr": 0.02, "model.levels": "[3]"},
    ]  # fmt: skip
    points[1].extras.update(speedup_vs_full=1.5, timed_images_per_s=300.0, timed_token_ratio=0.94)
    first, second = (row.to_dict("miou") for row in frontier_rows(points))
    speed = ["speedup_vs_full", "timed_images_per_s", "timed_token_ratio"]
    assert list(second)[10:] == [*speed, "train.lr", "model.levels"]
    assert (second["speedup_vs_full"], second["timed_images_per_s"], second["timed_token_ratio"]) == (1.5, 300.0, 0.94)
    assert (first["speedup_vs_full"], first["timed_images_per_s"], first["timed_token_ratio"]) == (None, None, None)


def test_logged_models_are_named_by_their_point():
    from mlflow.utils.validation import _validate_logged_model_name

    from splitvit.tune.artifacts import model_name
    from splitvit.tune.pareto import Point

    best = Point(0.9, 6.7, 0.4183, "threshold", "abc_00002")
    other = Point(0.7, 2.0, 0.125, "trial", "abc_00001")
    assert model_name(best, best) == "best-abc_00002-tr42pct"
    assert model_name(other, best) == "frontier-abc_00001-tr12pct"
    for name in (model_name(best, best), model_name(other, best)):
        _validate_logged_model_name(name)  # MLflow 3 refuses '.', '/', ':' in a logged model's name


def test_round_figures_rounds_for_people_only():
    from splitvit.tune.pareto import round_figures

    row = {"tokens_per_image": 12.3456, "accuracy": 0.912345, "token_ratio": 0.771604, "rank": 2, "kind": "trial"}
    assert round_figures(row) == {
        "tokens_per_image": 12.3,
        "accuracy": 0.9123,
        "token_ratio": 0.7716,
        "rank": 2,
        "kind": "trial",
    }
    assert row["accuracy"] == 0.912345  # the row itself is left as it was


def test_the_search_space_artifact_loads_back_to_the_same_space():
    from pathlib import Path

    import yaml

    from splitvit.tune.mlflow_records import search_space_yaml, sweep_params
    from splitvit.tune.space import load_space, space_from_dict

    root = Path(__file__).resolve().parents[1] / "search_spaces"
    for name in ("smoke", "classification", "dense"):
        space = load_space(root / f"{name}.yaml", ["search.num_samples=3", "baselines.random_budgets=2"])
        back = space_from_dict(yaml.safe_load(search_space_yaml(space)), source=space.source)
        assert back.to_dict() == space.to_dict()
        assert back.search.num_samples == 3 and back.baselines.random_budgets == 2
        params = sweep_params(space)
        assert len(params) <= 8 and params["space_file"] == f"search_spaces/{name}.yaml" and params["num_samples"] == 3


def test_the_search_space_artifact_keeps_no_password():
    from pathlib import Path

    from splitvit.tune.mlflow_records import search_space_yaml
    from splitvit.tune.space import load_space

    space = load_space(
        Path(__file__).resolve().parents[1] / "search_spaces" / "smoke.yaml",
        ["tracking.tracking_uri=http://alice:hunter2@mlflow:5000"],
    )
    text = search_space_yaml(space)
    assert "hunter2" not in text and "http://alice:***@mlflow:5000" in text


def test_missing_store_reads_sqlite_paths_as_sqlalchemy_does(tmp_path, monkeypatch):
    from splitvit.tracking.runs import missing_store

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mlflow.db").write_bytes(b"")
    assert missing_store("sqlite:///runs/mlflow.db") is None  # three slashes: relative to the folder
    assert missing_store(f"sqlite:///{tmp_path}/runs/mlflow.db") is None  # four: absolute
    assert "other.db does not exist" in missing_store("sqlite:///runs/other.db")
    assert missing_store("sqlite://") is None  # in memory
    assert missing_store("http://mlflow:5000") is None  # a server: only a request can tell
    assert missing_store(str(tmp_path / "runs")) is None  # a file store's folder


def test_the_interactive_chart_shows_every_point_with_its_details():
    from splitvit.tune.pareto import Baseline, Point, annotate
    from splitvit.tune.plot import pareto_html

    own = Point(0.8, 4.0, 0.25, kind="trial", trial_id="a", run_id="r1", thresholds=[0.5, 0.5])
    tie = Point(0.8, 4.0, 0.25, kind="threshold", trial_id="b", run_id="r4", thresholds=[0.7, 0.6])
    points = [own, Point(0.9, 8.0, 0.5, kind="threshold", trial_id="a", run_id="r2"), Point(0.5, 10.0, 0.6), tie]
    annotate(points)
    full = Baseline("full", "full resolution", 1.0, 16.0, 1.0, [], "a")
    page = pareto_html(points, [full], metric="accuracy", title="s", model_uris={"r1": "models:/m@tokens-25pct"})
    assert len(re.findall(r"class='point'[^>]*><title>", page)) == 4  # every point, with its hover text
    assert page.count("<path") == 1  # one step line
    assert "load: models:/m@tokens-25pct" in page and f"ties: {tie.label()}" in page
    assert "full resolution: accuracy 1.0000 at 16.0 tokens" in page
    assert "<script" not in page  # MLflow's artifact view shows it as it is
    assert "No finished point" in pareto_html([Point(float("nan"), 1.0, 0.1)], [], title="empty")


def _chart_points():
    """A frontier whose best point sits at accuracy 1.0, beside baselines at the same
    budgets (labels that would collide), with odd figures (ticks must still be round)."""
    from splitvit.tune.pareto import Baseline, Point, annotate

    points = [
        Point(0.2653, 4.27, 0.0667, "threshold", "a", [0.8, 0.8], run_id="r0"),
        Point(0.7312, 10.1, 0.158, "trial", "a", [0.6, 0.5], run_id="r1"),
        Point(1.0, 23.7, 0.37, "threshold", "b", [0.5, 0.4], run_id="r2"),
        Point(1.0, 45.5, 0.711, "threshold", "b", [0.4, 0.3], run_id="r3"),
        Point(0.6, 17.6, 0.275, "threshold", "a", [0.5, 0.5], run_id="r4"),
        Point(0.5, 30.0, 0.47, "trial", "c", [0.5, 0.5], run_id="r5"),  # dominated
    ]
    baselines = [
        Baseline("full", "full resolution", 1.0, 64.0, 1.0, [0.0], "b"),
        Baseline("entropy", "entropy t=0.9", 0.2653, 4.3, 0.067, [0.9], "b"),
        Baseline("random", "random @ 0.07", 0.25, 4.27, 0.0667, [0.9], "b", target_ratio=0.07),
    ]
    return points, baselines, annotate(points)


def _round(value: float) -> bool:
    """A tick a person would choose: a whole multiple of 1, 2, 2.5 or 5 times a power of ten."""
    import math

    if value == 0:
        return True
    for digits in range(0, 4):
        scaled = round(value * 10**digits, 9)
        if abs(scaled - round(scaled)) < 1e-9:
            return True
    return math.isclose(value * 4, round(value * 4))


def test_the_png_marks_the_best_point_keeps_labels_apart_and_ticks_round():
    import matplotlib.pyplot as plt

    from splitvit.tune.pareto import best_point
    from splitvit.tune.plot import MARKERS, pareto_figure

    points, baselines, hv = _chart_points()
    fig = pareto_figure(points, baselines, hypervolume=hv, full_tokens=64.0)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        assert ax.get_ylim()[1] <= 1.0 and ax.get_xlim()[0] >= 0.0  # inside the metric's range
        ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        assert ticks and all(_round(t) for t in ticks), ticks
        assert all(_round(t) for t in ax.get_xticks()), ax.get_xticks()
        labels = [t for t in ax.texts if t.get_text()]
        assert {t.get_text() for t in labels} == {"@best", "full resolution"}
        boxes = [t.get_window_extent() for t in labels]
        assert not boxes[0].overlaps(boxes[1])
        best = best_point(points)
        assert labels[[t.get_text() for t in labels].index("@best")].xy == (best.tokens_per_image, best.quality)
        # one legend, in MARKERS' words, for every kind of mark drawn
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        drawn = ("frontier", "trial", "threshold", "best", "full", "entropy", "random")
        assert all(any(text.startswith(MARKERS[k][3]) for text in legend) for k in drawn), legend
        # in the order the HTML chart's legend lists them
        assert [next(k for k in drawn if text.startswith(MARKERS[k][3])) for text in legend] == list(MARKERS)
    finally:
        plt.close(fig)


def test_the_html_chart_matches_the_png_legend_and_names_best():
    from splitvit.tune.plot import MARKERS, pareto_html

    points, baselines, _ = _chart_points()
    uris = {"r2": ["models:/splitvit-smoke@best", "models:/splitvit-smoke@s1-best"], "r3": ["models:/m@tokens-71pct"]}
    page = pareto_html(points, baselines, metric="accuracy", title="s", model_uris=uris)
    # ticks: round, and the accuracy axis stops at 1.0
    ticks = [float(v) for v in re.findall(r"text-anchor='end'>([-0-9.]+)</text>", page)]
    assert ticks and max(ticks) <= 1.0 and all(_round(t) for t in ticks), ticks
    # the best point: ringed, labelled @best, its tooltip names the alias that loads it
    assert ">@best</text>" in page
    assert "@best: the largest hypervolume contribution" in page
    assert "load: models:/splitvit-smoke@best (also @s1-best)" in page
    # the legend names the marks drawn, in the PNG's words; baselines are in tooltips, not labels
    for key in ("frontier", "trial", "threshold", "best", "full", "entropy", "random"):
        assert MARKERS[key][3] in page, key
    assert "entropy t=0.9: accuracy" in page and ">entropy t=0.9</text>" not in page
    # labels placed apart (the two labels' boxes do not intersect)
    placed = [
        (float(x), float(y))
        for x, y in re.findall(r"<text x='([0-9.]+)' y='([0-9.]+)' font-size='12' font-weight", page)
    ]
    assert len(placed) == 2 and (abs(placed[0][1] - placed[1][1]) > 12 or abs(placed[0][0] - placed[1][0]) > 100)


def test_a_quality_in_percent_is_not_cut_at_one():
    import matplotlib.pyplot as plt

    from splitvit.tune.pareto import Point, annotate
    from splitvit.tune.plot import pareto_figure

    points = [Point(31.5, 4.0, 0.25, "trial", "a"), Point(40.2, 8.0, 0.5, "trial", "b")]
    annotate(points)
    fig = pareto_figure(points, [], metric="box_ap")
    try:
        assert fig.axes[0].get_ylim()[1] > 40.2
    finally:
        plt.close(fig)


def test_nice_ticks_are_round_and_inside_the_range():
    from splitvit.tune.plot import axis_range, nice_ticks, tick_text

    assert nice_ticks(0.196, 1.0, 6) == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(2.1, 66.0, 8) == [10, 20, 30, 40, 50, 60]
    assert tick_text(0.25, 0.25) == "0.25" and tick_text(10.0, 10.0) == "10"
    assert axis_range([0.25, 1.0], low=0.0, high=1.0)[1] == 1.0
    assert axis_range([1.0, 1.0], low=0.0, high=1.0) == pytest.approx((0.95, 1.0))  # one value: room below it


def test_a_trials_final_report_becomes_its_points_and_a_baselines_its_rows():
    """``collect`` and ``record_trials`` without Ray or MLflow: a finished trial's report (as
    Tune hands it back, its stage-two points as JSON text) gives its point and its threshold points;
    a fine-tuned baseline's gives its rows, full resolution's its last validation."""
    import json
    from types import SimpleNamespace

    from splitvit.tune.outcomes import collect, record_trials
    from splitvit.tune.trial import ThresholdPoint, TrialFinal

    recorded: list[TrialFinal] = []

    class Recorder:
        def trial_completed(self, trial_id, run_uri, sampled, config_params, final, data=None):
            recorded.append(final)
            return f"run-{trial_id}", [f"point-{trial_id}-{i}" for i in range(len(final.threshold_points))]

        def tag_run(self, run_id, tags):
            pass

    def no_config(sampled, trial_id):
        raise ValueError("no config in this test")

    plan = SimpleNamespace(trial_config=no_config, run_uri=lambda trial_id: f"/runs/{trial_id}")
    space = SimpleNamespace(
        companion_metrics=("mask_ap",), quality_metric="box_ap", parameters={"model.thresholds[0]": None}, decode=dict
    )
    sweep = SimpleNamespace(metric="box_ap", space=space, plan=plan, recorder=Recorder())
    stage_two = [ThresholdPoint(0.3, 8.0, 0.5, [0.6], 40.0, {"mask_ap": 0.25}, target_ratio=0.5, images=500)]
    report = {
        "box_ap": 0.4,
        "mask_ap": 0.35,
        "tokens_per_image": 12.0,
        "token_ratio": 0.75,
        "images_per_s": 30.0,
        "epochs": 2,
        "thresholds": [0.5],
        "images": 500,
        "checkpoint": "/ckpt/a",
        "threshold_points": json.dumps([p.to_dict("box_ap") for p in stage_two]),
        "splitvit_final": True,
        "training_iteration": 3,  # Tune's own keys come along
    }
    entropy = {**report, "threshold_points": json.dumps([{**stage_two[0].to_dict("box_ap"), "target_ratio": 0.4}])}

    def result(trial_id, report, config):
        return SimpleNamespace(path=f"/sweep/{trial_id}", metrics=report, config=config, error=None)

    grid = [
        result("a", report, {"model.thresholds[0]": 0.5}),
        result("e", entropy, {"baseline": "entropy"}),
        result("f", report, {"baseline": "full"}),
    ]
    trials, finals = collect(grid, space, "/sweep")
    assert [(t.trial_id, t.status, t.params, t.baseline) for t in trials] == [
        ("a", "completed", {"model.thresholds[0]": 0.5}, ""),
        ("e", "completed", {}, "entropy"),
        ("f", "completed", {}, "full"),
    ]
    points, baselines = record_trials(sweep, trials, finals)

    trial, threshold = points
    assert (trial.kind, trial.quality, trial.tokens_per_image, trial.thresholds) == ("trial", 0.4, 12.0, [0.5])
    assert trial.extras == {"images_per_s": 30.0, "mask_ap": 0.35, "images": 500.0} and trial.run_id == "run-a"
    assert (threshold.kind, threshold.quality, threshold.checkpoint, threshold.run_id) == (
        "threshold",
        0.3,
        "/ckpt/a",
        "point-a-0",
    )
    assert threshold.extras == {"images_per_s": 40.0, "mask_ap": 0.25, "target_ratio": 0.5, "images": 500.0}
    assert recorded[0].threshold_points == stage_two and recorded[0].epochs == 2
    # a baseline's ratio points are the parent's baselines, not point runs
    assert [len(r.threshold_points) for r in recorded[1:]] == [0, 0]
    assert [(b.baseline, b.label, b.quality, b.images_per_s, b.target_ratio) for b in baselines] == [
        ("entropy", "entropy @ 0.40 (fine-tuned)", 0.3, 40.0, 0.4),
        ("full", "full resolution (fine-tuned)", 0.4, None, None),
    ]


def _result(points: list, metric: str = "accuracy", images: int | None = 1000):
    from splitvit.tune.pareto import annotate
    from splitvit.tune.state import SweepResult

    annotate(points)
    return SweepResult(
        name="s",
        space="space.yaml",
        sweep_dir="/tmp/s",
        metric=metric,
        points=points,
        baselines=[],
        hypervolume=0.0,
        reference_point={"quality": 0.0, "token_ratio": 1.0},
        trials=[],
        tracking_uri="sqlite:///m.db",
        experiment="e",
        experiment_id="1",
        parent_run_id="p",
        validation_images=images,
    )


def test_the_sweep_says_which_frontier_steps_its_validation_images_cannot_tell_apart():
    """On 1,000 images an accuracy near 0.75 has a standard error of 1.37 points: of a
    frontier stepping 0.71 -> 0.75 -> 0.755, the last step is within it, the first is
    not; on 100,000 images neither is. Dense (mIoU) sweeps and unknown counts say nothing."""
    from splitvit.cli.sweep import selection_noise
    from splitvit.tune.pareto import Point, standard_error, within_noise

    assert standard_error(0.75, 1000) == pytest.approx(0.013693, abs=1e-6)

    def points():
        return [
            Point(0.71, 10.0, 0.25, trial_id="a"),
            Point(0.75, 20.0, 0.5, trial_id="b"),
            Point(0.755, 30.0, 0.75, trial_id="c"),
        ]

    front = points()
    close = within_noise(front, 1000)
    assert [(a.trial_id, b.trial_id) for a, b in close] == [("b", "c")]
    assert within_noise(front, 100_000) == []
    line = selection_noise(_result(points()))
    assert line.startswith("chosen on 1000 validation images: an accuracy near 0.74 is measured to within about 1.4")
    assert "1 of 2 neighbouring frontier points differ by less" in line
    assert "differs by more" in selection_noise(_result(points(), images=100_000))
    assert selection_noise(_result(points(), metric="miou")) is None
    assert selection_noise(_result(points(), images=None)) is None


def test_the_sweep_summary_tables_the_frontier_as_its_json_lists_it(capsys):
    """``splitvit sweep``'s summary: the counts and one table row per frontier point, as
    the sweep's JSON lists the frontier."""
    from splitvit.cli.output import frontier_table
    from splitvit.cli.sweep import print_summary
    from splitvit.tune.pareto import Point

    result = _result([Point(0.7, 10.0, 0.25, trial_id="a"), Point(0.6, 20.0, 0.5, trial_id="b")])
    print_summary(result)
    out = capsys.readouterr().out
    assert "2 points, 1 on the Pareto frontier" in out
    frontier_table(result.to_dict()["frontier"], "accuracy")
    assert out.endswith(capsys.readouterr().out) and "a " in out.splitlines()[-1]


def test_a_sweep_knows_the_validation_images_its_points_were_measured_on():
    """The count the trials reported with their points; unknown where a point did not say
    (an older sweep) or where points were measured on different counts."""
    from splitvit.tune.closing import validation_images
    from splitvit.tune.pareto import Point

    def point(images: float | None, quality: float = 0.7) -> Point:
        return Point(quality, 10.0, 0.5, extras={} if images is None else {"images": images})

    assert validation_images([point(5000.0), point(5000.0, 0.71)]) == 5000
    assert validation_images([point(5000.0), point(1000.0)]) is None
    assert validation_images([point(5000.0), point(None)]) is None
    # a diverged point (no finite objectives) does not count
    assert validation_images([point(1000.0), point(64.0, float("nan"))]) == 1000
    assert validation_images([]) is None
