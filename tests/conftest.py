"""Shared fixtures. Each group of fixtures lives in its own plugin module."""

import os

# Tests never reach the internet or a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test`), the test processes share the machine's cores: torch
# in each (and in what each starts: Ray's workers, `splitvit` subprocesses) gets its
# share of threads, not all of them; oversubscribed OpenMP threads spin and wait, which
# cost 18% more CPU on a 2-core machine (tests/test_learned_policy.py, 2 threads vs 1).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

pytest_plugins = [
    name
    for name in ("tests.fixtures_s3", "tests.fixtures_ray")
    if os.path.exists(os.path.join(os.path.dirname(__file__), name.split(".")[1] + ".py"))
]

# `make test` runs pytest-xdist with --dist loadfile: each test file goes whole to the
# next free process, in collection order. The longest files (seconds on the 2-core
# machine) go first, so that the two processes finish together instead of one waiting
# out a long file handed over last.
LONGEST_FIRST = (  # seconds in two processes, 2026-12-04
    "test_train_ray.py",  # 268
    "test_study.py",  # 204
    "test_detection_study.py",  # 169
    "test_errors.py",  # 168
    "test_sweep.py",  # 147
    "test_learned_policy.py",  # 95
    "test_submit.py",  # 85
    "test_detection_train.py",  # 59
    "test_mlflow_server.py",  # 38
)


def pytest_collection_modifyitems(config, items):
    """Put the longest test files first (a stable sort: each file's own order is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
