"""The `splitvit` command as a user runs it: help, viz, JSON output, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from splitvit.cli import main
from splitvit.train.demo import build_demo_model


def test_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "splitvit.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("demo", "viz", "bench"):
        assert command in out


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
