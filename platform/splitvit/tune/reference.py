"""The reference a sweep's trials fine-tune from: a search space's ``reference:`` section.

The studies showed what makes SPLIT accurate: a full-resolution model trained once
until it stops improving, then every method fine-tuned from it (APT's protocol). A
sweep does the same: every trial, and every fine-tuned baseline, starts from the
reference's weights (``model.init_from``); a trial Tune starts again continues its
own checkpoint instead (Ray Train V2's idiom: the run's own checkpoint first, the
base weights only for a new run).

The reference is named one of three ways (:class:`~splitvit.tune.space.ReferenceSettings`):
a checkpoint or MLflow model URI, a finished study's reference by study name and
seed, or settings to train one here. A trained one lives under
``<storage path>/references/reference-<digest of its settings>`` and is reused by
every later sweep whose reference settings are the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

from ..config import ExperimentConfig, legacy_flat
from ..jsontypes import JsonObject
from ..storage import exists, join_uri, read_bytes, write_bytes
from .space import SearchSpace, SearchSpaceError

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference.json"  # a trained reference's record, in its run folder
STUDY_RESULT_FILE = "study_result.json"  # a study run's stored result (splitvit.study.runs)
POINTS = 100.0  # a quality fraction in points


@dataclass(frozen=True)
class Reference:
    """A resolved reference.

    Attributes:
        checkpoint: the checkpoint every trial starts from (local path or ``s3://``).
        source: where it came from, for people (``study study_fashion, seed 0``...).
        run_id: its MLflow run, where one is known (the sweep's parent links it).
        history: its per-epoch validation figures, where recorded.
        converged: the convergence check's verdict (``None``: no curve to judge).
        gain_points: its quality's gain over the last ``converge_epochs`` epochs, in points.
        trained: trained by this sweep (not reused).
    """

    checkpoint: str
    source: str
    run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch: figure -> value
    converged: bool | None = None
    gain_points: float | None = None
    trained: bool = False

    def to_dict(self) -> JsonObject:
        """JSON-ready (``sweep.json``'s ``reference``), without the curve's other figures."""
        return {
            "checkpoint": self.checkpoint,
            "source": self.source,
            "run_id": self.run_id,
            "converged": self.converged,
            "gain_points": self.gain_points,
            "epochs": len(self.history),
            "trained": self.trained,
        }


def reference_config(
    space: SearchSpace, storage_root: str, experiment: str, tracking_uri: str | None = None
) -> ExperimentConfig:
    """The config a ``reference: {train: ...}`` trains: the base config with the space's
    fixed values and the section's settings, at full resolution and without a recipe,
    in its own run folder under ``<storage_root>/references`` (named by its settings),
    recorded in the sweep's MLflow store (``tracking_uri``; its own folder's otherwise)
    and experiment."""
    settings = dict(space.reference.train or {})
    layer = {**settings, "recipe": "none", "model.policy.kind": "full", "tracking.experiment": experiment}
    if tracking_uri is not None:
        layer["tracking.tracking_uri"] = tracking_uri
    config = space.config(layer, name="reference")
    digest = _digest(config)
    return space.config(
        {
            **layer,
            "storage.path": join_uri(storage_root, "references"),
            "storage.name": f"reference-{digest}",
        },
        name=f"reference-{digest}",
    )


def _experiment(space: SearchSpace, base: ExperimentConfig) -> str:
    """The sweep's MLflow experiment: a reference trained here is recorded beside its trials."""
    return space.mlflow.experiment or base.tracking.experiment


def _digest(config: ExperimentConfig) -> str:
    """12 hex digits of the settings that make the reference what it is (not where it is
    stored, nor where it is recorded)."""
    flat = {k: v for k, v in config.flat().items() if not k.startswith(("storage.", "tracking.")) and k != "name"}
    flat = legacy_flat(flat)  # the names it had when references were first named: those found again
    text = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def locate_reference(space: SearchSpace, base: ExperimentConfig, tracking_uri: str) -> Reference | None:
    """The reference the space names, found without training: a checkpoint, an MLflow
    model, a study's reference, or a reference an earlier sweep trained with the same
    settings. ``None`` for a ``train`` reference not trained yet. Before Ray starts.

    Raises :class:`SearchSpaceError` naming the ``reference`` key when it names nothing
    usable.
    """
    r = space.reference
    if not r.enabled:
        return None
    root = base.storage.resolved_path()
    if r.checkpoint is not None:
        return _from_checkpoint(space, r.checkpoint, tracking_uri)
    if r.study is not None:
        return _from_study(space, root, r.study, r.seed, tracking_uri)
    config = reference_config(space, root, _experiment(space, base), tracking_uri)
    stored = join_uri(config.storage.run_uri(), REFERENCE_FILE)
    if not exists(stored):
        return None
    record = json.loads(read_bytes(stored))
    source = f"trained earlier ({config.storage.run_uri()})"
    return _judged(space, record["checkpoint"], source, record.get("history"), record.get("run_id"))


def train_reference(space: SearchSpace, base: ExperimentConfig, tracking_uri: str) -> Reference:
    """Train the space's ``reference: {train: ...}`` with Ray Train (its own MLflow run
    in the sweep's store ``tracking_uri`` and experiment) and record it for later sweeps. An interrupted one
    resumes from its latest checkpoint. Raises ``RuntimeError`` when it does not
    complete."""
    from ..train.checkpoints import read_history
    from ..train.ray_trainer import run_training

    config = reference_config(space, base.storage.resolved_path(), _experiment(space, base), tracking_uri)
    log.info("training the reference (full resolution, %d epochs) in %s", config.train.epochs, config.storage.run_uri())
    result = run_training(config)
    if result.status != "completed" or result.checkpoint_uri is None:
        raise RuntimeError(f"the reference did not complete ({result.status}): {result.message}")
    record = {
        "checkpoint": result.checkpoint_uri,
        "run_id": result.mlflow_run_id,
        "history": read_history(result.checkpoint_uri),
        "config": config.flat(redact=True),
    }
    write_bytes(join_uri(config.storage.run_uri(), REFERENCE_FILE), json.dumps(record, default=str).encode())
    source = f"trained here ({config.storage.run_uri()})"
    reference = _judged(space, result.checkpoint_uri, source, record["history"], result.mlflow_run_id)
    return Reference(**{**reference.__dict__, "trained": True})


def check_reference(space: SearchSpace, base: ExperimentConfig, reference: Reference) -> None:
    """The trials' model takes the reference's weights (the same ViT): checked by
    loading them into the base point's model, before any trial starts. Raises
    :class:`SearchSpaceError` naming the reference."""
    from ..train.checkpoints import init_weights
    from ..train.experiment import build_model

    model = build_model(base.model, pretrained=False)
    try:
        init_weights(model, reference.checkpoint)
    except (ValueError, OSError, KeyError) as exc:
        raise SearchSpaceError(
            space.source, "reference", f"{reference.source}: does not fit the trials' model: {exc}"
        ) from None


def _from_checkpoint(space: SearchSpace, uri: str, tracking_uri: str) -> Reference:
    from ..tracking.model_uris import is_model_uri, resolve_model_uri

    if is_model_uri(uri):
        try:
            resolved = resolve_model_uri(uri, tracking_uri)
        except ValueError as exc:
            raise SearchSpaceError(space.source, "reference.checkpoint", str(exc)) from None
        return Reference(resolved.checkpoint, uri, run_id=resolved.run_id)
    if not exists(uri):
        raise SearchSpaceError(
            space.source, "reference.checkpoint", f"no checkpoint at {uri} (a checkpoint folder holding model.pt)"
        )
    return Reference(uri, uri)


def _from_study(space: SearchSpace, root: str, study: str, seed: int, tracking_uri: str) -> Reference:
    run_uri = join_uri(root, study, "train", f"backbone-s{seed}")
    stored = join_uri(run_uri, STUDY_RESULT_FILE)
    if not exists(stored):
        raise SearchSpaceError(
            space.source,
            "reference.study",
            f"no finished reference of study {study!r} for seed {seed} under {root} ({stored} does not exist): "
            f"run `splitvit study STUDY.yaml --name {study}` with this storage path first, or name a checkpoint",
        )
    record = json.loads(read_bytes(stored))
    # the MLflow run that records the reference: its own, where the study recorded one,
    # else the study's parent run (which holds every seed's reference curve)
    run_id = record.get("run_id") or _run_at(tracking_uri, run_uri) or _run_at(tracking_uri, join_uri(root, study))
    return _judged(space, record["checkpoint"], f"study {study}, seed {seed}", record.get("history"), run_id)


def _run_at(tracking_uri: str, run_uri: str) -> str | None:
    """The MLflow run keyed by storage location ``run_uri`` (tag ``splitvit.run_uri``), in
    any experiment of the store; ``None`` when there is none (or no store to ask)."""
    from ..config import redact_uri
    from ..tracking.runs import RUN_URI_TAG, missing_store, mlflow_client

    if missing_store(tracking_uri):
        return None
    quoted = redact_uri(run_uri).replace("\\", "\\\\").replace("'", "\\'")  # as RunTracker.open keys it
    try:
        client = mlflow_client(tracking_uri)
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, filter_string=f"tags.`{RUN_URI_TAG}` = '{quoted}'", max_results=1)
    except Exception as exc:  # noqa: BLE001 - a store that cannot answer: the reference without its run
        log.warning("could not look up the reference's MLflow run in %s: %s", tracking_uri, exc)
        return None
    return runs[0].info.run_id if runs else None


def _judged(
    space: SearchSpace, checkpoint: str, source: str, history: list[dict[str, float]] | None, run_id: str | None
) -> Reference:
    """A reference with its curve (``history``: per-epoch figures, where recorded), its
    MLflow run and the convergence check's verdict."""
    history = list(history or [])
    metric = space.quality_metric
    k = space.reference.converge_epochs
    curve = [float(h[metric]) for h in history if metric in h]
    gain = (curve[-1] - curve[-1 - k]) * POINTS if len(curve) > k else None
    converged = None if gain is None else gain < space.reference.converge_points
    return Reference(checkpoint, source, run_id=run_id, history=history, converged=converged, gain_points=gain)


def convergence_verdict(space: SearchSpace, reference: Reference) -> str:
    """The convergence check's verdict on the reference, in words."""
    r = space.reference
    if reference.gain_points is None:
        return "no recorded curve to judge its convergence by"
    verdict = "converged" if reference.converged else "NOT converged (fine-tuning from it measures less)"
    return (
        f"{verdict}: {reference.gain_points:+.2f} points of {space.quality_metric} over its last "
        f"{r.converge_epochs} epochs (goal < {r.converge_points:g})"
    )


def convergence_line(space: SearchSpace, reference: Reference) -> str:
    """One line on the reference and its convergence, for the console and the MLflow run."""
    return f"reference {reference.source}: {convergence_verdict(space, reference)}"
