"""A sweep in MLflow's own terms, against a real embedded store (SQLite + local
artifacts): registered versions linked from their logged models, one registered name
per search space with per-sweep and moving aliases, signatures, dataset inputs, the
Source column naming the command, and no empty tags."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402

from splitvit.config import (
    DataConfig,  # noqa: E402
    PolicyConfig,
)
from splitvit.tune.mlflow_records import (  # noqa: E402
    ALIAS_TAG,
    EVAL_THROUGHPUT,
    FRONTIER_TAG,
    NOTE_TAG,
    SHARED_VIEW_PREFIX,
    TIE_TAG,
    SweepRecorder,
    frontier_link,
    frontier_view_key,
)
from splitvit.tune.pareto import Point, annotate, best_point, frontier  # noqa: E402
from splitvit.tune.trial import TrialFinal  # noqa: E402

DATA = DataConfig(name="synthetic", options={"train_samples": 64, "val_samples": 16, "object_size": 4})


def _tiny_model():
    from splitvit.model import SplitViT

    torch.manual_seed(0)
    return SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(kind="learned", depth=1),
        levels=2,
        image_size=16,
        num_classes=3,
        timm_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
    ).eval()


def _sweep(uri: str, root, name: str, figures: list[tuple[float, float]]) -> tuple[SweepRecorder, list[Point]]:
    """A finished sweep: one trial per ``(accuracy, tokens)`` (16 tokens at full
    resolution), each with one threshold point at 90% of its accuracy and tokens,
    recorded as the sweep driver records them (``data`` as their dataset)."""
    recorder, _ = SweepRecorder.open(uri, "ui", str(root / name), name, "accuracy", params={}, tags={})
    points = []
    for i, (accuracy, tokens) in enumerate(figures):
        run_uri = str(root / name / f"trial{i}")
        row = {
            "accuracy": accuracy * 0.9,
            "tokens_per_image": tokens * 0.9,
            "token_ratio": tokens * 0.9 / 16,
            "images_per_s": 321.0,
            "thresholds": [0.7, 0.6],
        }
        final = {
            "epochs": 1,
            "accuracy": accuracy,
            "tokens_per_image": tokens,
            "token_ratio": tokens / 16,
            "thresholds": [0.5, 0.5],
            "threshold_points": [row],
        }
        trial = f"{name}-t{i}"
        recorder.trial_started(trial, run_uri, {"model.thresholds[0]": 0.4}, {}, data=DATA)
        final = TrialFinal.from_report(final, "accuracy")
        run_id, (point_id,) = recorder.trial_completed(trial, run_uri, {"model.thresholds[0]": 0.4}, {}, final, DATA)
        points.append(Point(accuracy, tokens, tokens / 16, "trial", trial, [0.5, 0.5], run_id=run_id))
        points.append(
            Point(
                row["accuracy"],
                row["tokens_per_image"],
                row["token_ratio"],
                "threshold",
                trial,
                [0.7, 0.6],
                run_id=point_id,
            )
        )
    annotate(points)
    return recorder, points


def _log_models(recorder: SweepRecorder, front: list[Point], best: Point | None) -> None:
    from splitvit.tracking import RunTracker
    from splitvit.tune.artifacts import _set_signature, model_name

    model = _tiny_model()
    for p in front:
        tracker = RunTracker(recorder.tracking_uri, recorder.experiment_id, p.run_id)
        p.model_uri = tracker.log_model(model, name=model_name(p, best))
        _set_signature(p.model_uri, model)


def test_frontier_models_are_registered_linked_and_aliased_per_space(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    first, points = _sweep(uri, tmp_path, "smoke-1", [(0.5, 2.0), (0.9, 8.0)])
    front, best = frontier(points), best_point(points)
    _log_models(first, front, best)
    registered = first.register_frontier("smoke", "smoke-1", front, best)
    assert registered.name == "splitvit-smoke"
    for p in front:
        model = client.get_logged_model(p.model_uri.removeprefix("models:/"))
        # the link MLflow's own registration makes: the logged model's page names its version
        versions = json.loads(model.tags["mlflow.modelVersions"])
        assert [v["name"] for v in versions] == ["splitvit-smoke"]
        version = client.get_model_version("splitvit-smoke", versions[0]["version"])
        assert version.run_id == p.run_id and "smoke-1" in version.description
        assert f"version {version.version}" in model.tags[NOTE_TAG]  # the logged model's description
        # its figures tied to the data it was evaluated on: the page's "Datasets used"
        tied = {m.key: m.dataset_name for m in model.metrics if m.dataset_name}
        assert tied == dict.fromkeys(("accuracy", "tokens_per_image", "token_ratio"), "synthetic/val")
        # a signature: images in, logits and tokens out
        from mlflow.models import get_model_info

        signature = get_model_info(p.model_uri).signature
        assert signature is not None and signature.inputs.input_names() == ["images"]
        assert {"logits", "tokens"} == set(signature.outputs.input_names())
        assert signature.inputs.inputs[0].shape == (-1, 3, 16, 16)
    assert client.get_model_version_by_alias("splitvit-smoke", "best").run_id == best.run_id
    assert client.get_model_version_by_alias("splitvit-smoke", "smoke-1-best").run_id == best.run_id
    assert registered.by_run[best.run_id][0] == "models:/splitvit-smoke@best"
    assert client.get_run(best.run_id).data.tags[ALIAS_TAG].startswith("models:/splitvit-smoke@smoke-1-tokens-")
    first_aliases = set(client.get_registered_model("splitvit-smoke").aliases)

    # a second sweep of the space: the same name, `best` moves to it, the first keeps its own
    second, points2 = _sweep(uri, tmp_path, "smoke-2", [(0.95, 5.0)])
    front2, best2 = frontier(points2), best_point(points2)
    _log_models(second, front2, best2)
    assert second.register_frontier("smoke", "smoke-2", front2, best2).name == "splitvit-smoke"
    assert [m.name for m in client.search_registered_models()] == ["splitvit-smoke"]
    assert client.get_model_version_by_alias("splitvit-smoke", "best").run_id == best2.run_id
    assert client.get_model_version_by_alias("splitvit-smoke", "smoke-1-best").run_id == best.run_id
    aliases = set(client.get_registered_model("splitvit-smoke").aliases)
    assert {a for a in first_aliases if a.startswith("smoke-1-")} <= aliases  # never moved
    # the bare budget aliases are the newest sweep's frontier, none left from the first
    bare = {a for a in aliases if a.startswith("tokens-")}
    assert bare == {f"tokens-{p.token_ratio * 100:.0f}pct" for p in front2}
    description = client.get_registered_model("splitvit-smoke").description
    assert "workflowType=machine_learning" in description and "smoke-2" in description


def test_point_runs_carry_datasets_descriptions_and_no_empty_tags(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    recorder, points = _sweep(uri, tmp_path, "s", [(0.5, 2.0), (0.9, 8.0)])
    # a tie: a copy of a frontier point's figures on another run
    tied = Point(
        points[1].quality, points[1].tokens_per_image, points[1].token_ratio, "threshold", "x", run_id=points[0].run_id
    )
    marked = [tied if p is points[0] else p for p in points]
    annotate(marked)
    recorder.mark_frontier(marked)
    assert client.get_run(points[0].run_id).data.tags.get(TIE_TAG) == points[1].run_id
    annotate(points)
    recorder.mark_frontier(points)  # a resumed sweep: the tie is gone, so is its tag
    for p in points:
        run = client.get_run(p.run_id)
        assert run.data.tags[FRONTIER_TAG] in ("true", "false")
        assert TIE_TAG not in run.data.tags
        assert all(v != "" for v in run.data.tags.values()), {k for k, v in run.data.tags.items() if v == ""}
        # the data the trial trained and evaluated on, as MLflow datasets
        names = {d.dataset.name for d in run.inputs.dataset_inputs}
        assert names == {"synthetic/train", "synthetic/val"}
        assert NOTE_TAG in run.data.tags
    # the thresholds each point was evaluated at: one `thresholds` param on trial and point runs alike
    assert json.loads(client.get_run(points[0].run_id).data.params["thresholds"]) == [0.5, 0.5]
    point = client.get_run(points[1].run_id)
    assert json.loads(point.data.params["thresholds"]) == [0.7, 0.6]
    assert point.data.metrics[EVAL_THROUGHPUT] == 321.0 and "images_per_s" not in point.data.metrics
    assert "`sampled.model.thresholds.*`" in point.data.tags[NOTE_TAG]

    # the sweep's description keeps the frontier's link whole (MLflow's `viewStateShareKey`
    # looks like a secret's name to the masking), and still masks what is secret
    link = frontier_link(recorder.experiment_id, recorder.parent_run_id)
    recorder.describe(f"[the frontier]({link}); data at https://h/b?token=abc123&x=1 read.")
    note = client.get_run(recorder.parent_run_id).data.tags[NOTE_TAG]
    assert f"[the frontier]({link})" in note and "abc123" not in note and note.endswith("&x=1 read.")

    # the experiment's description links the frontier's saved runs view
    best = best_point(points)
    recorder.describe_experiment("s", 0.5, len(frontier(points)), len(points), best, None)
    experiment = client.get_experiment(recorder.experiment_id)
    view = json.loads(experiment.tags[SHARED_VIEW_PREFIX + frontier_view_key(recorder.parent_run_id)])
    assert view["searchFilter"] == (
        f"tags.`splitvit.frontier` = 'true' and tags.`splitvit.sweep` = '{recorder.parent_run_id}'"
    )
    found = client.search_runs([recorder.experiment_id], filter_string=view["searchFilter"])
    assert {r.info.run_id for r in found} == {p.run_id for p in frontier(points)}
    note = experiment.tags["mlflow.note.content"]
    assert f"viewStateShareKey={frontier_view_key(recorder.parent_run_id)}" in note
    assert "&orderByKey=metrics.%60accuracy%60&orderByAsc=false" in note  # the plain search, for older UIs
    links = re.findall(r"\]\((#/[^)]*)\)", note)
    assert len(links) >= 3 and all("workflowType=machine_learning" in link for link in links), links


@pytest.mark.parametrize(
    "argv, name",
    [
        (["/x/.venv/bin/splitvit", "sweep", "search_spaces/smoke.yaml", "--json", "runs/sweep.json"], "splitvit sweep"),
        (["/x/.venv/bin/splitvit", "-v", "train", "c.yaml"], "splitvit train"),
        (["/r/platform/splitvit/__main__.py", "eval", "models:/m@best"], "splitvit eval"),
        (["/r/platform/splitvit/cli/__main__.py", "sweep", "s.yaml"], "splitvit sweep"),  # python -m splitvit.cli
        (["jobs/sweep.py", "search_spaces/smoke.yaml"], "sweep.py"),
        ([], "splitvit"),
    ],
)
def test_the_source_column_names_the_command_not_its_last_argument(argv, name, monkeypatch):
    from splitvit.tracking.provenance import SOURCE_NAME_TAG, provenance_tags, source_name

    assert source_name(argv) == name
    monkeypatch.setattr(sys, "argv", argv or [""])
    assert provenance_tags()[SOURCE_NAME_TAG] == name


def test_a_detectors_signature_names_its_detections():
    """A detector on SPLIT logs a signature too: its images in, an image's detections out."""
    from splitvit.tune.artifacts import model_signature
    from tests.test_detection_model import tiny_detector

    signature = model_signature(tiny_detector().eval())
    assert signature.inputs.input_names() == ["images"]
    assert {"boxes", "labels", "scores"} <= set(signature.outputs.input_names())
