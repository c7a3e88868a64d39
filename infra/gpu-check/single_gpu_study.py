"""Run a study file (``studies/study_*.yaml``) on one machine's GPU, without Ray:
for a lent GPU machine that has PyTorch and timm but not the platform's cluster stack
(see ``infra/gpu-check/run.sh``).

The study is the one ``splitvit study`` runs, on the same code path
(:func:`splitvit.study.execute.execute_study`: the same file, scale and overrides, runs,
stored-result reuse, evaluation at matched token ratios, aggregation, goals and speed
comparison); only the executor differs (:mod:`splitvit.study.local`): each run is
trained by ``fit_local`` with the config's phases and schedule, the Ray loop's own
(``splitvit.train.phases``: the policy's lead epochs, the fine-tune, the policy's epochs;
bf16 autocast, AdamW, warm-up + cosine, gradient clipping, auto thresholds calibrated
each epoch; detectors validated by box and mask AP), in a pool of processes that share
the GPU. MLflow only with ``--tracking-uri``. Its JSON has the
shape of ``splitvit study --json`` plus per-run training curves. Running it again on
the same ``--out`` reuses every finished run.

    python infra/gpu-check/single_gpu_study.py studies/study_fashion.yaml --scale one-gpu \
        --out /tmp/study --json /tmp/study/study.json [--backbone-epochs N --method-epochs M] [--workers P]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitvit.study.local import LocalStudyResult


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study")
    parser.add_argument("--scale")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--methods",
        type=lambda v: [m.strip() for m in v.split(",") if m.strip()],
        help="only these of the file's methods (comma-separated)",
    )
    parser.add_argument("--out", required=True, help="folder for the runs, the canvas cache and the figure")
    parser.add_argument("--json", help="write the result (the table, goals, speed, runs with their curves) here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--workers", type=int, default=4, help="runs trained at once on the device (1: in this process)"
    )
    parser.add_argument("--backbone-epochs", type=int)
    parser.add_argument("--method-epochs", type=int)
    parser.add_argument("--eval-samples", type=int, help="evaluate on this many held-out images (default: the study's)")
    parser.add_argument("--name", help="the study's name (default: study-<file>-<scale>)")
    parser.add_argument(
        "--tracking-uri",
        help="record the study in this MLflow store (e.g. sqlite:///runs/mlflow.db); default: no MLflow",
    )
    parser.add_argument(
        "--plan",
        metavar="SMOKE_JSON",
        help="print the largest epochs (backbone twice the methods') whose training fits --budget-s, "
        "from a smaller run's measured images/s and evaluation times, and exit",
    )
    parser.add_argument("--budget-s", type=float, help="with --plan: seconds the study may take")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status: 0, 1 when a
    run failed, 2 for a study that cannot run as asked."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plan and args.budget_s is None:
        parser.error("--plan needs --budget-s (the seconds the study may take)")
    from splitvit.config import ConfigError
    from splitvit.study.local import LocalStudyResult, load_local_study, plan_epochs, run_study_local
    from splitvit.study.spec import StudyError

    started = time.time()
    try:
        spec = load_local_study(
            args.study,
            args.out,
            scale=args.scale,
            overrides=args.set,
            methods=args.methods,
            backbone_epochs=args.backbone_epochs,
            method_epochs=args.method_epochs,
            eval_samples=args.eval_samples,
        )  # bad input stops here
        if args.plan:
            try:
                smoke = LocalStudyResult.from_dict(json.loads(Path(args.plan).read_text()))
                plan = plan_epochs(smoke, spec, args.budget_s, args.workers)
            except ValueError as exc:  # not one epoch fits the budget
                raise StudyError(str(exc)) from None
            print(json.dumps(plan))
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
        local = run_study_local(
            spec,
            args.out,
            device=args.device,
            workers=args.workers,
            name=args.name,
            tracking_uri=args.tracking_uri,
            started=started,
        )
    except (ConfigError, StudyError) as exc:  # the study cannot run as asked: say why
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(local.to_dict(), indent=2, default=float) + "\n")
    _print_table(local)
    return 1 if local.result.failed else 0


def _print_table(local: LocalStudyResult) -> None:
    from splitvit.study.report import lever_lines, reuse_phrase, summary_lines

    result = local.result
    metric = result.metric
    print(
        f"\n{result.name} on {local.machine.get('device_name', local.machine['device'])}: "
        f"{len(result.seeds)} seeds, {len(result.runs)} runs"
        f"{reuse_phrase(result.runs)}, backbone {local.backbone_epochs} + "
        f"method {local.method_epochs} epochs, {result.seconds:.0f} s"
    )
    print(f"{'method':<12}{'ratio':>7}{'tokens':>8}{metric:>10}{'std':>7}{'min':>7}{'max':>7}")
    for r in result.rows:
        ratio = "-" if r.target_ratio is None else f"{r.target_ratio:.2f}"
        print(
            f"{r.method:<12}{ratio:>7}{r.tokens_per_image:>8.1f}{100 * r.quality:>10.1f}"
            f"{100 * r.quality_std:>7.1f}{100 * r.quality_min:>7.1f}{100 * r.quality_max:>7.1f}"
        )
    for line in lever_lines(result.levers, metric):
        print(line)
    for line in summary_lines(result.goals, result.speed, result.failed, result.point_speed, result.runs):
        print(line)
    if result.mlflow_run_id:
        print(f"MLflow: experiment run {result.mlflow_run_id} in {result.tracking_uri}")


if __name__ == "__main__":
    sys.exit(main())
