"""``splitvit submit``: train, sweep or eval as a Ray job: upload this checkout, follow the log."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .options import common_options
from .output import emit, fail


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit submit`` and its options to the subcommands ``sub``."""
    from ..cluster.submit import ENTRYPOINTS

    p = sub.add_parser(
        "submit",
        parents=[
            common_options(
                "MLflow server the job logs to (default: $MLFLOW_TRACKING_URI, else the local stack's when submitting "
                "there)"
            )
        ],
        help="run train/sweep/eval as a Ray job (JobSubmissionClient): upload this checkout, follow the log, "
        "exit with the job's status",
        description="Options before ENTRY belong to submit; after it, the job's arguments, except submit's own "
        "--address, --working-dir, --env, --pip, --tracking-uri, --submission-id, --log-lines and "
        "--no-wait, which may come anywhere. Exit status: 0 succeeded, 1 failed or stopped, "
        "2 not submitted (no cluster, bad arguments).",
    )
    p.add_argument(
        "--address",
        help="Ray dashboard/job server, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, "
        "$RAY_ADDRESS, else the local stack)",
    )
    p.add_argument("--working-dir", default=".", help="the splitvit checkout to upload (default: .)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the job, repeatable; KEY alone copies it from here",
    )
    p.add_argument(
        "--pip", action="append", default=[], metavar="REQ", help="extra pip requirement for the job, repeatable"
    )
    p.add_argument("--submission-id", help="job id to use (default: Ray picks one)")
    p.add_argument("--log-lines", type=int, default=40, help="lines of the job's log shown when it fails")
    p.add_argument("--no-wait", action="store_true", help="submit, print the job id and return")
    p.add_argument("--json", help="write the job id, status and runtime environment to this JSON file")
    p.add_argument("entry", choices=list(ENTRYPOINTS), metavar="ENTRY", help="train, sweep or eval")
    p.add_argument(
        "job_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the job's arguments, as for `splitvit ENTRY` (e.g. jobs/configs/smoke.yaml --set train.epochs=1)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Submit the job, follow its log unless ``--no-wait``, exit with the job's status."""
    from ..cluster.submit import JobFailed, SubmitError, parse_env, run_job, split_submit_options

    trailing, job_args = split_submit_options(args.job_args)
    for key, value in trailing.items():  # submit's options after the job's arguments
        setattr(args, key, getattr(args, key) + value if key in ("env", "pip") else value)
    try:
        args.log_lines = int(args.log_lines)
    except ValueError:
        raise ValueError(f"--log-lines: expected a number, got {args.log_lines!r}") from None

    if not args.verbose:
        # Ray logs every packaging step of the upload at INFO (its SDK modules set their
        # own level on import, so they are imported first)
        import ray.job_submission  # noqa: F401

        for name in ("ray", "ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk"):
            logging.getLogger(name).setLevel(logging.WARNING)

    def submitted(job_id: str, address: str) -> None:
        if args.no_wait:
            return
        print(
            f"job {job_id} submitted to {address}; following its log (Ctrl-C stops following, not the job)", flush=True
        )

    def sink(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    try:
        result = run_job(
            args.entry,
            job_args,
            address=args.address,
            working_dir=args.working_dir,
            env=parse_env(args.env),
            pip=args.pip,
            tracking_uri=args.tracking_uri,
            submission_id=args.submission_id,
            wait=not args.no_wait,
            sink=sink,
            log_lines=args.log_lines,
            on_submitted=submitted,
        )
    except JobFailed as exc:
        _emit_job(args, exc.result)
        return fail(args, str(exc))
    except SubmitError as exc:
        where = f" (job {exc.job_id})" if exc.job_id else ""
        args.report.error = str(exc)
        print(f"splitvit submit: error{where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        args.report.error = "stopped following; the job keeps running"
        print(
            "\nstopped following; the job keeps running (`ray job status`, `ray job stop` with its id)", file=sys.stderr
        )
        return 130
    if args.no_wait:
        print(f"job {result.job_id} submitted to {result.address}")
        print(f"follow it:  ray job logs -f {result.job_id} --address {result.address}")
    else:
        print(f"job {result.job_id} {result.status} in {result.duration_s:.0f}s")
    if result.tracking_uri:
        print(f"MLflow: {result.to_dict()['tracking_uri']}")
    _emit_job(args, result)
    return 0


def _emit_job(args: argparse.Namespace, result: Any) -> None:
    """A job's outcome into the envelope: Ray's job status as ``job_status``."""
    data = result.to_dict()
    data["job_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    emit(args, data, tracking_uri=result.tracking_uri)
