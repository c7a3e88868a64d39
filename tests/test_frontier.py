"""The frontier in numbers: its hypervolume against an independent reference (the area
of the union of each point's dominated box), and its figures at their true MLflow steps."""

from __future__ import annotations

import random

import pytest

from splitvit.tune import hypervolume


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
    run_id, _ = recorder.trial_completed("t0", run_uri, {"train.lr": 0.1}, {}, final)
    history = MlflowClient(uri).get_metric_history(run_id, "images_per_s")
    assert sorted((m.step, m.value) for m in history) == [(0, 100.0), (1, 101.0), (2, 90.0), (2, 102.0)]
    assert {m.step for m in MlflowClient(uri).get_metric_history(run_id, "train_seconds")} == {2}
