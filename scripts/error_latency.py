"""How fast `splitvit` reports a mistake: each bad-input case run as a user runs it
(a fresh `python -m splitvit.cli` process from the repository root), its seconds,
exit status and error line.

    python scripts/error_latency.py [--repeat N]

The goal (issue 37): every mistake that the command line, a config, a search-space or
study file, or the local files show is one line, exit 2, within 3 seconds on a
2-core machine, because it is found before torch, Ray and MLflow load. The script
prints the seconds; it exits 1 only when a case's exit status or message is wrong
(the time is reported, never asserted: machines differ). `tests/test_error_latency.py`
runs the same cases in-process and checks their messages and exit statuses.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_SECONDS = 3.0


@dataclass(frozen=True)
class Case:
    """One mistake: the command line (``{tmp}`` is a fresh empty folder) and a piece of
    the one error line it must print."""

    name: str
    argv: tuple[str, ...]
    message: str


CASES = (
    Case("config file missing", ("train", "jobs/configs/no_such.yaml"), "config file jobs/configs/no_such.yaml does"),
    Case("config value out of range", ("train", "jobs/configs/smoke.yaml", "train.epochs=-1"), "train.epochs: must be"),
    Case("config key misspelt", ("train", "jobs/configs/smoke.yaml", "model.polcy=learned"), "did you mean"),
    Case("dataset name misspelt", ("train", "jobs/configs/smoke.yaml", "data.name=synthetc"), "unknown dataset"),
    Case(
        "policy name misspelt",
        ("sweep", "search_spaces/smoke.yaml", "--set", "model.policy=lerned"),
        "unknown policy 'lerned'",
    ),
    Case("--json under a file", ("train", "jobs/configs/smoke.yaml", "--json", "/dev/null/r.json"), "is not a folder"),
    Case(
        "sweep setting out of range",
        ("sweep", "search_spaces/smoke.yaml", "--set", "search.num_samples=0"),
        "search.num_samples: must be >= 1",
    ),
    Case(
        "sweep fixes a misspelt key",
        ("sweep", "search_spaces/smoke.yaml", "--set", "train.lrr=0.1"),
        "train.lrr: unknown key; did you mean train.lr?",
    ),
    Case(
        "study method misspelt",
        ("study", "studies/study_fashion.yaml", "--methods", "ful,coarse"),
        "no method 'ful' (asked for by --methods)",
    ),
    Case("study scale unknown", ("study", "studies/study_fashion.yaml", "--scale", "huge"), "no scale 'huge'"),
    Case(
        "study references from nowhere",
        ("study", "studies/study_fashion.yaml", "--references-from", "no_such_study", "--set", "storage.path={tmp}"),
        "no_such_study",
    ),
    Case("viz --count 0", ("viz", "--count", "0"), "--count: must be >= 1, got 0"),
    Case("eval checkpoint missing", ("eval", "{tmp}/no_checkpoint"), "no checkpoint at"),
    Case("pareto store missing", ("pareto", "sweeps", "--tracking-uri", "sqlite:///{tmp}/none.db"), "no MLflow store"),
    Case("recipe unknown", ("train", "jobs/configs/smoke.yaml", "--set", "recipe=fast"), "unknown recipe 'fast'; known:"),
    Case(
        "recipe of another task",
        ("train", "jobs/configs/fashion_det.yaml", "--set", "recipe=classification-v1"),
        "classification-v1 is a classification recipe and this config's model.task is detection",
    ),
    Case(
        "recipe version missing",
        ("sweep", "search_spaces/smoke.yaml", "--set", "recipe=classification-v9"),
        "no version v9 of the classification recipe",
    ),
    Case("recipes show unknown", ("recipes", "show", "detection-v0"), "no version v0 of the detection recipe"),
)


def argv_of(case: Case, tmp: str) -> list[str]:
    """The case's command line with ``{tmp}`` filled in."""
    return [arg.replace("{tmp}", tmp) for arg in case.argv]


def run_case(case: Case, tmp: str) -> tuple[float, int, str]:
    """``(seconds, exit status, last stderr line)`` of the case in a fresh process."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "splitvit.cli", *argv_of(case, tmp)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    seconds = time.perf_counter() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return seconds, done.returncode, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the median is shown")
    args = parser.parse_args(argv)
    wrong = 0
    print(f"{'case':34} {'seconds':>8} {'exit':>4}  error line")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            runs = [run_case(case, tmp) for _ in range(max(args.repeat, 1))]
            seconds = statistics.median(r[0] for r in runs)
            _, code, line = runs[-1]
            ok = code == 2 and case.message in line
            wrong += not ok
            flag = "" if ok else "  <- WRONG (expected exit 2 and: " + case.message + ")"
            slow = " (over the goal)" if seconds > GOAL_SECONDS else ""
            print(f"{case.name:34} {seconds:8.2f} {code:>4}  {line[:110]}{slow}{flag}")
    print(f"goal: every case within {GOAL_SECONDS:.0f} s, exit 2, one line; {len(CASES) - wrong}/{len(CASES)} right")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
