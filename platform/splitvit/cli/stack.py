"""``splitvit stack``: the local stack, a Ray head and an MLflow server on 127.0.0.1."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import common_options
from .output import emit, fail


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit stack`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "stack",
        parents=[common_options(None)],
        help="the local stack: a Ray head (dashboard, job server) and an MLflow server on 127.0.0.1",
    )
    ssub = p.add_subparsers(dest="stack_command", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False, parents=[common_options(None)])
    common.add_argument("--state-dir", help="the stack's folder (default: $SPLITVIT_STACK_DIR, else ~/.splitvit/stack)")
    common.add_argument("--json", help="write the stack's status to this JSON file")
    upp = ssub.add_parser("up", parents=[common], help="start the stack, wait until it is healthy, write its addresses")
    upp.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: loopback only)")
    upp.add_argument("--dashboard-port", type=int, default=8265)
    upp.add_argument("--mlflow-port", type=int, default=5000)
    upp.add_argument("--ray-port", type=int, default=6379, help="Ray's GCS port")
    upp.add_argument("--client-port", type=int, help="Ray client server port (default: a free one)")
    upp.add_argument("--agent-port", type=int, help="Ray dashboard agent HTTP port (default: a free one)")
    upp.add_argument("--num-cpus", type=int, help="CPUs the Ray head advertises (default: detected)")
    upp.add_argument("--num-gpus", type=int, help="GPUs the Ray head advertises (default: detected)")
    upp.add_argument("--backend-store-uri", help="MLflow backend store (default: SQLite in the state folder)")
    upp.add_argument(
        "--artifacts-destination", help="where MLflow stores artifacts (default: a folder in the state folder)"
    )
    upp.add_argument("--mlflow-workers", type=int, default=2)
    upp.add_argument("--ray-temp-dir", help="Ray's temp folder (default: <state dir>/ray)")
    upp.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each component's health")
    upp.set_defaults(func=run_up)
    downp = ssub.add_parser("down", parents=[common], help="stop the stack's processes (Ray workers and jobs included)")
    downp.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    downp.set_defaults(func=run_down)
    statp = ssub.add_parser("status", parents=[common], help="report the stack's health (exit 1 when not healthy)")
    statp.set_defaults(func=run_status)


def _print_stack(status) -> None:
    for c in status.components:
        print(f"  {c.name:<15} {'ok  ' if c.healthy else 'FAIL'} {c.detail if not c.healthy else c.url}")
    if status.state is not None:
        s = status.state
        print(f"Ray dashboard and job server: {s.dashboard_url}   (GCS {s.gcs_address})")
        print(
            f"MLflow:                       {s.mlflow_url}   "
            f"(store {s.backend_store_uri}, artifacts {s.artifacts_destination})"
        )
        print(f"runs folder:                  {s.storage_path}")
        print(f"logs:                         {s.logs_dir}")
        print(f"for ray job submit / MLflow:  source {Path(status.state_dir) / 'stack.env'}")


def run_up(args: argparse.Namespace) -> int:
    """Start the stack (or find it running), wait for it to be healthy, print its addresses."""
    from ..cluster.stack import StackError, StackSettings, up

    settings = StackSettings(
        state_dir=Path(args.state_dir) if args.state_dir else None,
        host=args.host,
        dashboard_port=args.dashboard_port,
        mlflow_port=args.mlflow_port,
        ray_port=args.ray_port,
        client_port=args.client_port,
        agent_port=args.agent_port,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        backend_store_uri=args.backend_store_uri,
        artifacts_destination=args.artifacts_destination,
        mlflow_workers=args.mlflow_workers,
        ray_temp_dir=Path(args.ray_temp_dir) if args.ray_temp_dir else None,
        timeout_s=args.timeout,
    )
    try:
        status = up(settings)
    except StackError as exc:
        return fail(args, str(exc))
    print(
        f"stack {'already running' if status.already_running else 'up'} in {status.state_dir}: "
        f"{'healthy' if status.healthy else 'NOT healthy'}"
    )
    _print_stack(status)
    emit(args, status.to_dict())
    if not status.healthy:
        args.report.error = "the stack is not healthy"
    return 0 if status.healthy else 1


def run_down(args: argparse.Namespace) -> int:
    """Stop the stack's processes; exit 1 when it did not stop cleanly."""
    from ..cluster.stack import StackError, down

    try:
        report = down(args.state_dir, grace_s=args.grace)
    except StackError as exc:
        return fail(args, str(exc))
    if not report.was_running:
        print(f"no stack runs in {report.state_dir}")
    else:
        print(f"stack in {report.state_dir} stopped: {report.stopped} processes ended, {report.killed} killed")
        if report.ports_open:
            fail(args, f"ports still open: {report.ports_open}")
    emit(args, report.to_dict())
    if not report.clean and not args.report.error:
        args.report.error = "the stack did not stop cleanly"
    return 0 if report.clean else 1


def run_status(args: argparse.Namespace) -> int:
    """Report the stack's health; exit 1 when it is not healthy."""
    from ..cluster.stack import status as stack_status

    status = stack_status(args.state_dir)
    if status.state is None:
        print(f"no stack runs in {status.state_dir} (start one with `splitvit stack up`)")
    else:
        print(
            f"stack in {status.state_dir}: {'healthy' if status.healthy else 'NOT healthy'}, "
            f"{status.processes} processes"
        )
        _print_stack(status)
    emit(args, status.to_dict())
    if not status.healthy:
        args.report.error = "no stack runs" if status.state is None else "the stack is not healthy"
    return 0 if status.healthy else 1
