"""The bad-input cases of scripts/error_latency.py: each is one line naming the
problem, exit 2, found before torch, Ray and MLflow are needed. The script times them
as a user meets them (fresh processes); here they run in-process for their messages,
exit statuses and what each one must not start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitvit.cli import main
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
error_latency = load_script("error_latency.py")


@pytest.mark.parametrize("case", error_latency.CASES, ids=lambda c: c.name)
def test_a_mistake_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    error_latency.write_files(case, str(tmp_path))
    try:
        code = main(error_latency.argv_of(case, str(tmp_path), error_latency.dead_url()))
    except SystemExit as exc:  # argparse's own usage errors exit from the parser
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert case.message in err[-1], err
    # one line: the usage argparse prints above its own error is the parser's, not a traceback
    assert not any("Traceback" in line for line in err), err
    # nothing written beside the case's own files: no store, no run or shard folder, no JSON
    assert error_latency.left_behind(case, str(tmp_path)) == []


def test_the_checks_run_before_torch_ray_and_mlflow_load(tmp_path):
    # a fresh interpreter: every case is reported without importing the heavy libraries
    # at all (a study's misspelt method, an empty config, a malformed COCO file, a dead
    # MLflow server, ...)
    argvs = []
    for i, case in enumerate(error_latency.CASES):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        error_latency.write_files(case, str(folder))
        argvs.append(error_latency.argv_of(case, str(folder), error_latency.dead_url()))
    code = (
        "import json, sys; from splitvit.cli import main\n"
        "def run(argv):\n"
        "    try:\n"
        "        return main(argv)\n"
        "    except SystemExit as exc:\n"
        "        return exc.code\n"
        f"codes = [run(argv) for argv in json.loads({json.dumps(json.dumps(argvs))})]\n"
        "print(sorted(set(codes)), sorted(m for m in ('torch', 'ray', 'mlflow', 'timm') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[2] []", done.stdout + done.stderr


def test_the_script_reports_a_wrong_case(monkeypatch, capsys):
    # the script must be able to say a case is wrong: a message no command prints
    wrong = error_latency.Case("bad expectation", ("viz", "--count", "0"), "a message nobody prints")
    monkeypatch.setattr(error_latency, "CASES", (wrong,))
    assert error_latency.main([]) == 1
    assert "WRONG" in capsys.readouterr().out
