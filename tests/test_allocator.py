"""The memory allocators (``splitvit.train.allocator``): the table, finding a library,
the Ray workers' runtime environment (``scaling.allocator``) and ``bench train --parts
allocators`` with one real tiny run whose children report the allocator they ran under."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile

import pytest

from splitvit.bench.allocators import (
    ALLOCATOR_MODELS,
    choose_allocators,
    format_allocator_lines,
    run_allocator_benchmark,
)
from splitvit.bench.training import benchmark_config, run_train_benchmark
from splitvit.config import ConfigError, ScalingConfig
from splitvit.train.allocator import (
    ALLOCATORS,
    DEFAULT_ALLOCATOR,
    AllocatorError,
    loaded_library,
    resolve_allocator_env,
    strip_allocator_env,
    worker_env_vars,
)
from splitvit.train.experiment import experiment_from_dict
from splitvit.train.names import check_names

from .helpers import run_cli

KEEP = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}


def _tiny_config(**overrides):
    return benchmark_config(
        image_size=16,
        patch_size=4,
        levels=2,
        timm_kwargs={"embed_dim": 16, "depth": 1, "num_heads": 1},
        policy_depth=1,
        batch_size=8,
        epochs=2,
        train_samples=16,
        val_samples=8,
        **overrides,
    )


def _with_allocator(name: str):
    raw = _tiny_config().to_dict(redact=False)
    raw["scaling"]["allocator"] = name
    raw["storage"]["path"] = tempfile.mkdtemp(prefix="splitvit-alloc-test-")
    return experiment_from_dict(raw)


def test_the_table_names_each_allocator_and_what_selects_it():
    assert list(ALLOCATORS) == ["glibc", "glibc-keep", "jemalloc", "tcmalloc"]
    assert ScalingConfig().allocator == DEFAULT_ALLOCATOR == "glibc"  # the config's default: nothing changes
    assert ALLOCATORS["glibc"].env == {} and not ALLOCATORS["glibc"].preloads
    assert ALLOCATORS["glibc-keep"].env == KEEP and not ALLOCATORS["glibc-keep"].preloads
    assert (
        ALLOCATORS["jemalloc"].libraries[0] == "libjemalloc.so.2" and ALLOCATORS["jemalloc"].package == "libjemalloc2"
    )
    assert ALLOCATORS["tcmalloc"].libraries[0] == "libtcmalloc_minimal.so.4"
    assert resolve_allocator_env("glibc") == {} and resolve_allocator_env("glibc-keep") == KEEP
    with pytest.raises(AllocatorError, match="unknown allocator 'mimalloc'; expected one of glibc, glibc-keep"):
        resolve_allocator_env("mimalloc")


def test_a_library_not_installed_is_one_error_naming_it_and_where_it_was_looked_for(tmp_path):
    empty, lib = tmp_path / "empty", tmp_path / "lib"
    empty.mkdir()
    lib.mkdir()
    with pytest.raises(AllocatorError) as err:
        resolve_allocator_env("jemalloc", (str(empty),))
    assert "'jemalloc' is not installed" in str(err.value)
    assert str(empty) in str(err.value) and "libjemalloc.so.2" in str(err.value)
    assert "apt-get install libjemalloc2" in str(err.value)
    (lib / "libjemalloc.so.2").write_bytes(b"")
    assert resolve_allocator_env("jemalloc", (str(empty), str(lib))) == {"LD_PRELOAD": str(lib / "libjemalloc.so.2")}
    # the benchmark: named explicitly it stops everything; under "all" it is skipped with a line
    with pytest.raises(AllocatorError, match="'jemalloc' is not installed"):
        choose_allocators(("glibc-keep", "jemalloc"), (str(empty),))
    chosen = choose_allocators(("all",), (str(empty),))
    assert list(chosen.env) == ["glibc", "glibc-keep"]  # the default always, first
    assert [line.split("'")[1] for line in chosen.skipped] == ["jemalloc", "tcmalloc"]
    assert list(choose_allocators(("glibc-keep",)).env) == ["glibc", "glibc-keep"]


def test_a_missing_library_stops_the_benchmark_before_anything_runs(tmp_path, monkeypatch):
    import splitvit.train.allocator as allocator

    monkeypatch.setattr(allocator, "library_dirs", lambda: (str(tmp_path),))
    with pytest.raises(AllocatorError, match=f"'tcmalloc' is not installed: .* in {tmp_path}"):
        run_train_benchmark(_tiny_config(), parts=("steps", "allocators"), allocators=("tcmalloc",))
    # through the command line: one line, exit 2, before any timing
    assert run_cli(["bench", "train", "--parts", "allocators", "--allocators", "mimalloc"]) == 2


def test_ray_workers_get_the_allocators_env_only_when_it_is_set():
    from splitvit.train.ray_trainer import _torch_trainer, worker_runtime_env

    default = _with_allocator("glibc")
    assert worker_runtime_env(default) is None
    trainer = _torch_trainer(default, default.storage.resolved_path(), None, None, None)
    assert not trainer.run_config.worker_runtime_env  # Ray's own default: the workers start as before
    keep = _with_allocator("glibc-keep")
    assert worker_runtime_env(keep) == {"env_vars": KEEP}
    trainer = _torch_trainer(keep, keep.storage.resolved_path(), None, None, None)
    assert trainer.run_config.worker_runtime_env == {"env_vars": KEEP}
    # a preloaded library by its file name: each node's dynamic linker finds its own copy
    assert worker_runtime_env(_with_allocator("jemalloc")) == {"env_vars": {"LD_PRELOAD": "libjemalloc.so.2"}}
    assert worker_env_vars("tcmalloc") == {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}


def test_an_unknown_allocator_is_a_config_error_naming_its_key():
    config = _tiny_config()
    wrong = dataclasses.replace(config, scaling=dataclasses.replace(config.scaling, allocator="mimalloc"))
    with pytest.raises(ConfigError) as err:
        check_names(wrong)
    assert err.value.key == "scaling.allocator" and "expected one of glibc, glibc-keep" in str(err.value)
    check_names(config)


def test_a_preloaded_library_is_found_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 123   /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 124   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert loaded_library("jemalloc", str(maps)) == "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
    assert loaded_library("tcmalloc", str(maps)) is None
    # a library preloaded through its symlink is mapped under the versioned file's name
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 125   /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert loaded_library("tcmalloc", str(maps)) == "/usr/lib/libtcmalloc_minimal.so.4.5.10"
    assert loaded_library("glibc-keep", str(maps)) is None
    env = {"PATH": "/bin", "LD_PRELOAD": "x.so", "MALLOC_ARENA_MAX": "2", "MALLOC_CONF": "y"}
    assert strip_allocator_env(env) == {"PATH": "/bin"}


def test_a_real_tiny_run_under_two_allocators(tmp_path, monkeypatch):
    """Four children (glibc and glibc-keep, the control and SPLIT), each reporting back
    the allocator variables it saw: an inherited one must not leak into them."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # this process's own: stripped from every child
    part = run_allocator_benchmark(_tiny_config(), allocators=("glibc-keep",), rounds=1, threads=1, skip_epochs=1)
    result = part.to_dict()  # the JSON bench train writes under "allocators"
    assert result["config"]["experiment"] == _tiny_config().to_dict(redact=True)  # the config as its JSON
    runs = result["runs"]
    assert [(r["allocator"], r["model"]) for r in runs] == [
        ("glibc", "full"),
        ("glibc", "split"),
        ("glibc-keep", "full"),
        ("glibc-keep", "split"),
    ]
    for run in runs:
        assert run["allocator_env"] == ({} if run["allocator"] == "glibc" else KEEP)
        assert run["preloaded_library"] is None and run["torch_threads"] == 1
        assert [e["epoch"] for e in run["epochs"]] == [0, 1]
        assert run["max_rss_mib"] >= run["max_rss_before_training_mib"] > 0
    assert len({r["pid"] for r in runs}) == 4
    split_runs = [r for r in runs if r["model"] == "split"]
    assert all(r["policy_aim"]["offset"] is not None for r in split_runs)
    assert all(r["steady"]["token_fraction"] < 1.0 for r in split_runs)  # the learned policy did split less
    figures = result["figures"]
    assert set(figures) == {"glibc", "glibc-keep"} and all(set(f) == set(ALLOCATOR_MODELS) for f in figures.values())
    for model in ALLOCATOR_MODELS:
        assert figures["glibc"][model]["ratio_to_default"] == 1.0
        keep = figures["glibc-keep"][model]
        base = figures["glibc"][model]
        assert math.isclose(keep["ratio_to_default"], keep["images_per_s"] / base["images_per_s"])
        assert keep["max_rss_mib"] > 0 and keep["images_per_s_min"] <= keep["images_per_s"] <= keep["images_per_s_max"]
    assert [t["key"] for t in result["targets"]] == ["allocator-glibc-keep-full", "allocator-glibc-keep-split"]
    assert result["warnings"] == [] and result["skipped"] == []
    json.dumps(result)  # the --json envelope takes it
    report = "\n".join(format_allocator_lines(part))
    assert "glibc-keep  split" in report and "peak RSS MiB" in report


@pytest.mark.parametrize("name", ["jemalloc", "tcmalloc"])
def test_the_workers_preload_by_file_name_loads_the_library(name):
    """What a Ray worker gets (:func:`worker_env_vars`) preloads the library where it is
    installed: a fresh process finds it mapped (skipped where it is not installed)."""
    import os
    import subprocess
    import sys

    from splitvit.train.allocator import find_library, get_allocator

    if find_library(get_allocator(name)) is None:
        pytest.skip(f"{name} is not installed here")
    import splitvit

    env = {**strip_allocator_env(dict(os.environ)), **worker_env_vars(name)}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(splitvit.__file__))  # this checkout's package
    code = f"from splitvit.train.allocator import loaded_library; print(loaded_library({name!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert os.path.basename(out.strip()).startswith(get_allocator(name).libraries[0])
