"""``splitvit bench parts`` and what it reads: the forward pass's stage marks, and the
fixed-cost changes it guided, each pinned to the computation it replaced."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitvit.bench.parts import (
    ARITHMETIC_STAGES,
    PartsReport,
    PartsSettings,
    across_runs,
    ceiling_speedup,
    format_parts_report,
    run_parts_benchmark,
    split_figures_across_runs,
)
from splitvit.model.quadtree import repeat_cells, upsample_to_children
from splitvit.model.splitvit import _area_downsample
from splitvit.model.stages import DETECTOR_STAGES, STAGES, StageClock

from .helpers import tiny_model

RECIPE = dict(fine_aggregation=True, level_context=True)  # the policy's level_context: tiny_model's policy section
SPLIT_STAGES = {"embedding", "aggregation", "level_context", "policy_head", "decision", "gather", "blocks", "head"}


def test_stage_clock_counts_nested_time_once_in_the_innermost_stage(monkeypatch):
    """Outer 0-10 and 30-40, inner 10-30 (a fake clock): outer 20, inner 20; time outside
    every stage counts nowhere."""
    ticks = iter([0.0, 10.0, 30.0, 40.0, 45.0, 50.0])
    monkeypatch.setattr("splitvit.model.stages.time.perf_counter", lambda: next(ticks))
    clock = StageClock()
    with clock.stage("blocks"):
        with clock.stage("packing"):
            pass
    with clock.stage("head"):
        pass
    assert clock.seconds == {"blocks": 20.0, "packing": 20.0, "head": 5.0}
    clock.reset()
    assert clock.seconds == {}


@pytest.mark.parametrize("packed", [True, False])
def test_forward_marks_its_stages_and_a_clock_changes_nothing(packed):
    """The recipe's forward pass marks every stage it runs (packing only on the packed
    path), and its outputs are the same with a clock attached."""
    model = tiny_model(**RECIPE, attention="packed" if packed else "padded").eval()
    images = torch.rand(6, 3, 32, 32)
    with torch.no_grad():
        plain = model(images)
        clock = StageClock()
        model.clock = clock
        clocked = model(images)
        model.clock = None
    assert torch.equal(plain.logits, clocked.logits) and torch.equal(plain.tokens, clocked.tokens)
    assert plain.tokens.min() < plain.tokens.max()  # mixed lengths: the gather and packing ran
    expected = SPLIT_STAGES | ({"packing"} if packed else set())
    assert set(clock.seconds) == expected and set(clock.seconds) <= set(STAGES)
    assert all(s > 0 for s in clock.seconds.values())


@pytest.mark.parametrize("shape,dim", [((2, 3, 4), -2), ((2, 3, 4, 5), 1), ((2, 5, 3, 4), -2)])
@pytest.mark.parametrize("factor", [2, 4])
def test_repeat_cells_is_repeat_interleave_on_both_grid_dims(shape, dim, factor):
    x = torch.randn(shape)
    d = dim % x.dim()
    expected = x.repeat_interleave(factor, d).repeat_interleave(factor, d + 1)
    assert torch.equal(repeat_cells(x, factor, dim), expected)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # another memory layout, same values
    assert torch.equal(repeat_cells(strided, factor, dim), expected)
    if dim == -2 and factor == 2:
        assert torch.equal(upsample_to_children(x), expected)


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_patch_tokens_are_the_patch_embeddings_convolution(factor):
    """The patchify convolution as a matrix product gives the convolution's embeddings."""
    model = tiny_model()
    images = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        x = model.normalize(images if factor == 1 else F.avg_pool2d(images, factor))
        conv = model.vit.patch_embed.proj(x).permute(0, 2, 3, 1)
        assert torch.allclose(model.patch_tokens(images, factor), conv, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 3, 32, 32), (5, 1, 64, 96), (2, 3, 8, 8)])
@pytest.mark.parametrize("factor", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coarse_levels_pool_the_images_as_avg_pool_does_bit_for_bit(shape, factor, dtype):
    """The coarse levels' area downsampling is ``F.avg_pool2d``'s, to the last bit (so a
    study re-run decides every node as before), also on a strided batch."""
    if shape[-1] % factor or shape[-2] % factor:
        pytest.skip("the grid is not a multiple of the factor")
    torch.manual_seed(factor)
    images = torch.rand(shape, dtype=dtype) * 4 - 2
    assert torch.equal(_area_downsample(images, factor), F.avg_pool2d(images, factor))
    every_other = torch.rand(shape[0] * 2, *shape[1:], dtype=dtype)[::2]
    assert torch.equal(_area_downsample(every_other, factor), F.avg_pool2d(every_other, factor))


@pytest.mark.parametrize("training", [False, True])
def test_level_context_in_one_pass_is_each_level_on_its_own(training):
    """Every scored level through the policy's blocks together (inference) gives each
    level's features exactly as its own pass does; training runs each level on its own."""
    model = tiny_model(**RECIPE).train(training)
    images = torch.rand(5, 3, 32, 32)
    with torch.no_grad():
        levels = [model.patch_tokens(images, 4), model.patch_tokens(images, 2)]
        together = model._levels_context_features(levels)
        alone = [model._context_features(tokens) for tokens in levels]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_bench_parts_times_a_study_methods_model_stage_by_stage(tmp_path, capsys):
    """``splitvit bench parts --study FILE --method M``: the study's recipe (its config and
    the method's settings) beside its full-resolution self at every batch size; the JSON
    holds each model's speed, tokens and stages, and the printout says what was timed."""
    from splitvit.cli import main

    out = tmp_path / "parts.json"
    argv = ["bench", "parts", "--study", "studies/study_fashion.yaml", "--method", "split-0.5-agg-mixed-ctx"]
    argv += ["--batch-sizes", "1,4", "--ratios", "0.5", "--repeats", "2", "--runs", "2", "--threads", "1"]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "studies/study_fashion.yaml method split-0.5-agg-mixed-ctx, random weights" in printed
    assert "batch 1" in printed and "batch 4" in printed and "level_context ms" in printed
    assert "median (min-max) of 2 runs of 2 interleaved rounds each" in printed
    data = json.loads(out.read_text())
    assert data["model"]["fine_aggregation"] and data["model"]["policy"]["level_context"]
    assert data["model"]["timm_kwargs"]["embed_dim"] == 96  # the study's config, not the base's
    assert [b["batch_size"] for b in data["batches"]] == [1, 4]
    assert data["settings"]["runs"] == 2
    for entry in data["batches"]:
        full, split = entry["models"]["full"], entry["models"]["split@0.50"]
        assert full["token_ratio"] == 1.0 and full["speedup_vs_full"] == 1.0
        assert 0.0 < split["token_ratio"] < 1.0
        per_run = [f / s for f, s in zip(full["runs"]["median_s"], split["runs"]["median_s"], strict=True)]
        assert len(per_run) == 2 and split["runs"]["speedup_vs_full"] == pytest.approx(per_run)
        assert split["speedup_vs_full"] == pytest.approx(statistics.median(per_run))
        assert set(split["stages_s"]) >= SPLIT_STAGES - {"gather"}
        assert not {"aggregation", "level_context"} & set(full["stages_s"])  # full resolution runs no policy blocks
        # the stages are a breakdown of one pass: together no longer than a few passes
        assert 0 < sum(split["stages_s"].values()) < 5 * split["median_s"]


def test_bench_parts_times_a_detector_whole_and_its_backbone_alone(tmp_path, capsys, monkeypatch):
    """A detection config: in the same rounds the whole detector (its backbone's stages,
    then pyramid, proposals, RoI heads, pasting) and its backbone alone through
    ``fine_features`` (what the detector calls, not ``forward``), each beside full
    resolution's same part; the printout and JSON say which is which."""
    from splitvit.cli import main
    from splitvit.model import SplitViT

    calls = {"fine_features": 0, "forward": 0}
    fine_features, forward = SplitViT.fine_features, SplitViT.forward

    def counted(name, method):
        def call(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return call

    monkeypatch.setattr(SplitViT, "fine_features", counted("fine_features", fine_features))
    monkeypatch.setattr(SplitViT, "forward", counted("forward", forward))
    out = tmp_path / "parts.json"
    argv = ["bench", "parts", "--config", "jobs/configs/fashion_det.yaml", "--batch-sizes", "2", "--ratios", "0.6"]
    argv += ["--repeats", "1", "--runs", "1", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    assert "a detector: whole, and its backbone alone (:backbone)" in capsys.readouterr().out
    # 4 passes x (warm-up, timed) x (plain, clocked); a classifier's forward never runs
    assert calls["fine_features"] >= 16 and calls["forward"] == 0
    data = json.loads(out.read_text())
    models = data["batches"][0]["models"]
    assert set(models) == {"full", "split@0.60", "full:backbone", "split@0.60:backbone"}
    assert data["stages"][-4:] == ["pyramid", "proposals", "roi_heads", "paste"]
    whole, alone = models["split@0.60"], models["split@0.60:backbone"]
    assert 0.0 < whole["token_ratio"] == alone["token_ratio"] < 1.0
    assert {"pyramid", "proposals", "roi_heads", "blocks"} <= set(whole["stages_s"])
    assert "blocks" in alone["stages_s"] and not {"pyramid", "roi_heads"} & set(alone["stages_s"])
    # each split pass is compared with full resolution's same part, run by run
    for name, reference in (("split@0.60", "full"), ("split@0.60:backbone", "full:backbone")):
        (full_s,), (split_s,) = models[reference]["runs"]["median_s"], models[name]["runs"]["median_s"]
        assert models[name]["speedup_vs_full"] == pytest.approx(full_s / split_s)


def test_bench_parts_times_a_trained_checkpoint(tmp_path, capsys):
    from splitvit.cli import main

    path = tmp_path / "model.pt"
    tiny_model(**RECIPE).save(path)
    argv = ["bench", "parts", "--checkpoint", str(path), "--batch-sizes", "2", "--repeats", "1", "--ratios", "0.6"]
    argv += ["--threads", "1"]  # torch's threads contend on a busy machine, and --runs 3 (the default) triples it
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"splitvit bench parts: {path}" in printed and "split@0.60" in printed


def test_bench_parts_compiled_and_bf16_compiles_every_side_and_says_so(tmp_path, capsys, monkeypatch):
    """``--bf16 --compile --token-buckets N``: full resolution and every ratio's model run
    their encoders through ``torch.compile`` (its eager backend here: the wiring is under
    test, not the compiler), the split models in N fixed packed sizes; the JSON and the
    printout say how the passes ran."""
    from splitvit.cli import main
    from splitvit.model import splitvit as splitvit_module

    compiled = []
    original = torch.compile

    def eager_compile(fn=None, **options):
        compiled.append(type(fn).__name__)
        return original(fn, backend="eager", dynamic=options.get("dynamic"))

    monkeypatch.setattr(torch, "compile", eager_compile)
    encoded = []
    real_encode = splitvit_module.SplitViT._encode
    monkeypatch.setattr(
        splitvit_module.SplitViT,
        "_encode",
        lambda self, *a, **k: encoded.append(bool(self._compiled_blocks)) or real_encode(self, *a, **k),
    )
    out = tmp_path / "parts.json"
    argv = ["bench", "parts", "--study", "studies/study_fashion.yaml", "--method", "split-0.5-agg-mixed-ctx"]
    argv += ["--batch-sizes", "4", "--ratios", "0.5,0.7", "--repeats", "1", "--threads", "1"]
    argv += ["--bf16", "--compile", "--token-buckets", "2", "--set", "model.policy.depth=1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "bf16 autocast, torch.compile (2 token buckets)" in printed
    assert "split-0.5-agg-mixed-ctx with model.policy.depth=1, random weights" in printed  # the --set named
    data = json.loads(out.read_text())
    assert data["settings"]["bf16"] and data["settings"]["compile"] and data["settings"]["token_buckets"] == 2
    depth = data["model"]["timm_kwargs"]["depth"]
    assert compiled.count("Block") == 3 * depth  # full resolution's dense blocks, and each ratio's
    assert encoded and all(encoded)  # every timed pass ran a compiled encoder
    assert set(data["batches"][0]["models"]) == {"full", "split@0.50", "split@0.70"}


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--study", "studies/study_fashion.yaml"], "--study needs --method"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--method", "full"], "--method and --scale go with --study"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--batch-sizes", "0"], "batch sizes must be positive"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--ratios", "1.5"], "ratios must be token fractions"),
        (["--study", "studies/study_fashion.yaml", "--method", "nope"], "nope"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--token-buckets", "2"], "use them with compile"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--compile", "--token-buckets", "-1"], "token buckets"),
        (["--config", "jobs/configs/fashion_mnist.yaml", "--runs", "0"], "runs must be >= 1"),
    ],
)
def test_bench_parts_bad_input_is_one_line(extra, message, capsys):
    from splitvit.cli import main

    assert main(["bench", "parts", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_ceiling_counts_the_arithmetic_stages_only():
    """Full resolution's pass over the arithmetic stages' time: the policy's heads,
    decisions, gather and packing count as free; a stage the model does not run, as 0."""
    stages = {"embedding": 1.0, "aggregation": 2.0, "policy_blocks": 3.0, "level_context": 4.0, "blocks": 10.0}
    stages |= {"head": 5.0, "policy_head": 100.0, "decision": 100.0, "gather": 100.0, "packing": 100.0}
    assert ceiling_speedup(50.0, stages) == pytest.approx(50.0 / 25.0)
    assert ceiling_speedup(8.0, {"blocks": 3.0, "head": 1.0, "decision": 7.0}) == pytest.approx(2.0)
    assert set(ARITHMETIC_STAGES) == set(STAGES + DETECTOR_STAGES) - {"policy_head", "decision", "gather", "packing"}
    with pytest.raises(ValueError, match="arithmetic stages"):
        ceiling_speedup(1.0, {"decision": 1.0, "gather": 1.0})


def test_runs_are_summarised_by_their_median_and_spread():
    assert across_runs([1.3, 1.21, 1.33]) == {"median": 1.3, "min": 1.21, "max": 1.33}
    assert across_runs([4.0, 1.0, 10.0, 2.0]) == {"median": 3.0, "min": 1.0, "max": 10.0}
    with pytest.raises(ValueError):
        across_runs([])


def test_a_split_models_figures_are_per_run_then_their_median():
    """Each run's speed-up, ceiling and share from that run alone; the figure is their
    median (the median share 0.75 is not the median speed-up over the median ceiling, 0.8)."""
    full, model = [10.0, 12.0, 11.0], [5.0, 8.0, 4.4]  # speed-ups 2, 1.5, 2.5
    stages = [
        {"blocks": 2.0, "embedding": 0.5, "decision": 9.0},  # arithmetic 2.5: ceiling 4
        {"blocks": 5.0, "head": 1.0, "gather": 3.0},  # 6: ceiling 2
        {"blocks": 4.0, "level_context": 0.4, "packing": 1.0},  # 4.4: ceiling 2.5
    ]
    figures = split_figures_across_runs(full, model, stages)
    assert figures.runs["speedup_vs_full"] == pytest.approx([2.0, 1.5, 2.5])
    assert figures.runs["ceiling_speedup"] == pytest.approx([4.0, 2.0, 2.5])
    assert figures.runs["share_of_ceiling"] == pytest.approx([0.5, 0.75, 1.0])
    assert figures.speedup_vs_full == pytest.approx(2.0) and figures.speedup_range == pytest.approx([1.5, 2.5])
    assert figures.ceiling_speedup == pytest.approx(2.5) and figures.ceiling_range == pytest.approx([2.0, 4.0])
    assert figures.share_of_ceiling == pytest.approx(0.75) and figures.share_range == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError, match="one figure per run"):
        split_figures_across_runs(full, model[:2], stages)


def test_parts_settings_need_at_least_one_run():
    assert PartsSettings(runs=1).runs == 1
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        PartsSettings(runs=0)


def test_bench_parts_reports_the_ceiling_and_the_spread_of_its_runs():
    """Two runs of one round each on the tiny recipe: every split model has its ceiling,
    its share of it and the runs' spread, in the JSON and in the printout; full
    resolution has neither."""
    settings = PartsSettings(batch_sizes=(2,), ratios=(0.5,), repeats=1, warmup=0, runs=2, threads=1)
    report = run_parts_benchmark(tiny_model(**RECIPE), settings, "tiny")
    result = report.to_dict()  # the JSON --json writes
    assert result["settings"]["runs"] == 2
    models = result["batches"][0]["models"]
    full, split = models["full"], models["split@0.50"]
    assert len(full["runs"]["median_s"]) == 2 and "ceiling_speedup" not in full and "share_of_ceiling" not in full
    runs = split["runs"]
    assert {"median_s", "speedup_vs_full", "ceiling_speedup", "share_of_ceiling"} <= set(runs)
    assert all(len(values) == 2 for values in runs.values())
    assert split["ceiling_speedup"] >= 0.05  # full resolution's pass over a fraction of a split pass
    assert split["ceiling_speedup"] == pytest.approx(statistics.median(runs["ceiling_speedup"]))
    assert runs["share_of_ceiling"] == pytest.approx(
        [m / c for m, c in zip(runs["speedup_vs_full"], runs["ceiling_speedup"])]
    )
    low, high = split["share_range"]
    assert low == min(runs["share_of_ceiling"]) and high == max(runs["share_of_ceiling"]) and low > 0
    assert split["speedup_range"] == [min(runs["speedup_vs_full"]), max(runs["speedup_vs_full"])]
    printed = format_parts_report(report)
    ceiling_row = next(line for line in printed.splitlines() if line.startswith("ceiling vs full"))
    assert ceiling_row.split()[3:] == ["-", f"{split['ceiling_speedup']:.2f}x"]
    share_row = next(line for line in printed.splitlines() if line.startswith("share of ceiling"))
    assert f"{split['share_of_ceiling']:.0%} ({low * 100:.0f}-{high:.0%})" in share_row
    speed_row = next(line for line in printed.splitlines() if line.startswith("speed-up vs full"))
    assert (
        f"{split['speedup_vs_full']:.2f}x ({split['speedup_range'][0]:.2f}-{split['speedup_range'][1]:.2f})"
        in speed_row
    )


def test_a_result_written_before_runs_and_the_ceiling_prints_as_it_did():
    """A committed measurement (one run, no ceiling) formats to the text committed beside
    it, with no ceiling rows."""
    folder = Path(__file__).resolve().parents[1] / "docs/measurements/cpu-2026-12-05-seg-speed"
    result = PartsReport.from_dict(json.loads((folder / "parts_study_fashion.json").read_text()))
    assert result.settings.runs is None
    printed = format_parts_report(result)
    assert printed == (folder / "parts_study_fashion.txt").read_text().rstrip("\n")
    assert "ceiling" not in printed and "medians of 20 interleaved rounds" in printed


def test_committed_parts_results_read_back_to_the_same_json():
    """Every committed ``bench parts`` result, of every version (before ``runs``, before
    the precision settings), reads back and writes out the same (the envelope aside)."""
    envelope = {"command", "error", "mlflow", "status", "wall_time_s"}
    paths = [
        path
        for path in sorted((Path(__file__).resolve().parents[1] / "docs/measurements").rglob("*.json"))
        if '"benchmark": "parts"' in path.read_text()
    ]
    assert len(paths) >= 20
    for path in paths:
        data = {k: v for k, v in json.loads(path.read_text()).items() if k not in envelope}
        assert PartsReport.from_dict(data).to_dict() == data, path


def test_identity_normalisation_is_skipped_and_noticed_when_the_buffers_change():
    """Mean 0 and std 1 (a model trained on the pixels as they are): the images pass as
    they are; a write to the buffers or a load with timm's values is seen at once."""
    model = tiny_model()  # normalize="auto" without timm weights: mean 0, std 1
    images = torch.rand(2, 3, 32, 32)
    assert model.normalize(images) is images
    with torch.no_grad():
        model.input_std.fill_(0.5)
    assert torch.equal(model.normalize(images), images / 0.5)
    state = model.state_dict()
    state["input_std"] = torch.ones_like(state["input_std"])
    model.load_state_dict(state)
    assert model.normalize(images) is images
    timm_stats = {**state, "input_mean": torch.full_like(state["input_mean"], 0.25)}
    model.load_state_dict(timm_stats)
    assert torch.equal(model.normalize(images), images - 0.25)
