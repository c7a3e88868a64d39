"""The package's shape: every source folder is a package, and the dependency rules of
docs/design.md §2 hold, as the import-linter contracts of pyproject.toml state them
(``make lint`` runs the same check).

Each contract is also checked on a copy of the code given one wrong import, so a
contract that can never break would show.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "platform" / "splitvit"


def _lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """lint-imports on the code under ``root`` (its pyproject.toml, its platform/)."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    command += ["--no-cache", *(arg for c in contracts for arg in ("--contract", c))]
    path = os.pathsep.join(filter(None, [str(root / "platform"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, NO_COLOR="1")  # root's code first
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy_of_the_code(dest: Path) -> Path:
    shutil.copytree(ROOT / "platform", dest / "platform", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest)
    return dest / "platform" / "splitvit"


def test_every_source_folder_is_a_package():
    # setuptools' package find (pyproject.toml) skips a folder without __init__.py: a
    # wheel, the Docker image or a cluster node would lack its modules
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert PACKAGE in folders and len(folders) > 1
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []


def test_the_code_keeps_every_contract():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, wrong_import, contract",
    [
        ("model/splitvit.py", "from ..storage import exists", "layers"),  # model: the config and errors only
        ("config.py", "from .model import names", "layers"),  # config: below the model it configures
        ("config.py", "from .errors import Interrupted", "layers"),  # config: nothing of ours
        ("train/steps.py", "from ..tune import pareto", "layers"),  # an import upwards
        ("bench/timing.py", "from ..cluster import stack", "layers"),  # between independent parts
        ("study/goals.py", "from ..tune import pareto", "layers"),  # the study shares nothing of the sweep's
        ("data/common.py", "from ..errors import Interrupted", "data"),  # data: storage only
        ("tracking/split_maps.py", "from ..model.splitvit import TASKS", "tracking"),  # the quadtree only
        ("tune/pareto.py", "from ..bench import report", "tune"),  # bench's timing of operating points only
        ("tune/pareto.py", "from ..cluster import stack", "tune"),  # cluster's preflight only
    ],
)
def test_a_wrong_import_breaks_its_contract(tmp_path, module, wrong_import, contract):
    path = _copy_of_the_code(tmp_path) / module
    header = "from __future__ import annotations\n"
    text = path.read_text()
    assert header in text
    path.write_text(text.replace(header, f"{header}{wrong_import}  # noqa: F401\n", 1))
    result = _lint_imports(tmp_path, contract)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and f"splitvit.{module.removesuffix('.py').replace('/', '.')} ->" in result.stdout


def test_a_new_part_needs_its_layer(tmp_path):
    new_part = _copy_of_the_code(tmp_path) / "newpart"
    new_part.mkdir()
    (new_part / "__init__.py").write_text('"""A part no contract names yet."""\n')
    result = _lint_imports(tmp_path, "layers")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "splitvit.newpart" in result.stdout and "not listed as layers" in result.stdout
