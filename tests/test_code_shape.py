"""The package's shape rules (issue 60): no function runs over 100 lines, so each reads
on one screen and says what it does by the helpers it calls; no class is built inside a
function (to put off an import, a module of its own is loaded late: ``tune/callback.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "splitvit"
MAX_FUNCTION_LINES = 100


def long_functions(root: Path, limit: int) -> list[str]:
    """``file:line name (N lines)`` of every function or method under ``root`` longer than ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def classes_in_functions(root: Path) -> list[str]:
    """``file:line function.Class`` of every class statement inside a function under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [
                    f"{path.relative_to(root.parent)}:{inner.lineno} {node.name}.{inner.name}"
                    for inner in ast.walk(node)
                    if isinstance(inner, ast.ClassDef)
                ]
    return found


def test_no_function_is_over_100_lines():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_the_rule_finds_a_long_function(tmp_path):
    """The check itself: a 101-line function is reported, a 100-line one is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(99))
    (package / "ok.py").write_text(f"def fits():\n{body}\n")  # 100 lines with its def
    (package / "long.py").write_text(f"def too_long():\n{body}\n    return 0\n")  # 101
    assert long_functions(package, MAX_FUNCTION_LINES) == ["pkg/long.py:1 too_long (101 lines)"]


def test_no_class_is_built_inside_a_function():
    assert classes_in_functions(PACKAGE) == []


def test_the_rule_finds_a_class_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "ok.py").write_text("class Top:\n    def method(self):\n        return 1\n")
    (package / "inner.py").write_text("def make():\n    class Built:\n        pass\n    return Built\n")
    assert classes_in_functions(package) == ["pkg/inner.py:2 make.Built"]
