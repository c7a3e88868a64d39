"""How fast `splitvit` reports a mistake: each bad-input case run as a user runs it
(a fresh `python -m splitvit.cli` process from the repository root), its seconds,
exit status and error line.

    python scripts/error_latency.py [--repeat N]

The goal (issues 37 and 61): every mistake that the command line, a config, a
search-space or study file, or the local files show is one line, exit 2, within 3
seconds on a 2-core machine, leaving nothing behind, because it is found before torch,
Ray and MLflow load; an MLflow server that does not answer is said as fast (one
request, no retries). Each case runs in a fresh folder holding only its own files. The
script prints the seconds; it exits 1 only when a case's exit status or message is
wrong, or it left something behind (the time is reported, never asserted: machines
differ). `tests/test_error_latency.py` runs the same cases in-process and checks their
messages, exit statuses and folders.
"""

from __future__ import annotations

import argparse
import socket
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
    """One mistake: the command line (``{tmp}`` is a fresh folder holding only the case's
    ``files``, name -> text; ``{dead}`` an http URL on 127.0.0.1 where nothing listens)
    and a piece of the one error line it must print."""

    name: str
    argv: tuple[str, ...]
    message: str
    files: tuple[tuple[str, str], ...] = ()


#: A COCO file whose ``images`` is an object, not a list (found before torch loads).
BAD_COCO = '{"images": {"1": "a.jpg"}, "annotations": [], "categories": []}'
#: ``data.options`` of a COCO training run on that file.
COCO_OPTIONS = (
    "data.options={train_annotations: {tmp}/bad.json, train_images: {tmp}, "
    "val_annotations: {tmp}/bad.json, val_images: {tmp}}"
)


CASES = (
    Case("config file missing", ("train", "jobs/configs/no_such.yaml"), "config file jobs/configs/no_such.yaml does"),
    Case("config value out of range", ("train", "jobs/configs/smoke.yaml", "train.epochs=-1"), "train.epochs: must be"),
    Case("config key misspelt", ("train", "jobs/configs/smoke.yaml", "model.polcy=learned"), "did you mean"),
    Case("dataset name misspelt", ("train", "jobs/configs/smoke.yaml", "data.name=synthetc"), "unknown dataset"),
    Case(
        "policy name misspelt",
        ("sweep", "search_spaces/smoke.yaml", "--set", "model.policy.kind=lerned"),
        "parameters.model.policy.kind: must be one of learned, entropy, random, full, coarse, got 'lerned'",
    ),
    Case("--json under a file", ("train", "jobs/configs/smoke.yaml", "--json", "/dev/null/r.json"), "is not a folder"),
    Case(
        "sweep setting out of range",
        ("sweep", "search_spaces/smoke.yaml", "--set", "search.num_samples=0"),
        "search.num_samples: must be >= 1",
    ),
    Case(
        "sweep asks for ASHA",
        ("sweep", "search_spaces/smoke.yaml", "--set", "search.scheduler=asha"),
        "search.scheduler: ASHA is refused",
    ),
    Case(
        "sweep NSGA-II never evolves",
        ("sweep", "search_spaces/smoke.yaml", "--set", "search.sampler=nsga2"),
        "never evolves: that is random search",
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
    Case(
        "recipe unknown", ("train", "jobs/configs/smoke.yaml", "--set", "recipe=fast"), "unknown recipe 'fast'; known:"
    ),
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
    # issue 61: what the files and the options show, before torch, Ray and MLflow load
    Case("config file empty", ("train", "{tmp}/empty.yaml"), "empty.yaml: the file is empty", (("empty.yaml", ""),)),
    Case(
        "config file comments only",
        ("train", "{tmp}/notes.yaml"),
        "notes.yaml: the file is empty (or only comments)",
        (("notes.yaml", "# model: to do\n# data: to do\n"),),
    ),
    Case(
        "train: tracking scheme unknown",
        ("train", "jobs/configs/smoke.yaml", "--tracking-uri", "foo://bar"),
        "MLflow has no tracking store for scheme 'foo'",
    ),
    Case(
        "pareto: tracking scheme unknown",
        ("pareto", "sweeps", "--tracking-uri", "foo://bar"),
        "MLflow has no tracking store for scheme 'foo'",
    ),
    Case(
        "eval: MLflow server down",
        ("eval", "models:/smoke@best", "--tracking-uri", "{dead}"),
        "no MLflow server answers at http://127.0.0.1:",
    ),
    Case("pareto: MLflow server down", ("pareto", "sweeps", "--tracking-uri", "{dead}"), "no MLflow server answers"),
    Case("eval --samples -3", ("eval", "{tmp}/ckpt", "--samples", "-3"), "--samples: must be >= 1, got -3"),
    Case("eval --samples 0", ("eval", "{tmp}/ckpt", "--samples", "0"), "--samples: must be >= 1, got 0"),
    Case("eval --batch-size 0", ("eval", "{tmp}/ckpt", "--batch-size", "0"), "--batch-size: must be >= 1, got 0"),
    Case("eval policy misspelt", ("eval", "{tmp}/ckpt", "--policy", "lerned"), "--policy: unknown policy 'lerned'"),
    Case("eval device unknown", ("eval", "{tmp}/ckpt", "--device", "gpu"), "--device: expected cpu, cuda"),
    Case("viz dataset misspelt", ("viz", "--dataset", "synthetc"), "--dataset: unknown dataset 'synthetc'"),
    Case("viz threshold over 1", ("viz", "--thresholds", "0.5,1.5"), "thresholds[1] = 1.5 is outside [0, 1]"),
    Case("viz --out in no folder", ("viz", "--out", "{tmp}/none/maps.png"), "--out: folder"),
    Case(
        "prepare --image-size -8",
        ("data", "prepare", "synthetic", "--out", "{tmp}/shards", "--image-size", "-8"),
        "--image-size: must be >= 1, got -8",
    ),
    Case(
        "prepare --image-size 0",
        ("data", "prepare", "synthetic", "--out", "{tmp}/shards", "--image-size", "0"),
        "--image-size: must be >= 1, got 0",
    ),
    Case(
        "prepare --workers -2",
        ("data", "prepare", "synthetic", "--out", "{tmp}/shards", "--workers", "-2"),
        "--workers: must be >= 0, got -2",
    ),
    Case(
        "prepare coco: malformed file",
        (
            "data",
            "prepare",
            "coco",
            "--out",
            "{tmp}/shards",
            *("--option", "train_annotations={tmp}/bad.json", "--option", "train_images={tmp}"),
        ),
        "bad.json: top-level key 'images' must be a list of objects",
        (("bad.json", BAD_COCO),),
    ),
    Case(
        "train coco: malformed file",
        (
            "train",
            "jobs/configs/smoke.yaml",
            *("data.name=coco", "model.task=detection", "recipe=detection", COCO_OPTIONS, "storage.path={tmp}/runs"),
        ),
        "bad.json: top-level key 'images' must be a list of objects",
        (("bad.json", BAD_COCO),),
    ),
    Case("sweep --name a/b", ("sweep", "search_spaces/smoke.yaml", "--name", "a/b"), "--name: must be one folder"),
    Case("sweep --name ..", ("sweep", "search_spaces/smoke.yaml", "--name", ".."), "--name: must be one folder"),
    Case(
        "sweep --resume of no sweep",
        ("sweep", "search_spaces/smoke.yaml", "--resume", "--name", "never", "--set", "storage.path={tmp}"),
        "never holds no sweep to resume",
    ),
    Case(
        "sweep --name of a sweep there",
        ("sweep", "search_spaces/smoke.yaml", "--name", "taken", "--set", "storage.path={tmp}"),
        "already exists: pass --resume to continue it",
        (("taken/tuner.pkl", ""),),
    ),
    Case("study --name a/b", ("study", "studies/study_fashion.yaml", "--name", "a/b"), "--name: must be one folder"),
    Case(
        "thresholds per level wrong",
        ("train", "jobs/configs/smoke.yaml", "model.thresholds=[0.5, 0.5, 0.5]"),
        "model.thresholds: expected 2 values",
    ),
    Case(
        "image size the patch misses",
        ("train", "jobs/configs/smoke.yaml", "model.image_size=40"),
        "not a multiple of the coarsest patch 16",
    ),
    Case(
        "image size the named patch misses",
        (
            "train",
            "jobs/configs/smoke.yaml",
            *("model.timm_kwargs={embed_dim: 32, depth: 2, num_heads: 2}", "model.image_size=48"),
        ),
        "coarsest patch 64 (patch_size 16",  # vit_tiny_patch16_224: 16 * 2**(3-1)
    ),
    Case(
        "study storage under a file",
        ("study", "studies/study_fashion.yaml", "--set", "storage.path=/dev/null/runs"),
        "storage.path: cannot write to /dev/null/runs",
    ),
    Case(
        "train: MLflow server down",
        ("train", "jobs/configs/smoke.yaml", "--tracking-uri", "{dead}", "--set", "storage.path={tmp}/runs"),
        "no MLflow server answers at http://127.0.0.1:",
    ),
    Case(
        "storage path under a file",
        ("train", "jobs/configs/smoke.yaml", "storage.path=/dev/null/runs"),
        "storage.path: cannot write to /dev/null/runs",
    ),
    Case(
        "Ray address malformed",
        ("train", "jobs/configs/smoke.yaml", "--address", "head-node"),
        "--address: 'head-node' is not a Ray address",
    ),
)


def dead_url() -> str:
    """``http://127.0.0.1:PORT`` where nothing listens: a port bound and closed again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_files(case: Case, tmp: str) -> None:
    """The case's own files into ``tmp`` (``{tmp}`` in their text filled in)."""
    for name, text in case.files:
        (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / name).write_text(text.replace("{tmp}", tmp))


def argv_of(case: Case, tmp: str, dead: str = "http://127.0.0.1:9") -> list[str]:
    """The case's command line with ``{tmp}`` and ``{dead}`` filled in."""
    return [arg.replace("{tmp}", tmp).replace("{dead}", dead) for arg in case.argv]


def left_behind(case: Case, tmp: str) -> list[str]:
    """What is in ``tmp`` beyond the case's own files: what the command left behind."""
    own = {Path(tmp, name) for name in dict(case.files)}
    own |= {parent for path in own for parent in path.parents}
    return sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*") if p not in own)


def run_case(case: Case, tmp: str) -> tuple[float, int, str]:
    """``(seconds, exit status, last stderr line)`` of the case in a fresh process."""
    write_files(case, tmp)
    argv = argv_of(case, tmp, dead_url())
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "splitvit.cli", *argv],
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
    for case in CASES:
        runs, left = [], []
        for _ in range(max(args.repeat, 1)):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_case(case, tmp))
                left = left_behind(case, tmp)
        seconds = statistics.median(r[0] for r in runs)
        _, code, line = runs[-1]
        ok = code == 2 and case.message in line and not left
        wrong += not ok
        flag = "" if ok else "  <- WRONG (expected exit 2 and: " + case.message + ")"
        flag += f"  <- LEFT {', '.join(left)}" if left else ""
        slow = " (over the goal)" if seconds > GOAL_SECONDS else ""
        print(f"{case.name:34} {seconds:8.2f} {code:>4}  {line[:110]}{slow}{flag}")
    print(f"goal: every case within {GOAL_SECONDS:.0f} s, exit 2, one line; {len(CASES) - wrong}/{len(CASES)} right")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
