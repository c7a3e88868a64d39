"""``splitvit bench`` on a tiny model: structure and internal consistency, no timing thresholds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from splitvit.bench import (
    OVERHEAD_TARGET,
    POLICY_SHARE_TARGET,
    SPEEDUP_TARGET,
    benchmark_images,
    build_benchmark_models,
    format_report,
    measure_memory,
    run_forward_benchmark,
    time_interleaved,
)

from .helpers import walk_numbers

TINY = dict(embed_dim=32, depth=2, num_heads=2)
BATCH = 4


@pytest.fixture(scope="module")
def result() -> dict:
    torch.manual_seed(0)
    return run_forward_benchmark(
        batch_size=BATCH, image_size=64, patch_size=8, levels=3, repeats=2, warmup=0,
        timm_kwargs=TINY, num_classes=10, memory=("profiler",),
    )


def test_structure_and_json(result):
    for key in ("config", "machine", "tokens", "timings", "ideal", "ratios", "ratios_fastest", "ratios_cpu_time", "memory", "checks",
                "targets", "warnings"):
        assert key in result, key
    json.dumps(result, allow_nan=False)  # JSON-serialisable, every number finite
    for path, value in walk_numbers(result):
        assert math.isfinite(value), path
    machine = result["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch_version"] == torch.__version__ and machine["device"] == "cpu"
    cfg = result["config"]
    assert cfg["full_tokens"] == (64 // 8) ** 2 and cfg["min_tokens"] == (64 // 32) ** 2
    assert cfg["embed_dim"] == 32 and cfg["depth"] == 2 and cfg["batch_size"] == BATCH


def test_timings_positive_and_consistent(result):
    expected = {"timm", "split_full", "learned_packed", "learned_padded_b1", "learned_padded_b4", "entropy_packed",
                "entropy_padded_b1", "entropy_padded_b4", "policy_learned", "policy_entropy", "seq_full", "seq_learned",
                "seq_entropy"}
    assert set(result["timings"]) == expected
    for name, t in result["timings"].items():
        assert len(t["samples_s"]) == result["config"]["repeats"]
        assert all(s > 0 for s in t["samples_s"]), name
        assert t["min_s"] <= t["median_s"] <= t["max_s"]
        assert t["images_per_s"] == pytest.approx(BATCH / t["median_s"])
        assert len(t["cpu_samples_s"]) == result["config"]["repeats"] and t["cpu_median_s"] >= 0


def test_tokens_near_budget_and_padding(result):
    tokens, full = result["tokens"], result["config"]["full_tokens"]
    assert tokens["timm"]["fraction"] == 1.0 and tokens["split_full"]["mean"] == full
    assert tokens["split_full"]["padding_waste"] == 0.0
    for policy in ("learned", "entropy"):
        packed, b1, b4 = tokens[f"{policy}_packed"], tokens[f"{policy}_padded_b1"], tokens[f"{policy}_padded_b4"]
        assert abs(packed["fraction"] - 0.5) < 0.1, (policy, packed["fraction"])
        assert packed["mean"] == b1["mean"] == b4["mean"]  # same policy object, same decisions
        for t in (packed, b1, b4):
            assert t["min"] <= t["mean"] <= t["max"] <= full
            assert t["attention_slots"] >= t["padded_slots"] >= t["real_tokens"] == round(t["mean"] * BATCH)
            assert t["padding_waste"] == pytest.approx((t["padded_slots"] - t["real_tokens"]) / t["real_tokens"])
            assert t["attention_padding_waste"] == pytest.approx((t["attention_slots"] - t["real_tokens"]) / t["real_tokens"])
        assert packed["padded_slots"] == packed["real_tokens"]  # packed: no padding outside attention
        assert packed["attention_slots"] <= b1["attention_slots"]
        assert b1["padded_slots"] == b1["attention_slots"] == b1["max"] * BATCH  # one bucket: all padded to the longest
        assert b4["padded_slots"] <= b1["padded_slots"]


def test_ideal_and_ratios_from_measured_values(result):
    med = {name: t["median_s"] for name, t in result["timings"].items()}
    ratios = result["ratios"]
    assert ratios["split_full_overhead"] == pytest.approx(med["split_full"] / med["timm"] - 1)
    for policy in ("learned", "entropy"):
        ideal = result["ideal"][policy]
        assert ideal["sequence_tokens"] == max(1, round(result["tokens"][f"{policy}_packed"]["mean"]))
        assert ideal["seq_full_s"] == med["seq_full"] and ideal["seq_split_s"] == med[f"seq_{policy}"]
        assert ideal["ratio"] == pytest.approx(med["seq_full"] / med[f"seq_{policy}"])
        for key in (f"{policy}_packed", f"{policy}_padded_b1", f"{policy}_padded_b4"):
            assert ratios[f"{key}_speedup_vs_timm"] == pytest.approx(med["timm"] / med[key])
            assert ratios[f"{key}_efficiency"] == pytest.approx(med["timm"] / med[key] / ideal["ratio"])
        assert ratios[f"policy_{policy}_share"] == pytest.approx(med[f"policy_{policy}"] / med[f"{policy}_packed"])
    fastest = {name: t["min_s"] for name, t in result["timings"].items()}
    assert result["ratios_fastest"]["split_full_overhead"] == pytest.approx(fastest["split_full"] / fastest["timm"] - 1)
    assert result["ratios_fastest"]["learned_padded_b4_speedup_vs_timm"] == pytest.approx(
        fastest["timm"] / fastest["learned_padded_b4"])
    cpu = {name: t["cpu_median_s"] for name, t in result["timings"].items()}
    assert result["ratios_cpu_time"]["entropy_packed_speedup_vs_timm"] == pytest.approx(cpu["timm"] / cpu["entropy_packed"])
    # the full policy is timm's own forward
    assert result["checks"]["split_full_vs_timm_max_abs_logit_diff"] < 1e-4


def test_targets_report_what_was_measured(result):
    targets = result["targets"]
    assert [t["key"] for t in targets].count("a") == 1
    assert [t["key"] for t in targets].count("b") == 2 and [t["key"] for t in targets].count("c") == 2
    assert all("(packed)" in t["what"] for t in targets if t["key"] == "b")  # the default path is judged
    bounds = {"a": OVERHEAD_TARGET, "b": SPEEDUP_TARGET, "c": POLICY_SHARE_TARGET}
    for t in targets:
        assert t["bound"] == bounds[t["key"]]
        assert t["passed"] == (t["value"] <= t["bound"] if t["op"] == "<=" else t["value"] >= t["bound"])
        rounds = t["per_round"]
        assert len(rounds["values"]) == result["config"]["repeats"]
        assert min(rounds["values"]) <= rounds["q1"] <= rounds["median"] <= rounds["q3"] <= max(rounds["values"])
    samples = {name: t["samples_s"] for name, t in result["timings"].items()}
    overhead = next(t for t in targets if t["key"] == "a")
    assert overhead["per_round"]["values"] == pytest.approx([f / t - 1 for f, t in zip(samples["split_full"], samples["timm"])])
    report = format_report(result)
    assert report.count("PASS") + report.count("MISS") == len(targets)
    for label in ("timm ViT (full res)", "SplitViT full", "SplitViT learned packed", "SplitViT entropy padded buckets=4",
                  "attn pad", "entropy split_scores",
                  "ideal speed-up", "fastest round", "process CPU time", "d. peak memory", "profiler"):
        assert label in report


def test_profiler_memory(result):
    memory = result["memory"]
    assert set(memory["methods"]) == {"profiler"}
    assert set(memory["models"]) == {"timm", "split_full", "learned_packed", "learned_padded_b1", "learned_padded_b4",
                                     "entropy_packed", "entropy_padded_b1", "entropy_padded_b4"}
    for name, m in memory["models"].items():
        assert m["profiler_peak"] > 0, name


def test_rss_memory_probe_in_fresh_subprocess():
    vit, _ = build_benchmark_models(image_size=32, levels=2, timm_kwargs=TINY, num_classes=10)
    out = measure_memory({"timm": (vit, "timm")}, benchmark_images(2, 32), methods=("rss",))
    m = out["models"]["timm"]
    assert "rss" in out["methods"]
    assert m["rss_before"] > 0 and m["rss_peak"] >= m["rss_before"] and m["rss_growth"] == m["rss_peak"] - m["rss_before"]


def test_interleaving_and_validation():
    calls: list[str] = []
    cpu: dict[str, list[float]] = {}
    samples = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1, cpu_samples=cpu
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then A,B / B,A / A,B
    assert all(len(s) == 3 for s in samples.values()) and all(len(s) == 3 for s in cpu.values())
    with pytest.raises(ValueError, match="target_ratio"):
        run_forward_benchmark(target_ratio=0.0)
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved({"a": lambda: None}, repeats=0, warmup=0)
