"""What every subcommand reports and prints: the ``--json`` envelope and tables.

A command hands its figures and MLflow ids to :func:`emit`, or its error line to
:func:`fail`; :mod:`.app` writes the envelope (:func:`envelope`) at the end, on
failure too. :func:`print_table` and :func:`frontier_table` print figures as columns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..jsontypes import JsonObject
from ..train.console import environment

#: the envelope's MLflow block; every key is there, None where the command has no such thing
MLFLOW_KEYS = ("tracking_uri", "experiment_id", "run_id", "url")


def write_json(path: str | None, payload: JsonObject) -> None:
    """Write ``payload`` to ``path`` (no-op when ``path`` is None); commands hand their
    figures to :func:`emit` instead, which puts them in the envelope."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


@dataclass
class Report:
    """What one command run reports: its figures, its MLflow ids and its error line.
    ``main`` creates it (``args.report``) and writes it as the envelope at the end."""

    command: str
    payload: JsonObject = field(default_factory=dict)  # the envelope's JSON, as the command built it
    mlflow: dict[str, str] = field(default_factory=dict)  # tracking_uri, experiment_id, run_id: those given
    error: str | None = None


def emit(
    args: argparse.Namespace,
    payload: JsonObject,
    *,
    tracking_uri: str | None = None,
    experiment_id: str | None = None,
    run_id: str | None = None,
) -> None:
    """Hand a command's figures (top-level keys of the envelope) and its MLflow ids
    to the envelope ``main`` writes with ``--json``."""
    report: Report = args.report
    report.payload = dict(payload)
    given = {"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run_id}
    report.mlflow.update({k: v for k, v in given.items() if v is not None})


def fail(args: argparse.Namespace, message: str, code: int = 1) -> int:
    """Print ``splitvit COMMAND: error: MESSAGE``, keep it as the envelope's error, return ``code``."""
    args.report.error = message
    print(f"splitvit {args.report.command}: error: {message}", file=sys.stderr)
    return code


def outcome(code: int) -> str:
    """The envelope's ``status`` for an exit status: ok, interrupted (130/143) or failed."""
    if code == 0:
        return "ok"
    return "interrupted" if code in (130, 143) else "failed"


def mlflow_url(tracking_uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's (else the experiment's) page on an http(s) tracking server; None for a
    local store (a SQLite file or a folder has no page until someone runs ``mlflow ui``)."""
    from ..config import redact_uri

    if not tracking_uri or not tracking_uri.startswith(("http://", "https://")) or not experiment_id:
        return None
    from ..tracking.runs import ui_url

    return ui_url(redact_uri(tracking_uri), experiment_id, run_id)


def _mlflow_block(ids: dict[str, str | None]) -> dict[str, str | None]:
    """The envelope's ``mlflow``: every key of :data:`MLFLOW_KEYS`, the URI redacted."""
    from ..config import redact_uri

    block = {k: ids.get(k) for k in MLFLOW_KEYS}
    if block["run_id"] and not block["experiment_id"] and block["tracking_uri"]:
        # the run knows its experiment: one look-up, no retries, 5 s at most (a server that
        # stopped answering must not hold the command's exit); the envelope is written anyway
        quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
        with contextlib.suppress(Exception), environment(quick):
            import mlflow

            block["experiment_id"] = (
                mlflow.MlflowClient(block["tracking_uri"]).get_run(block["run_id"]).info.experiment_id
            )
    block["url"] = block["url"] or mlflow_url(block["tracking_uri"], block["experiment_id"], block["run_id"])
    if block["tracking_uri"]:
        block["tracking_uri"] = redact_uri(block["tracking_uri"])
    return block


def envelope(report: Report, code: int, wall_time_s: float) -> JsonObject:
    """The JSON every ``--json`` writes: ``command``, ``status`` (:func:`outcome`),
    ``error`` (None, or the one line printed after ``error:``), ``mlflow`` (the keys
    of :data:`MLFLOW_KEYS`, plus a command's own, e.g. the sweep's ``ui``),
    ``wall_time_s`` (the whole command), and the command's figures at the top level.
    The envelope's keys win over a figure of the same name."""
    body = dict(report.payload)
    own = body.pop("mlflow", None) or {}
    status = outcome(code)
    return {
        **body,
        "command": report.command,
        "status": status,
        "error": None if status == "ok" else (report.error or f"exit status {code}"),
        # a command's own url (the sweep's: a local `mlflow ui` page) gives way to the rule above
        "mlflow": {**own, **_mlflow_block({**{k: v for k, v in own.items() if k != "url"}, **report.mlflow})},
        "wall_time_s": round(wall_time_s, 3),
    }


def print_table(rows: list[JsonObject], columns: list[str]) -> None:
    """``rows`` as left-aligned columns under a header line; floats to 4 significant digits."""
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def yaml_text(value: Any) -> str:
    """A setting's value as a YAML file writes it (``true``, ``null``, ``0.5``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def frontier_table(points: list[JsonObject], metric: str) -> None:
    """Frontier points as a table; a point with exact ties (same tokens, same quality,
    other thresholds) says how many, in ``ties`` (the JSON names them)."""
    params = list(dict.fromkeys(k for p in points for k in (p.get("params") or {})))
    rows = []
    for p in points:
        row = {
            "tokens/image": p["tokens_per_image"],
            metric: p[metric],
            "token ratio": p["token_ratio"],
            "kind": p["kind"],
            "trial": p["trial_id"],
            "eval thresholds": ",".join(f"{t:.3f}" for t in p.get("thresholds") or []),
        }
        row.update({k: v for k, v in (p.get("params") or {}).items()})
        row["ties"] = f"+{len(p['ties'])}" if p.get("ties") else ""
        extras = p.get("extras") or {}
        speedup = extras.get("speedup_vs_full")
        row["speed-up"] = f"{speedup:.2f}x" if speedup is not None else "-"
        row[f"test {metric}"] = extras.get(f"test_{metric}", "-")
        row["test ratio"] = extras.get("test_token_ratio", "-")
        rows.append(row)
    timed = any((p.get("extras") or {}).get("speedup_vs_full") is not None for p in points)
    held_out = any(f"test_{metric}" in (p.get("extras") or {}) for p in points)
    columns = [
        "tokens/image",
        metric,
        "token ratio",
        *([f"test {metric}", "test ratio"] if held_out else []),
        *(["speed-up"] if timed else []),
        "kind",
        "trial",
        "eval thresholds",
        *params,
    ]
    print_table(rows, columns + (["ties"] if any(p.get("ties") for p in points) else []))
