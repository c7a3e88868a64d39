"""One MLflow run per training run: params, per-epoch metrics, split maps, the model.

The driver opens (or, for a run resumed under the same name, re-opens) the run and
logs the flattened config as params; rank 0 of the Ray Train workers attaches to it
by id and logs per-epoch metrics, split-map images, final metrics and the model;
the driver closes it with the outcome. These writers never overlap in time, so
the embedded SQLite store (which dislikes concurrent writers) is safe.

Secrets never reach the store: params and tags go through
:func:`splitvit.config.redact_secrets`, and URIs lose their passwords.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import REDACTED, DataConfig, flatten, is_secret_key, redact_secrets, redact_uri, upgrade_flat
from ..jsontypes import JsonObject
from .provenance import provenance_tags

log = logging.getLogger(__name__)

RUN_URI_TAG = "splitvit.run_uri"
STATUS_TAG = "splitvit.status"
MODEL_ID_TAG = "splitvit.model_id"
CHECKPOINT_TAG = "splitvit.checkpoint"
EPOCH_MARKER = "epoch"  # the metric whose history says which epochs are logged
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
MAX_TAG_LENGTH = 5000
PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch
# Tags that sweeps and studies both write on their runs (the sweep's own are in splitvit.tune.mlflow_records)
KIND_TAG = "splitvit.kind"
METRIC_TAG = "splitvit.metric"
SPEED_DEVICE_TAG = "splitvit.speed_device"  # where the frontier was timed (e.g. "cuda:0 (NVIDIA H200)")
SPEED_TIMING_TAG = "splitvit.speed_timing"  # how: batch, rounds, precision
PARENT_TAG = "mlflow.parentRunId"


def mlflow_client(tracking_uri: str):
    """An ``MlflowClient`` of ``tracking_uri`` (mlflow imported only when one is needed)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def prepare_store(tracking_uri: str) -> str | None:
    """Make the folder of a local SQLite store; return the artifact root that belongs
    next to it (``<db folder>/mlartifacts``), or ``None`` for a server (it decides)."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///") :])
        db.parent.mkdir(parents=True, exist_ok=True)
        return (db.parent.resolve() / "mlartifacts").as_uri()
    return None


#: MLflow 3 opens an experiment on its traces page unless it is marked as model training.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: What MLflow 3's UI is told in a link to a run or an experiment: open in its "Model
#: training" view (its default, "GenAI", shows the traces page, which a training run has none of).
UI_VIEW_QUERY = "?workflowType=machine_learning"


def ui_url(host: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI's page of a run (else of the experiment) under ``host``, in its
    *Model training* view."""
    page = f"{host.rstrip('/')}/#/experiments/{experiment_id}"
    return (f"{page}/runs/{run_id}" if run_id else page) + UI_VIEW_QUERY


#: The experiment page's markdown description (as on runs).
EXPERIMENT_NOTE_TAG = "mlflow.note.content"
EXPERIMENT_DESCRIPTION = (
    "**SPLIT** (learned hierarchical patch splitting for faster ViTs): runs made by `splitvit`. "
    "Training runs log accuracy (or mIoU) and tokens per image per epoch; a sweep's parent run "
    "(`tags.splitvit.kind = 'sweep'`) holds its Pareto frontier of quality against tokens."
)


def ensure_experiment(tracking_uri: str, name: str) -> str:
    """The id of experiment ``name``, created (with local artifacts for a local store)
    if missing, and marked as model training (MLflow 3's UI then opens on its runs)
    with a first description; a description someone wrote stays."""
    from mlflow.exceptions import MlflowException

    artifact_root = prepare_store(tracking_uri)
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        _mark_experiment(client, experiment.experiment_id, experiment.tags)
        return experiment.experiment_id
    location = f"{artifact_root}/{name}" if artifact_root else None
    try:
        experiment_id = client.create_experiment(name, artifact_location=location)
    except MlflowException:
        # created meanwhile by another driver
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id
    _mark_experiment(client, experiment_id, {})
    return experiment_id


def _mark_experiment(client, experiment_id: str, tags: dict[str, str]) -> None:
    if tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if not tags.get(EXPERIMENT_NOTE_TAG):
        client.set_experiment_tag(experiment_id, EXPERIMENT_NOTE_TAG, EXPERIMENT_DESCRIPTION)


def describe_experiment(tracking_uri: str, experiment_id: str, markdown: str, tags: dict[str, str]) -> None:
    """Set the experiment's description (markdown, cut to what the store keeps) and tags."""
    client = mlflow_client(tracking_uri)
    if len(markdown) > MAX_TAG_LENGTH:
        markdown = markdown[: MAX_TAG_LENGTH - 40].rsplit("\n", 1)[0] + "\n\n*(cut to fit the store)*"
    client.set_experiment_tag(experiment_id, EXPERIMENT_NOTE_TAG, markdown)
    for key, value in safe_tags(tags).items():
        client.set_experiment_tag(experiment_id, key, value)


def missing_store(tracking_uri: str) -> str | None:
    """Why ``tracking_uri`` names no store on this machine, or ``None`` when it may.

    A local store is checked before any client touches it: MLflow creates a SQLite
    database (or a file store's folder) it is pointed at, so a mistyped path would
    read back as an empty store instead of an error. A server is not checked here
    (only a request can tell); its errors surface from the first call.
    """
    from urllib.parse import unquote, urlparse

    if tracking_uri.startswith("sqlite://"):
        # sqlite:///relative.db, sqlite:////absolute.db; sqlite:// alone is in memory
        path = unquote(tracking_uri[len("sqlite://") :].split("?", 1)[0])
        if path in ("", "/", "/:memory:"):
            return None
        db = Path(path[1:] if path.startswith("/") else path)
        return None if db.is_file() else f"no MLflow store at {redact_uri(tracking_uri)}: {db} does not exist"
    scheme = urlparse(tracking_uri).scheme
    if scheme in ("", "file"):
        folder = Path(unquote(urlparse(tracking_uri).path) if scheme == "file" else tracking_uri)
        return None if folder.is_dir() else f"no MLflow store at {tracking_uri}: {folder} is not a folder"
    return None


def safe_params(params: dict[str, Any]) -> dict[str, str]:
    """Param values as MLflow strings: secrets masked, URIs without passwords, long values cut."""
    out = {}
    for key, value in params.items():
        if is_secret_key(key) and value is not None:
            text = REDACTED
        else:
            text = redact_uri(value) if isinstance(value, str) else ("null" if value is None else str(value))
        out[key] = text[:MAX_PARAM_LENGTH]
    return out


def param_name(key: str) -> str:
    """A parameter name MLflow accepts: ``model.thresholds[0]`` -> ``model.thresholds.0``."""
    return re.sub(r"\[(\d+)\]", r".\1", key)


def flat_params(data: dict[str, Any]) -> dict[str, Any]:
    """A nested settings dict as MLflow params (``search.num_samples``...)."""
    return {param_name(k): json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in flatten(data).items()}


RECIPE_TAG = "splitvit.recipe"
RECIPE_VERSION_TAG = "splitvit.recipe_version"


def recipe_tags(params: dict[str, Any]) -> dict[str, str]:
    """The recipe a run's config ran under (its ``recipe`` param), as tags the runs table
    filters on: ``splitvit.recipe`` (``detection-v1``, or ``none``) and, for a recipe,
    ``splitvit.recipe_version`` (``1``). None for params without a config's."""
    name = params.get("recipe")
    if not isinstance(name, str):
        return {}
    version = name.rpartition("-v")[2]
    return {RECIPE_TAG: name, **({RECIPE_VERSION_TAG: version} if version.isdigit() else {})}


def safe_tags(tags: dict[str, Any]) -> dict[str, str]:
    """Tag values as strings: secret-named tags masked, URIs without passwords, long values cut."""
    return {k: REDACTED if is_secret_key(k) else redact_uri(str(v))[:MAX_TAG_LENGTH] for k, v in tags.items()}


@dataclass
class RunTracker:
    """A handle on one MLflow run; picklable (it holds ids only), so it travels to
    Ray workers in the training loop's config."""

    tracking_uri: str
    experiment_id: str
    run_id: str

    # ------------------------------------------------------------------ driver
    @classmethod
    def open(
        cls,
        tracking_uri: str,
        experiment: str,
        run_uri: str,
        run_name: str,
        params: dict[str, Any],
        tags: dict[str, str] | None = None,
    ) -> tuple[RunTracker, bool]:
        """Open the run of ``run_uri`` (the Ray run folder), or create it.

        A run already tagged with ``run_uri`` (a training run re-started under the
        same name) is re-opened, so its epochs continue the same metric history.
        Returns ``(tracker, resumed)``. Params are logged once; a resumed run with
        changed settings records the changes as the tag ``splitvit.changed_on_resume``.
        """
        from mlflow.entities import Param, RunTag

        client = mlflow_client(tracking_uri)
        experiment_id = ensure_experiment(tracking_uri, experiment)
        safe_uri = redact_uri(run_uri)
        quoted = safe_uri.replace("\\", "\\\\").replace("'", "\\'")
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_URI_TAG}` = '{quoted}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        all_tags = {RUN_URI_TAG: safe_uri, STATUS_TAG: "running", **recipe_tags(params), **safe_tags(tags or {})}
        values = safe_params(params)
        if found:
            run = found[0]
            tracker = cls(tracking_uri, experiment_id, run.info.run_id)
            client.update_run(run.info.run_id, status="RUNNING")
            old = upgrade_flat(dict(run.data.params))  # a run logged before the keys were grouped: new names
            changed = {k: [old.get(k), v] for k, v in values.items() if old.get(k) != v}
            new = [Param(k, v) for k, v in values.items() if k not in old]
            if changed:
                all_tags["splitvit.changed_on_resume"] = json.dumps(
                    {k: c for k, c in changed.items() if c[0] is not None}
                )
            tracker._log_params(new)
            client.log_batch(run.info.run_id, tags=[RunTag(k, v[:MAX_TAG_LENGTH]) for k, v in all_tags.items()])
            log.info("resumed MLflow run %s (%s)", run.info.run_id, safe_uri)
            return tracker, True
        run = client.create_run(experiment_id, run_name=run_name, tags={**provenance_tags(), **all_tags})
        tracker = cls(tracking_uri, experiment_id, run.info.run_id)
        tracker._log_params([Param(k, v) for k, v in values.items()])
        log.info("opened MLflow run %s (%s)", run.info.run_id, safe_uri)
        return tracker, False

    def _log_params(self, params: list) -> None:
        client = mlflow_client(self.tracking_uri)
        for start in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_BATCH])

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[RunTracker]:
        """Run the ``with`` block; if it raises, end this run as ``interrupted``
        (Ctrl-C) or ``failed`` (the error as tag ``splitvit.error``) and re-raise,
        so that no run is left RUNNING in the MLflow UI."""
        from ..errors import error_line

        try:
            yield self
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM in splitvit (errors.Interrupted)
            self._close_quietly("interrupted")
            raise
        except Exception as exc:
            self._close_quietly("failed", tags={"splitvit.error": error_line(exc)[:2000]})
            raise

    def _close_quietly(self, status: str, tags: dict[str, str] | None = None) -> None:
        """:meth:`close` on the way out of an error: a store that fails now must not
        hide the error being raised."""
        try:
            self.close(status, tags=tags)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not end MLflow run %s as %s: %s", self.run_id, status, exc)

    def close(self, status: str, tags: dict[str, str] | None = None) -> None:
        """End the run: ``status`` is ``completed`` (MLflow FINISHED), ``diverged`` or
        ``failed`` (FAILED), or ``interrupted`` (KILLED). A run that ends otherwise
        than ``completed`` ends its child runs still RUNNING too (KILLED): a sweep
        stopped by Ctrl-C or an error leaves none of its trials' runs RUNNING."""
        self._end(status, tags)
        if status != "completed":
            try:
                close_stale_runs(self, reason=f"its parent run {self.run_id} ended {status}")
            except Exception as exc:  # noqa: BLE001 - the run itself is ended; its children are a courtesy
                log.warning("could not end the runs under MLflow run %s: %s", self.run_id, exc)

    def _end(self, status: str, tags: dict[str, str] | None = None) -> None:
        mlflow_status = {"completed": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        client = mlflow_client(self.tracking_uri)
        self.set_tags({STATUS_TAG: status, **(tags or {})})
        client.set_terminated(self.run_id, status=mlflow_status)

    # ------------------------------------------------------------------ rank 0
    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags (values with passwords removed; secret-named tags masked)."""
        from mlflow.entities import RunTag

        safe = [RunTag(k, v) for k, v in safe_tags(tags).items()]
        mlflow_client(self.tracking_uri).log_batch(self.run_id, tags=safe)

    def logged_epochs(self) -> set[int]:
        """Epochs whose metrics are already in the run."""
        history = mlflow_client(self.tracking_uri).get_metric_history(self.run_id, EPOCH_MARKER)
        return {m.step for m in history}

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Log one epoch's metrics at ``step=epoch``, once: an epoch already logged
        (before a worker restart) is skipped. Returns True when it logged."""
        from mlflow.entities import Metric

        if epoch in self.logged_epochs():
            return False
        now = int(time.time() * 1000)
        values = {**{k: float(v) for k, v in metrics.items() if _is_number(v)}, EPOCH_MARKER: float(epoch)}
        # the marker goes last: a batch is one transaction, but keep the order meaningful anyway
        batch = [Metric(k, v, now, epoch) for k, v in values.items() if k != EPOCH_MARKER]
        batch.append(Metric(EPOCH_MARKER, float(epoch), now, epoch))
        mlflow_client(self.tracking_uri).log_batch(self.run_id, metrics=batch)
        return True

    def log_final(self, metrics: dict[str, float], prefix: str = "final_") -> None:
        """Final figures as ``final_<name>`` metrics (no step)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{prefix}{k}", float(v), now, 0) for k, v in metrics.items() if _is_number(v)]
        if batch:
            mlflow_client(self.tracking_uri).log_batch(self.run_id, metrics=batch)

    def has_final(self, prefix: str = "final_") -> bool:
        """True when :meth:`log_final` has logged figures to this run."""
        metrics = mlflow_client(self.tracking_uri).get_run(self.run_id).data.metrics
        return any(k.startswith(prefix) for k in metrics)

    def log_image(self, image, artifact_file: str) -> None:
        """Log a PIL image as a PNG artifact (e.g. ``split_maps/epoch_0003.png``)."""
        mlflow_client(self.tracking_uri).log_image(self.run_id, image, artifact_file=artifact_file)

    def log_dict(self, data: JsonObject, artifact_file: str) -> None:
        """Log a JSON artifact."""
        mlflow_client(self.tracking_uri).log_dict(self.run_id, data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Log a text artifact (a file as it was read: YAML, markdown)."""
        mlflow_client(self.tracking_uri).log_text(self.run_id, text, artifact_file)

    def log_datasets(self, data: DataConfig) -> None:
        """The experiment's training and evaluation data as MLflow dataset inputs (the
        run page's *Datasets used*): name and split, source (the folder or URI read, or
        the generator for data made in memory), and a digest of everything that decides
        the items (dataset, options, seed), so two runs on the same data show one digest.
        Logged once: a resumed run keeps its inputs."""
        import mlflow.data.dataset_source_registry as sources
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        client = mlflow_client(self.tracking_uri)
        if client.get_run(self.run_id).inputs.dataset_inputs:
            return
        options = redact_secrets(dict(data.options))
        location = options.get("uri") or options.get("root")
        inputs = []
        for split, context in (("train", "training"), (data.val_split, "evaluation")):
            fingerprint = json.dumps(
                {"name": data.name, "options": options, "seed": data.seed, "split": split}, sort_keys=True, default=str
            )
            digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
            if location:
                source = sources.resolve_dataset_source(redact_uri(str(location)))
            else:  # generated, or a dataset package's own files
                source = CodeDatasetSource(
                    tags={"splitvit.dataset": data.name, "splitvit.options": json.dumps(options, default=str)}
                )
            dataset = MetaDataset(source, name=f"{data.name}/{split}", digest=digest)
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        client.log_inputs(self.run_id, datasets=inputs)

    def logged_model_id(self) -> str | None:
        """The id of the model logged by :meth:`log_model`, if any."""
        return mlflow_client(self.tracking_uri).get_run(self.run_id).data.tags.get(MODEL_ID_TAG)

    def log_model(self, model, name: str = "model", params: dict[str, Any] | None = None) -> str:
        """Log ``model`` (a ``torch.nn.Module``) as an MLflow 3 logged model linked to
        this run, once; returns its ``models:/<id>`` URI.

        The ``splitvit`` package goes with it (``code_paths``), so the model loads
        wherever torch and timm are installed.
        """
        import mlflow
        import mlflow.pytorch
        import timm
        import torch

        import splitvit

        existing = self.logged_model_id()
        if existing:
            return f"models:/{existing}"
        client = mlflow_client(self.tracking_uri)
        # The logged model is created here, in this run's experiment: log_model alone
        # would file it under the process's active experiment.
        logged = client.create_logged_model(
            self.experiment_id, name=name, source_run_id=self.run_id, params=safe_params(params or {})
        )
        # mlflow.pytorch.log_model resolves its store from the global tracking URI.
        mlflow.set_tracking_uri(self.tracking_uri)
        info = mlflow.pytorch.log_model(
            model,
            name=name,
            model_id=logged.model_id,
            run_id=self.run_id,
            code_paths=[str(Path(splitvit.__file__).parent)],
            # pickle, not pt2: the quadtree forward is data-dependent and does not export
            serialization_format="pickle",
            # explicit requirements: inferring them loads the model in a subprocess
            pip_requirements=[
                f"torch=={torch.__version__.split('+')[0]}",
                f"timm=={timm.__version__}",
                "pillow",
                "numpy",
            ],
        )
        self.set_tags({MODEL_ID_TAG: logged.model_id})
        return info.model_uri


def close_stale_runs(parent: RunTracker, reason: str = "its driver stopped before ending it") -> list[str]:
    """End the runs under ``parent`` (its children, their children...) still
    ``RUNNING``, as ``KILLED`` with tag ``splitvit.status=interrupted``; returns their ids.

    A sweep or study whose driver died (SIGKILL, a lost node) leaves its runs
    ``RUNNING`` for ever; resuming it calls this before anything of its own starts
    (a run resumed later is re-opened by :meth:`RunTracker.open`). :meth:`RunTracker.close`
    calls it too when a run ends otherwise than completed.
    """
    client = mlflow_client(parent.tracking_uri)
    running = client.search_runs(
        [parent.experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=50_000
    )
    parents = {r.info.run_id: r.data.tags.get("mlflow.parentRunId") for r in running}

    def under(run_id: str) -> bool:
        seen = set()
        while run_id and run_id not in seen:
            seen.add(run_id)
            if run_id not in parents:  # an ancestor that is not running itself
                try:
                    parents[run_id] = client.get_run(run_id).data.tags.get("mlflow.parentRunId")
                except Exception:  # noqa: BLE001 - a deleted ancestor ends the chain
                    parents[run_id] = None
            run_id = parents[run_id]
            if run_id == parent.run_id:
                return True
        return False

    closed: list[str] = []
    for run in running:
        if run.info.run_id != parent.run_id and under(run.info.run_id):
            RunTracker(parent.tracking_uri, parent.experiment_id, run.info.run_id)._end(
                "interrupted", tags={"splitvit.message": f"ended KILLED: {reason}"}
            )
            closed.append(run.info.run_id)
    if closed:
        log.warning(
            "closed %d MLflow run(s) left RUNNING under %s (%s) as KILLED: %s",
            len(closed),
            parent.run_id,
            reason,
            ", ".join(closed),
        )
    return closed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
