"""``splitvit bench`` on a tiny model: structure and internal consistency, no timing thresholds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from splitvit.bench.forward import (
    BENCH_POLICIES,
    CPU_SPEEDUP_TARGETS,
    OUTSIDE_BLOCKS_TARGET,
    OVERHEAD_TARGET,
    ForwardReport,
    ForwardSettings,
    benchmark_images,
    benchmark_vit,
    build_benchmark_models,
    format_report,
    point_key,
    run_forward_benchmark,
)
from splitvit.bench.memory import measure_memory
from splitvit.bench.timing import time_interleaved
from splitvit.config import PolicyConfig

from .helpers import walk_numbers

TINY = dict(embed_dim=32, depth=2, num_heads=2)
BATCH = 4
RATIOS = (0.5, 0.7)


@pytest.fixture(scope="module")
def report() -> ForwardReport:
    torch.manual_seed(0)
    return run_forward_benchmark(
        ForwardSettings(
            "vit_tiny_patch16_224",
            image_size=64,
            patch_size=8,
            batch_size=BATCH,
            ratios=RATIOS,
            repeats=2,
            warmup=0,
            policy_width=16,
            buckets=(1, 4),
            timm_kwargs=TINY,
            num_classes=10,
            memory=("profiler",),
        )
    )


@pytest.fixture(scope="module")
def result(report) -> dict:
    """The report's JSON, as ``--json`` writes it."""
    return report.to_dict()


def test_structure_and_json(result):
    for key in ("config", "machine", "timings", "points", "overhead", "memory", "checks", "targets", "warnings"):
        assert key in result, key
    json.dumps(result, allow_nan=False)  # JSON-serialisable, every number finite
    for path, value in walk_numbers(result):
        assert math.isfinite(value), path
    machine = result["machine"]
    assert machine["cpu_count"] >= 1 and machine["device"] == "cpu"
    for key in ("torch_version", "timm_version"):  # named in the report, whichever versions are installed
        assert isinstance(machine[key], str) and machine[key], key
    cfg = result["config"]
    assert cfg["levels"] == 3  # 64 px, 8-px patches: the deepest quadtree that divides the image
    assert cfg["full_tokens"] == (64 // 8) ** 2 and cfg["min_tokens"] == (64 // 32) ** 2
    assert cfg["embed_dim"] == 32 and cfg["depth"] == 2 and cfg["batch_size"] == BATCH
    # one entry per measured ratio and policy, with the figures the issue names
    points = result["points"]
    assert [(p["policy"], p["target_ratio"]) for p in points] == [(pol, r) for pol in BENCH_POLICIES for r in RATIOS]
    for p in points:
        for key in ("token_ratio", "speedup_vs_timm", "ideal_speedup", "breakdown_s", "outside_blocks_share"):
            assert key in p, key


def test_timings_positive_and_consistent(result):
    timings = result["timings"]
    lengths = {max(1, round(p["tokens"]["mean"])) for p in result["points"]} | {result["config"]["full_tokens"]}
    expected = {"timm", "split_full", *(f"seq/{n}" for n in lengths), *(f"policy/{p}" for p in BENCH_POLICIES)}
    for p in result["points"]:
        expected |= {p["key"], f"{p['key']}/encoder", f"{p['key']}/padded_b1", f"{p['key']}/padded_b4"}
    assert set(timings) == expected
    for name, t in timings.items():
        assert len(t["samples_s"]) == result["config"]["repeats"]
        assert all(s > 0 for s in t["samples_s"]), name
        assert t["min_s"] <= t["median_s"] <= t["max_s"]
        assert t["images_per_s"] == pytest.approx(BATCH / t["median_s"])
        assert len(t["cpu_samples_s"]) == result["config"]["repeats"] and t["cpu_median_s"] >= 0


def test_tokens_near_budget_and_padding(result):
    full = result["config"]["full_tokens"]
    for p in result["points"]:
        tokens = p["tokens"]
        assert abs(p["token_ratio"] - p["target_ratio"]) < 0.1, (p["key"], p["token_ratio"])
        assert p["token_ratio"] == tokens["fraction"] and tokens["min"] <= tokens["mean"] <= tokens["max"] <= full
        assert tokens["padded_slots"] == tokens["real_tokens"] == round(tokens["mean"] * BATCH)  # packed: no padding
        b1, b4 = p["padded_tokens"]["b1"], p["padded_tokens"]["b4"]
        assert b1["mean"] == b4["mean"] == tokens["mean"]  # the same policy object, the same decisions
        assert b1["padded_slots"] == b1["max"] * BATCH and b4["padded_slots"] <= b1["padded_slots"]


def test_speedups_ideal_and_breakdown_from_measured_values(result):
    med = {name: t["median_s"] for name, t in result["timings"].items()}
    full = result["config"]["full_tokens"]
    assert result["overhead"]["split_full_vs_timm"] == pytest.approx(med["split_full"] / med["timm"] - 1)
    for p in result["points"]:
        key, n = p["key"], p["sequence_tokens"]
        assert n == max(1, round(p["tokens"]["mean"]))
        assert p["speedup_vs_timm"] == pytest.approx(med["timm"] / med[key])
        assert p["ideal_speedup"] == pytest.approx(med[f"seq/{full}"] / med[f"seq/{n}"])
        assert p["efficiency"] == pytest.approx(p["speedup_vs_timm"] / p["ideal_speedup"])
        b = p["breakdown_s"]
        assert b["forward"] == med[key] and b["policy"] == med[f"policy/{p['policy']}"]
        assert b["blocks_fixed_length"] == med[f"seq/{n}"]
        assert b["attention_packing"] == pytest.approx(med[f"{key}/encoder"] - med[f"seq/{n}"])
        assert sum(v for k, v in b.items() if k != "forward") == pytest.approx(b["forward"])
        assert p["outside_blocks_share"] == pytest.approx((med[key] - med[f"{key}/encoder"]) / med[key])
        assert p["padded_speedup_vs_timm"]["b4"] == pytest.approx(med["timm"] / med[f"{key}/padded_b4"])
    assert result["checks"]["split_full_vs_timm_max_abs_logit_diff"] < 1e-4  # the full policy is timm's own forward


def test_timm_is_given_the_images_the_split_model_normalises():
    """SplitViT normalises its [0, 1] inputs itself; the benchmark's timm ViT is given
    the same images normalised with timm's own data config, so both see one input
    (with the raw images timm's logits would differ)."""
    import timm

    from splitvit.bench.forward import _build_workload

    settings = ForwardSettings(
        "vit_tiny_patch16_224", image_size=32, patch_size=8, batch_size=2, timm_kwargs=TINY, memory=()
    )
    work = _build_workload(settings, torch.device("cpu"))
    config = timm.data.resolve_model_data_config(work.vit)
    mean, std = torch.tensor(config["mean"]).view(1, -1, 1, 1), torch.tensor(config["std"]).view(1, -1, 1, 1)
    assert torch.equal(work.timm_images, (work.images - mean) / std)
    with torch.no_grad():
        split = work.models["split_full"](work.images).logits
        assert (work.vit(work.timm_images) - split).abs().max() < 1e-4
        assert (work.vit(work.images) - split).abs().max() > 1e-3


def test_learned_variants_differ_only_in_the_policys_blocks():
    vit, levels = benchmark_vit("vit_tiny_patch16_224", image_size=48, patch_size=8, timm_kwargs=TINY)
    models = build_benchmark_models(vit, policy=PolicyConfig(width=16, depth=1), levels=levels)
    assert levels == 2  # 48 px, 8-px patches: 32-px coarse patches would not tile it, 16-px ones do
    assert models["learned"].policy.own_blocks and not models["learned_shared"].policy.own_blocks
    assert models["learned"].vit is models["learned_shared"].vit is vit
    assert benchmark_vit("vit_base_patch16_224", timm_kwargs=dict(depth=1))[1] == 2  # 224 px: 32-px coarse patches


def test_targets_report_what_was_measured(result, report):
    targets = result["targets"]
    keys = [t["key"] for t in targets]
    assert keys.count("a") == 1 and keys.count("b") == len(CPU_SPEEDUP_TARGETS) and keys.count("c") == len(RATIOS)
    for t in targets:
        if t["key"] == "b":
            point = next(
                p for p in result["points"] if p["policy"] == "learned" and f"{p['token_ratio']:.0%}" in t["what"]
            )
            assert t["bound"] == CPU_SPEEDUP_TARGETS[point["target_ratio"]] and t["value"] == point["speedup_vs_timm"]
        else:
            assert t["bound"] == {"a": OVERHEAD_TARGET, "c": OUTSIDE_BLOCKS_TARGET}[t["key"]]
        assert t["passed"] == (t["value"] <= t["bound"] if t["op"] == "<=" else t["value"] >= t["bound"])
        rounds = t["per_round"]
        assert len(rounds["values"]) == result["config"]["repeats"]
        assert min(rounds["values"]) <= rounds["q1"] <= rounds["median"] <= rounds["q3"] <= max(rounds["values"])
    samples = {name: t["samples_s"] for name, t in result["timings"].items()}
    overhead = next(t for t in targets if t["key"] == "a")
    per_round = [f / t - 1 for f, t in zip(samples["split_full"], samples["timm"])]
    assert overhead["per_round"]["values"] == pytest.approx(per_round)
    text = format_report(report)
    assert text.count("PASS") + text.count("MISS") == len(targets)
    for label in (
        "timm ViT (full res)",
        "SplitViT full",
        f"SplitViT {point_key('learned', 0.5)}",
        "encoder",
        "padded buckets=4",
        "learned_shared split_scores",
        "outside blocks",
        "ideal =",
        "time breakdown",
        "fastest round",
        "process CPU time",
        "d. peak memory",
        "profiler",
        "1.85x",
    ):
        assert label in text, label


def test_profiler_memory(result):
    memory = result["memory"]
    assert set(memory["methods"]) == {"profiler"}
    assert set(memory["models"]) == {"timm", "split_full", *(point_key(p, 0.5) for p in BENCH_POLICIES)}
    for name, m in memory["models"].items():
        assert m["profiler_peak"] > 0, name


def test_rss_memory_probe_in_fresh_subprocess():
    vit, _ = benchmark_vit("vit_tiny_patch16_224", image_size=32, patch_size=8, timm_kwargs=TINY, num_classes=10)
    out = measure_memory({"timm": (vit, "timm")}, benchmark_images(2, 32), methods=("rss",))
    m = out.models["timm"]
    assert "rss" in out.methods
    assert m["rss_before"] > 0 and m["rss_peak"] >= m["rss_before"]
    assert m["rss_growth"] == m["rss_peak"] - m["rss_before"]


def test_interleaving_and_validation():
    calls: list[str] = []
    cpu: dict[str, list[float]] = {}
    samples = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1, cpu_samples=cpu
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then A,B / B,A / A,B
    assert all(len(s) == 3 for s in samples.values()) and all(len(s) == 3 for s in cpu.values())
    with pytest.raises(ValueError, match="ratios"):
        ForwardSettings(ratios=(0.0,))
    with pytest.raises(ValueError, match="policies"):
        ForwardSettings(policies=("smart",))
    with pytest.raises(ValueError, match="buckets"):
        ForwardSettings(buckets=(0,))
    narrow = ForwardSettings(ratios=[0.5], buckets=[2.0], policy_width=None)  # normalised on construction
    assert narrow.ratios == (0.5,) and narrow.buckets == (2,) and narrow.policies == ("learned", "entropy")
    with pytest.raises(ValueError, match="--model 'not_a_vit'"):
        benchmark_vit("not_a_vit")
    with pytest.raises(ValueError, match="--image-size 40"):
        benchmark_vit("vit_tiny_patch16_224", image_size=40, patch_size=8, timm_kwargs=TINY)
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved({"a": lambda: None}, repeats=0, warmup=0)


def test_fixed_shape_and_compiled_benchmark_runs_every_side_compiled(monkeypatch):
    """``--token-buckets`` and ``--compile``: timm's ViT, the ideal's encoder and the
    packed encoders all go through ``torch.compile`` (here its eager backend: the
    wiring, not the compiler, is under test) and the figures keep their structure."""
    compiled = []
    original = torch.compile

    def eager_compile(fn=None, **options):
        compiled.append((getattr(fn, "__name__", type(fn).__name__), options.get("dynamic")))
        return original(fn, backend="eager", dynamic=options.get("dynamic"))

    monkeypatch.setattr(torch, "compile", eager_compile)
    report = run_forward_benchmark(
        ForwardSettings(
            "vit_tiny_patch16_224",
            image_size=64,
            patch_size=8,
            batch_size=BATCH,
            ratios=(0.5,),
            policies=("entropy",),
            token_buckets=2,
            compile=True,
            repeats=1,
            warmup=0,
            timm_kwargs=TINY,
            num_classes=10,
            memory=(),
        )
    )
    names = [name for name, _ in compiled]
    assert "VisionTransformer" in names and "_encode_sequence" in names
    assert names.count("_before") == names.count("_after") == TINY["depth"]  # every block of the packed encoder
    assert all(dynamic is False for _, dynamic in compiled)  # static shapes: one graph per token bucket
    assert report.config.token_buckets == 2 and report.config.compile is True
    (point,) = report.points
    assert abs(point.token_ratio - 0.5) < 0.1 and point.speedup_vs_timm > 0
    assert "packed sizes in 2 fixed buckets" in format_report(report)


def _tiny_forward_argv(out, option: str) -> list[str]:
    """``splitvit bench forward`` on a tiny 3-level ViT, the learned policy at 50%, with
    ``option``, writing its JSON to ``out``: seconds on the CPU."""
    argv = ["bench", "forward", "--model", "vit_tiny_patch16_224", "--image-size", "64", "--patch-size", "8"]
    argv += ["--embed-dim", "32", "--depth", "2", "--heads", "2", "--batch-size", "2", "--repeats", "1"]
    return argv + ["--policies", "learned", "--ratios", "0.5", "--no-memory", option, "--json", str(out)]


def test_fine_aggregation_is_timed_on_the_policies_models_only(tmp_path, capsys):
    """``splitvit bench forward --fine-aggregation`` builds every split policy's model with the
    coarse tokens' fine-patch aggregation (its cost is what is timed), leaves the
    ``full`` wrapper as timm's own work, and says so in the report and the JSON; the
    option belongs to ``bench forward`` alone."""
    from splitvit.cli import main
    from splitvit.cli.app import build_parser

    vit, levels = benchmark_vit("vit_tiny_patch16_224", image_size=64, patch_size=8, timm_kwargs=TINY)
    models = build_benchmark_models(
        vit, policy=PolicyConfig(width=16), levels=levels, fine_aggregation=True, buckets=(1,)
    )
    assert models["split_full"].fine_aggregation is None
    assert all(m.fine_aggregation is not None for k, m in models.items() if k != "split_full")
    assert build_benchmark_models(vit, policy=PolicyConfig(width=16), levels=levels)["learned"].fine_aggregation is None

    out = tmp_path / "forward.json"
    assert main(_tiny_forward_argv(out, "--fine-aggregation")) == 0
    assert "split policies with fine-patch aggregation" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["fine_aggregation"] is True
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["bench", "train", "--fine-aggregation"])
    assert stopped.value.code == 2 and "unrecognized arguments: --fine-aggregation" in capsys.readouterr().err


def test_level_context_is_timed_on_the_learned_policies_models_only(tmp_path, capsys):
    """``splitvit bench forward --level-context`` gives the learned policies (own blocks and
    shared) level context, not the entropy policy or the ``full`` wrapper, says so in the
    report and the JSON, and on a 2-level quadtree is one error naming the option."""
    from splitvit.cli import main

    vit, levels = benchmark_vit("vit_tiny_patch16_224", image_size=64, patch_size=8, timm_kwargs=TINY)
    models = build_benchmark_models(vit, policy=PolicyConfig(width=16, level_context=True), levels=levels)
    assert {k for k, m in models.items() if m.policy_config.level_context} == {"learned", "learned_shared"}
    assert models["learned"].policy.level_context and models["learned_shared"].policy.level_context

    out = tmp_path / "forward.json"
    assert main(_tiny_forward_argv(out, "--level-context")) == 0
    assert "learned policies score every finer level in context" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["level_context"] is True
    with pytest.raises(ValueError, match="--level-context needs a 3-level quadtree: 48-px images with 8-px"):
        run_forward_benchmark(
            ForwardSettings(
                "vit_tiny_patch16_224", image_size=48, patch_size=8, timm_kwargs=TINY, level_context=True, memory=()
            )
        )


def test_each_benchmarks_defaults_are_its_librarys():
    """``splitvit bench KIND`` states its defaults in its parser (its help shows them
    without importing torch): they are the library's, so a plain command runs what the
    library would."""
    import dataclasses
    import inspect

    from splitvit.bench.data import DataBenchSettings
    from splitvit.bench.training import benchmark_config, run_train_benchmark
    from splitvit.cli.app import build_parser

    parser = build_parser()
    forward = vars(parser.parse_args(["bench", "forward"]))
    settings = {f.name: f.default for f in dataclasses.fields(ForwardSettings)}
    named = {"model": "model_name"}  # option -> setting, where the names differ
    for option in "model image_size patch_size levels policy_depth policy_width batch_size".split():
        assert forward[option] == settings[named.get(option, option)], option
    for option in ("repeats", "token_buckets", "device"):
        assert forward[option] == settings[named.get(option, option)], option
    assert tuple(float(r) for r in forward["ratios"].split(",")) == settings["ratios"]
    assert forward["policies"] is None and settings["policies"] == BENCH_POLICIES  # None: all of them
    assert forward["memory"] is True and settings["memory"] is None  # on: the device's own probes
    assert not any(forward[flag] or settings[flag] for flag in ("compile", "fine_aggregation", "level_context"))

    train = vars(parser.parse_args(["bench", "train"]))
    config = {k: p.default for k, p in inspect.signature(benchmark_config).parameters.items()}
    named = {"model": "model_name", "samples": "train_samples"}
    for (
        option
    ) in "model image_size patch_size levels policy_depth policy_width batch_size teacher teacher_every".split():
        assert train[option] == config[named.get(option, option)], option
    for option in ("epochs", "samples", "val_samples"):
        assert train[option] == config[named.get(option, option)], option
    run = {k: p.default for k, p in inspect.signature(run_train_benchmark).parameters.items()}
    named = {"repeats": "rounds"}
    for option in ("repeats", "ray_rounds", "threads", "skip_epochs", "tracking", "storage", "device"):
        assert train[option] == run[named.get(option, option)], option
    assert tuple(train["parts"].split(",")) == run["parts"]
    assert tuple(train["allocators"].split(",")) == run["allocators"]
    assert train["allocator_rounds"] == run["allocator_rounds"]

    data = vars(parser.parse_args(["bench", "data"]))
    settings = {f.name: f.default for f in dataclasses.fields(DataBenchSettings)}
    named = {"data_uri": "s3_uri", "data_dir": "local_dir"}
    for option in "samples image_size batch_size rows_per_shard row_group_size num_workers cache_row_groups".split():
        assert data[option] == settings[named.get(option, option)], option
    for option in ("global_shuffle", "imagefolder", "data_uri", "data_dir"):
        assert data[option] == settings[named.get(option, option)], option
