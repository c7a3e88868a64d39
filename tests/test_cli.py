"""The `splitvit` command as a user runs it: help, viz, JSON output, clear errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from splitvit.cli import main
from splitvit.train.demo import build_demo_model

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "splitvit.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("demo", "viz", "bench"):
        assert command in out


def test_environment_sets_and_unsets_for_the_block_then_restores(monkeypatch):
    """One helper sets variables around a block (the CLI's, Ray's console switch, the
    sweep's state period, pareto's quiet download, bench data's local S3): None unsets,
    override=False keeps a value the user set, and every variable is put back."""
    from splitvit.train.console import environment

    monkeypatch.setenv("SV_KEPT", "user")
    monkeypatch.setenv("SV_GONE", "user")
    monkeypatch.delenv("SV_NEW", raising=False)
    with environment({"SV_KEPT": "ours", "SV_GONE": None, "SV_NEW": "ours"}, override=False):
        assert (os.environ["SV_KEPT"], os.environ["SV_GONE"], os.environ["SV_NEW"]) == ("user", "user", "ours")
    with environment({"SV_KEPT": "ours", "SV_GONE": None, "SV_NEW": "ours"}):
        assert os.environ["SV_KEPT"] == "ours" and "SV_GONE" not in os.environ and os.environ["SV_NEW"] == "ours"
    assert (os.environ["SV_KEPT"], os.environ["SV_GONE"]) == ("user", "user") and "SV_NEW" not in os.environ


def test_viz_draws_split_maps_and_writes_json(tmp_path, capsys):
    png, report = tmp_path / "maps.png", tmp_path / "viz.json"
    assert (
        main(
            [
                "viz",
                "--policy",
                "entropy",
                "--count",
                "4",
                "--thresholds",
                "0.5,0.5",
                "--out",
                str(png),
                "--json",
                str(report),
            ]
        )
        == 0
    )
    image = Image.open(png)
    assert image.size[0] == 4 * 48 * 4  # four tiles of 48 px, drawn 4x larger
    figures = json.loads(report.read_text())
    assert len(figures["tokens"]) == 4 and figures["full_tokens"] == 144
    assert all(9 <= t <= 144 for t in figures["tokens"])
    assert "entropy policy" in capsys.readouterr().out


def test_viz_reads_a_saved_checkpoint(tmp_path):
    path = tmp_path / "m.pt"
    build_demo_model("learned").save(path)
    png = tmp_path / "maps.png"
    assert main(["viz", "--checkpoint", str(path), "--count", "2", "--out", str(png)]) == 0
    assert png.exists()


def test_viz_bad_threshold_is_one_clear_error(tmp_path, capsys):
    code = main(["viz", "--policy", "entropy", "--thresholds", "0.5,1.7", "--out", str(tmp_path / "x.png")])
    assert code == 2
    err = capsys.readouterr().err
    assert "thresholds[1] = 1.7 is outside [0, 1]" in err
    assert not (tmp_path / "x.png").exists()


def test_demo_checkpoint_keeps_the_thresholds_it_was_compared_at(tmp_path):
    """`splitvit viz` on the demo's split.pt draws the model at the demo's budget: the
    checkpoint holds the calibrated thresholds, not the 0.5 it trained with."""
    from dataclasses import replace

    from splitvit.model import SplitViT
    from splitvit.train.demo import Recipe, run_demo

    recipe = replace(Recipe(), test_samples=64, depth=2, embed_dim=32, num_heads=2)
    result = run_demo(tmp_path, epochs=1, samples=64, target_ratio=0.3, recipe=recipe)
    learned = next(r for r in result["rows"] if r["method"].startswith("SPLIT"))
    saved = SplitViT.load(result["checkpoints"]["split"])
    assert saved.thresholds.tolist() == pytest.approx(learned["thresholds"])
    assert learned["thresholds"] != [0.5] * (recipe.levels - 1)


# ---------------------------------------------------------------------- common flags, the JSON envelope
ENVELOPE = {"command", "status", "error", "mlflow", "wall_time_s"}
MLFLOW = {"tracking_uri", "experiment_id", "run_id", "url"}

# every subcommand with the least it needs to parse
EVERY_SUBCOMMAND = [
    ["demo"],
    ["viz"],
    ["bench", "forward"],
    ["bench", "parts", "--study", "studies/study_fashion.yaml", "--method", "full"],
    ["bench", "train"],
    ["bench", "data"],
    ["data", "prepare", "synthetic", "--out", "shards"],
    ["data", "push", "shards", "s3://b/p"],
    ["recipes"],
    ["config", "cfg.yaml"],
    ["train", "cfg.yaml"],
    ["eval", "ckpt"],
    ["sweep", "space.yaml"],
    ["study", "study.yaml"],
    ["pareto", "exp"],
    ["submit", "train", "cfg.yaml"],
    ["stack", "up"],
    ["stack", "down"],
    ["stack", "status"],
]


def _subcommands(parser) -> set[str]:
    """Every leaf subcommand the parser has, as 'data prepare', 'stack up', ..."""
    import argparse

    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                below = _subcommands(child)
                found |= {f"{name} {b}" for b in below} if below else {name}
    return found


def test_the_list_of_subcommands_is_complete():
    from splitvit.cli.app import build_parser

    covered = {" ".join(argv[:2]) if argv[0] in ("bench", "data", "stack") else argv[0] for argv in EVERY_SUBCOMMAND}
    assert _subcommands(build_parser()) <= covered


@pytest.mark.parametrize("argv", EVERY_SUBCOMMAND, ids=lambda a: "-".join(a[:2]))
def test_every_subcommand_takes_verbose_and_tracking_uri_after_its_name(argv):
    from splitvit.cli.app import build_parser

    # submit's own options go before ENTRY
    at = 1 if argv[0] == "submit" else len(argv)
    args = build_parser().parse_args([*argv[:at], "-v", "--tracking-uri", "http://mlflow:5000", *argv[at:]])
    assert args.verbose is True and args.tracking_uri == "http://mlflow:5000"
    # and -v before the subcommand still works: the subcommand's parser does not reset it
    args = build_parser().parse_args(["-v", *argv])
    assert args.verbose is True and not hasattr(args, "tracking_uri")


def test_commands_without_mlflow_say_the_tracking_uri_is_ignored(capsys):
    for argv in (
        ["demo"],
        ["data", "prepare"],
        ["stack", "up"],
        ["bench", "forward"],
        ["bench", "parts"],
        ["bench", "data"],
        ["recipes"],
        ["config"],
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        assert "ignored: this command does not use MLflow" in " ".join(capsys.readouterr().out.split())
    for argv in (["train"], ["eval"], ["viz"]):  # eval and viz read models:/ and runs:/ URIs from a store
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        assert "over $MLFLOW_TRACKING_URI" in " ".join(capsys.readouterr().out.split())


def test_set_is_the_same_as_positional_overrides_on_train():
    from splitvit.cli.app import build_parser
    from splitvit.cli.options import overrides

    positional = build_parser().parse_args(["train", "c.yaml", "train.epochs=1", "storage.name=r"])
    flagged = build_parser().parse_args(["train", "c.yaml", "--set", "train.epochs=1", "--set", "storage.name=r"])
    positional.tracking_uri = flagged.tracking_uri = None
    assert overrides(positional) == overrides(flagged) == ["train.epochs=1", "storage.name=r"]
    # --tracking-uri comes last, so it wins over a --set of the same key
    flagged.tracking_uri = "http://mlflow:5000"
    assert overrides(flagged)[-1] == "tracking.tracking_uri=http://mlflow:5000"


@pytest.mark.parametrize("how", ["positional", "set"])
def test_a_config_error_writes_the_envelope_with_its_error_line(how, tmp_path, capsys):
    out = tmp_path / "train.json"
    bad = ["train.epochz=1"] if how == "positional" else ["--set", "train.epochz=1"]
    assert main(["train", str(ROOT / "jobs/configs/smoke.yaml"), *bad, "--json", str(out)]) == 2
    data = json.loads(out.read_text())
    assert ENVELOPE <= set(data) and set(data["mlflow"]) == MLFLOW
    assert data["command"] == "train" and data["status"] == "failed"
    assert "train.epochz: unknown key" in data["error"]
    assert f"splitvit train: error: {data['error']}" in capsys.readouterr().err
    assert data["wall_time_s"] >= 0


def test_the_envelope_on_success_keeps_the_figures_at_the_top_level(tmp_path):
    out = tmp_path / "viz.json"
    argv = ["viz", "--policy", "entropy", "--count", "2", "--out", str(tmp_path / "m.png"), "--json", str(out)]
    assert main([*argv, "-v", "--tracking-uri", "http://mlflow:5000"]) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "viz" and data["status"] == "ok" and data["error"] is None
    assert len(data["tokens"]) == 2 and isinstance(data["wall_time_s"], float)
    # viz uses no MLflow: the URI given is not reported as where anything went
    assert data["mlflow"] == dict.fromkeys(MLFLOW)


def test_an_interrupted_command_writes_status_interrupted(tmp_path, monkeypatch):
    from splitvit.cli import viz

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(viz, "run", interrupted)
    out = tmp_path / "viz.json"
    assert main(["viz", "--json", str(out)]) == 130
    data = json.loads(out.read_text())
    assert data["status"] == "interrupted" and data["error"]


def test_a_failed_sweep_writes_its_json(tmp_path):
    """A sweep that stops with an error (nothing to resume) still writes the envelope."""
    out, store = tmp_path / "sweep.json", tmp_path / "store"
    code = main(
        [
            "sweep",
            str(ROOT / "search_spaces/smoke.yaml"),
            "--resume",
            "--name",
            "nothing-here",
            "--set",
            f"storage.path={store}",
            "--tracking-uri",
            f"sqlite:///{store}/mlflow.db",
            "--json",
            str(out),
        ]
    )
    assert code == 2  # bad input, found before Ray starts
    data = json.loads(out.read_text())
    assert data["command"] == "sweep" and data["status"] == "failed"
    assert "holds no sweep to resume" in data["error"]
    assert not store.exists()  # nothing made: no store, no sweep folder
    assert data["mlflow"]["tracking_uri"] == f"sqlite:///{store}/mlflow.db"


def test_mlflow_url_only_for_a_tracking_server():
    from splitvit.cli.output import mlflow_url

    # links open MLflow 3's "Model training" view (its default shows traces)
    view = "?workflowType=machine_learning"
    assert (
        mlflow_url("http://u:secret@mlflow:5000/", "3", "abc")
        == f"http://u:***@mlflow:5000/#/experiments/3/runs/abc{view}"
    )
    assert mlflow_url("https://mlflow.example", "3", None) == f"https://mlflow.example/#/experiments/3{view}"
    assert mlflow_url("sqlite:///runs/mlflow.db", "3", "abc") is None
    assert mlflow_url("http://mlflow:5000", None, "abc") is None


def test_bad_thresholds_text_is_bad_input_not_a_crash(tmp_path, capsys):
    assert main(["viz", "--thresholds", "a,b", "--out", str(tmp_path / "x.png")]) == 2
    assert "--thresholds: expected comma-separated numbers" in capsys.readouterr().err


# ---------------------------------------------------------------------- console
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_and_nothing_elsewhere(caplog):
    import logging

    from splitvit.train.console import Progress

    screen = _Terminal()
    bar = Progress("trials", 4, stream=screen, width=8)
    bar.update(1)
    assert screen.getvalue().endswith("[##------] 1/4 trials")
    with caplog.at_level(logging.INFO, logger="splitvit.test"):
        bar.log(logging.getLogger("splitvit.test"), logging.INFO, "trial %s started", "t1")
    assert "trial t1 started" in caplog.text
    # the bar was cleared for the line and drawn again after it
    assert screen.getvalue().endswith("\r\033[K[##------] 1/4 trials")
    bar.update(4)
    assert screen.getvalue().endswith("[########] 4/4 trials\n")

    piped = io.StringIO()
    quiet = Progress("trials", 4, stream=piped)
    quiet.update(2)
    quiet.log(logging.getLogger("splitvit.test"), logging.INFO, "x")
    assert piped.getvalue() == ""


def test_progress_pickles_without_its_stream():
    """Ray Tune pickles callbacks, and so their bar, into the experiment state."""
    import pickle

    from splitvit.train.console import Progress

    bar = Progress("runs", 3, stream=_Terminal())
    bar.update(1)
    again = pickle.loads(pickle.dumps(bar))
    assert again.stream is sys.stderr and again.done == 1 and not again.drawn


def test_ray_console_is_quiet_unless_asked(monkeypatch):
    import os

    from splitvit.train import console

    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    console.show_ray_output(False)
    with console.ray_console():
        assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0"
    assert "RAY_AIR_NEW_OUTPUT" not in os.environ and console.tune_verbosity() == 0
    console.show_ray_output(True)
    try:
        with console.ray_console():
            assert "RAY_AIR_NEW_OUTPUT" not in os.environ
        assert console.tune_verbosity() == 1
    finally:
        console.show_ray_output(False)


def test_the_envelope_finds_the_experiment_of_a_run(tmp_path):
    """A command that knows only its run (train) gets the experiment id from the store."""
    from mlflow import MlflowClient

    from splitvit.cli.output import Report, envelope

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("envelope")
    run = client.create_run(experiment)
    report = Report("train", payload={"mlflow_run_id": run.info.run_id}, mlflow={"tracking_uri": uri})
    report.mlflow["run_id"] = run.info.run_id
    data = envelope(report, 0, 1.5)
    assert data["mlflow"] == {"tracking_uri": uri, "experiment_id": experiment, "run_id": run.info.run_id, "url": None}
    assert data["mlflow_run_id"] == run.info.run_id and data["status"] == "ok" and data["wall_time_s"] == 1.5


def test_pareto_reads_the_latest_sweep_or_all_and_draws_them(tmp_path, capsys):
    import time

    from tests.test_frontier import _recorded_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = _recorded_sweep(uri, tmp_path, "first", [(0.9, 8.0)])
    time.sleep(0.01)  # start times are in milliseconds: the second sweep is the later one
    second = _recorded_sweep(uri, tmp_path, "second", [(0.7, 4.0), (0.6, 6.0)])
    out = tmp_path / "pareto.json"

    assert main(["pareto", "sweeps", "--tracking-uri", uri, "--json", str(out)]) == 0
    latest = json.loads(out.read_text())
    assert latest["command"] == "pareto" and latest["status"] == "ok" and latest["sweeps"] == [second]
    assert latest["mlflow"]["run_id"] == second and latest["mlflow"]["experiment_id"] == latest["experiment_id"]

    png = tmp_path / "plots" / "frontier.png"
    assert main(["pareto", "sweeps", "--all", "--plot", str(png), "--tracking-uri", uri, "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert sorted(merged["sweeps"]) == sorted([first, second]) and merged["mlflow"]["run_id"] is None
    assert merged["plot"] == str(png) and Image.open(png).size[0] > 100
    assert f"plot: {png}" in capsys.readouterr().out

    with pytest.raises(SystemExit):  # one sweep or all of them, not both
        main(["pareto", "sweeps", "--all", "--sweep", first])


def test_pareto_on_a_missing_store_fails_in_the_envelope_and_creates_nothing(tmp_path):
    db = tmp_path / "nowhere" / "mlflow.db"
    out = tmp_path / "pareto.json"
    # bad input, as the README says: exit 2
    assert main(["pareto", "sweeps", "--tracking-uri", f"sqlite:///{db}", "--json", str(out)]) == 2
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and "no MLflow store" in data["error"]
    assert not db.parent.exists()


# ---------------------------------------------------------------------- MLflow that does not answer
@contextlib.contextmanager
def silent_server():
    """``http://127.0.0.1:PORT`` of a socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # the kernel completes the handshakes; nothing ever reads or replies
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "models:/smoke-sweep@best"],
        ["viz", "--checkpoint", "runs:/0123456789abcdef"],
        ["pareto", "smoke-sweep"],
    ],
    ids=["eval", "viz", "pareto"],
)
def test_commands_that_read_mlflow_check_the_server_in_seconds(argv, tmp_path, capsys):
    """eval, viz and pareto against a server that does not answer: one line, exit 2, in
    seconds (one request, no retries), not MLflow's minutes of back-off; a dead port
    (refused at once) and a server that accepts but never replies (a 4 s read timeout)."""
    from splitvit.cluster.stack import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with silent_server() as silent:
        for url, bound in ((dead, 3.0), (silent, 10.0)):
            start = time.monotonic()
            code = main([*argv, "--tracking-uri", url, "--json", str(tmp_path / "out.json")])
            seconds = time.monotonic() - start
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and seconds < bound, (seconds, err)
            assert len(err) == 1 and f"--tracking-uri: no MLflow server answers at {url}" in err[0], err
            data = json.loads((tmp_path / "out.json").read_text())
            assert data["status"] == "failed" and "no MLflow server answers" in data["error"]


def test_mlflow_tracking_schemes_are_checked_before_mlflow_loads():
    """MLflow's own schemes pass (paths, file, the SQL databases with or without a
    driver, http(s), databricks); anything else is one line naming the scheme."""
    from splitvit.train.names import tracking_uri_problem

    for uri in (
        "runs/mlruns",
        "/abs/mlruns",
        "file:///tmp/mlruns",
        "sqlite:///runs/mlflow.db",
        "postgresql://u:p@db:5432/mlflow",
        "postgresql+psycopg2://db/mlflow",
        "mysql+pymysql://db/mlflow",
        "mssql://db/mlflow",
        "http://127.0.0.1:5000",
        "https://mlflow.example.org/prefix",
        "databricks",
        "databricks://profile",
    ):
        assert tracking_uri_problem(uri) is None, uri
    for uri, scheme in (("foo://bar", "foo"), ("s3://bucket/mlruns", "s3"), ("sqlite+a+b:///x.db", "sqlite+a+b")):
        why = tracking_uri_problem(uri)
        assert why and f"scheme {scheme!r}" in why, uri
    assert "secret" not in tracking_uri_problem("foo://user:secret@host")  # passwords never printed


def test_the_checks_before_torch_read_the_settings_as_the_model_and_storage_do(tmp_path, monkeypatch):
    """The torch-free checks of splitvit.train.names agree with what the model and the
    storage later refuse: the patch from timm_kwargs or the timm name, the storage
    schemes, a COCO file's shape (large and s3:// files left to the dataset)."""
    from splitvit.config import ConfigError, ExperimentConfig
    from splitvit.data import coco_format
    from splitvit.data.coco_format import CocoFormatError, check_coco_file
    from splitvit.train.names import check_model_shape, finest_patch, storage_path_problem

    def model(**settings):
        return ExperimentConfig.from_dict({"model": settings}).model

    assert finest_patch(model(name="vit_small_patch16_224")) == 16
    assert finest_patch(model(name="vit_small_patch16_224", timm_kwargs={"patch_size": [8, 8]})) == 8
    assert finest_patch(model(name="some_vit")) is None  # timm decides; the full check follows
    check_model_shape(model(name="vit_small_patch16_224", image_size=64, levels=3))  # 16 * 4 divides 64
    with pytest.raises(ConfigError, match="coarsest patch 64"):
        check_model_shape(model(name="vit_small_patch16_224", image_size=96, levels=3))
    check_model_shape(model(name="some_vit", image_size=33, levels=3))  # no patch known: not judged here
    with pytest.raises(ConfigError, match="expected 1 values"):
        check_model_shape(model(levels=2, thresholds=[0.5, 0.5]))

    assert storage_path_problem(str(tmp_path / "new" / "runs")) is None
    assert not (tmp_path / "new").exists()  # checked, not created
    assert storage_path_problem(f"file://{tmp_path}") is None and storage_path_problem("s3://bucket/runs") is None
    assert "names no bucket" in storage_path_problem("s3:///runs")
    assert "unsupported storage URI" in storage_path_problem("gs://bucket/runs")

    good = tmp_path / "good.json"
    good.write_text('{"images": [], "annotations": [], "categories": []}')
    check_coco_file(str(good), "data.options.train_annotations")
    for text, words in (("[1, 2]", "top level is a list"), ("{", "not valid JSON"), ("{}", "missing top-level key")):
        good.write_text(text)
        with pytest.raises(CocoFormatError, match=f"data.options.val_annotations: {good}: .*{words}"):
            check_coco_file(str(good), "data.options.val_annotations")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_coco_file(str(tmp_path / "none.json"), "--option train_annotations")
    check_coco_file("s3://bucket/instances.json", "k")  # read when the dataset opens
    monkeypatch.setattr(coco_format, "EARLY_CHECK_MAX_BYTES", 1)
    check_coco_file(str(good), "k")  # too large to read twice: the dataset's own check reads it


def test_output_cut_short_by_its_reader_ends_quietly():
    """``splitvit recipes | head``: a reader that leaves early gets no error line."""
    child = subprocess.Popen(
        [sys.executable, "-m", "splitvit.cli", "recipes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    child.stdout.close()  # gone before the first line: every write meets a closed pipe
    err = child.stderr.read().decode()
    assert child.wait() == 141 and err == ""
