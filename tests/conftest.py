"""Shared fixtures. Each group of fixtures lives in its own plugin module."""

import os

# Tests never reach the internet or a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    name
    for name in ("tests.fixtures_s3", "tests.fixtures_ray")
    if os.path.exists(os.path.join(os.path.dirname(__file__), name.split(".")[1] + ".py"))
]
