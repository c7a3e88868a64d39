"""MLflow model and run URIs as checkpoints: ``splitvit eval`` and ``viz`` take
``models:/<name>@<alias>`` (a sweep's frontier in the Model Registry),
``models:/<name>/<version>``, ``models:/<logged model id>`` and ``runs:/<run id>``
wherever they take a checkpoint.

A model's weights are its run's checkpoint: the run that logged it carries the
checkpoint (tag ``splitvit.checkpoint``, on a threshold point's trial run), and the
thresholds it was logged with (the logged model's ``thresholds`` param, a threshold
point's params, or a trial's ``splitvit.thresholds`` tag). Resolving to the
checkpoint keeps one evaluation path (the checkpoint carries the experiment's data
settings, which a logged model does not).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .runs import CHECKPOINT_TAG, PARENT_TAG, missing_store, mlflow_client

URI_SCHEMES = ("models:/", "runs:/")
THRESHOLDS_TAG = "splitvit.thresholds"


@dataclass(frozen=True)
class ResolvedModel:
    """What an MLflow URI names, as ``splitvit eval`` needs it.

    Attributes:
        uri: the URI as given.
        run_id: the run whose model it is.
        checkpoint: that run's checkpoint (local or ``s3://``).
        thresholds: the per-level thresholds the model was recorded with (``None``:
            the checkpoint's own).
    """

    uri: str
    run_id: str
    checkpoint: str
    thresholds: list[float] | None


def is_model_uri(text: str) -> bool:
    """True for ``models:/...`` and ``runs:/...``."""
    return text.startswith(URI_SCHEMES)


def resolve_model_uri(uri: str, tracking_uri: str) -> ResolvedModel:
    """The run, checkpoint and thresholds behind ``uri``.

    Raises:
        ValueError: one line naming the URI, when MLflow does not know it or its run
            records no checkpoint.
    """
    from mlflow.exceptions import MlflowException

    missing = missing_store(tracking_uri)  # a mistyped local store is not created
    if missing:
        raise ValueError(f"{uri}: {missing}")
    client = mlflow_client(tracking_uri)
    try:
        run_id, thresholds = _run_of(client, uri)
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise ValueError(f"{uri}: not found in MLflow store {tracking_uri}: {exc.message.splitlines()[0]}") from None
    tags, params = run.data.tags, run.data.params
    checkpoint = tags.get(CHECKPOINT_TAG)
    if thresholds is None:  # a threshold point's own, else the trial's
        recorded = params.get("thresholds") or tags.get(THRESHOLDS_TAG)
        thresholds = json.loads(recorded) if recorded else None
    if not checkpoint and tags.get(PARENT_TAG):  # a threshold point: its trial holds the checkpoint
        checkpoint = client.get_run(tags[PARENT_TAG]).data.tags.get(CHECKPOINT_TAG)
    if not checkpoint:
        raise ValueError(f"{uri}: run {run_id} records no checkpoint (tag {CHECKPOINT_TAG})")
    return ResolvedModel(uri, run_id, checkpoint, [float(t) for t in thresholds] if thresholds else None)


def _run_of(client, uri: str) -> tuple[str, list[float] | None]:
    """``(run id, thresholds of the logged model or None)`` of a ``models:/`` or ``runs:/`` URI."""
    if uri.startswith("runs:/"):
        run_id = uri[len("runs:/") :].split("/", 1)[0]
        if not run_id:
            raise ValueError(f"{uri}: no run id (runs:/<run id>)")
        return run_id, None
    body = uri[len("models:/") :]
    if "@" in body:  # models:/<name>@<alias>
        name, alias = body.split("@", 1)
        version = client.get_model_version_by_alias(name, alias)
        return version.run_id, _model_thresholds(client, version.model_id)
    name, _, number = body.partition("/")
    if number:  # models:/<name>/<version>
        version = client.get_model_version(name, number)
        return version.run_id, _model_thresholds(client, version.model_id)
    model = client.get_logged_model(name)  # models:/<logged model id>
    return model.source_run_id, _model_thresholds(client, model.model_id)


def _model_thresholds(client, model_id: str | None) -> list[float] | None:
    if not model_id:
        return None
    recorded = (client.get_logged_model(model_id).params or {}).get("thresholds")
    return json.loads(recorded) if recorded else None
