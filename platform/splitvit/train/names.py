"""The checks of a config that need no torch, run by the command line before torch, Ray
and MLflow load (a mistake is one line in a second):

* :func:`check_names`: the names (dataset, the workers' allocator) against what the
  data and the allocator table define (the model's names are their config fields'
  types, checked as the config loads), the task against the dataset's targets, and the model's shape
  (:func:`check_model_shape`: one threshold per non-finest level, an image side the
  coarsest patch divides).
  :func:`~splitvit.train.experiment.validate_experiment` runs them with the rest;
* :func:`check_locations`: where a run reads and writes, as far as the files tell
  (the tracking URI's scheme, ``storage.path``, a COCO dataset's annotation files);
  the network (a server, a bucket) is the preflight's."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from ..config import ConfigError, ExperimentConfig, ModelConfig, redact_uri, require
from ..data.coco_format import check_coco_file
from ..data.names import ANY_TASK_DATASETS, DATASET_NAMES, DETECTION_DATASETS
from ..model.names import DETECTION_TASK
from .allocator import ALLOCATORS


def check_names(config: ExperimentConfig) -> None:
    """Raise :class:`~splitvit.config.ConfigError` naming the key whose name is unknown,
    ``data.name`` where the dataset's targets are not the task's (detection data
    serves ``model.task: detection`` only, and that task no other data), or the model
    key :func:`check_model_shape` refuses."""
    d, m = config.data, config.model
    require(
        d.name in DATASET_NAMES, "data.name", f"unknown dataset {d.name!r}; expected one of {', '.join(DATASET_NAMES)}"
    )
    # the policy, task, normalisation and pooling names are their fields' types (config.coerce checks them)
    check_task_data(d.name, m.task)
    check_model_shape(m)
    require(
        config.scaling.allocator in ALLOCATORS,
        "scaling.allocator",
        f"unknown allocator {config.scaling.allocator!r}; expected one of {', '.join(ALLOCATORS)}",
    )


def check_task_data(dataset: str, task: str) -> None:
    """Raise :class:`~splitvit.config.ConfigError` on ``data.name`` unless ``dataset``
    has the targets ``task`` learns: objects for ``detection``, classes otherwise.
    Parquet shards may hold either: the preflight reads which."""
    if dataset in ANY_TASK_DATASETS:
        return
    detection_data = dataset in DETECTION_DATASETS
    if task == DETECTION_TASK and not detection_data:
        raise ConfigError(
            "data.name",
            f"model.task=detection needs a detection dataset ({', '.join(DETECTION_DATASETS)}, or parquet shards "
            f"of one): {dataset!r} has no object boxes",
        )
    require(
        task == DETECTION_TASK or not detection_data,
        "data.name",
        f"{dataset!r} is a detection dataset (boxes and masks of objects): it needs model.task=detection, "
        f"got model.task={task!r}",
    )


# ---------------------------------------------------------------------- the model's shape
#: The finest patch of a timm model, from its name (``vit_tiny_patch16_224`` -> 16).
_PATCH_IN_NAME = re.compile(r"patch(\d+)")


def finest_patch(m: ModelConfig) -> int | None:
    """The ViT's patch side as the settings give it: ``model.timm_kwargs.patch_size``,
    else the number in the timm name (``vit_tiny_patch16_224`` -> 16); None when neither
    says (timm decides, and :func:`~splitvit.train.experiment.validate_experiment` checks)."""
    given = m.timm_kwargs.get("patch_size") if isinstance(m.timm_kwargs, dict) else None
    if isinstance(given, (list, tuple)) and given and all(v == given[0] for v in given):
        given = given[0]
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    if given is not None:
        return None
    found = _PATCH_IN_NAME.search(m.name)
    return int(found.group(1)) if found else None


def check_model_shape(m: ModelConfig) -> None:
    """Raise :class:`~splitvit.config.ConfigError` where ``model.thresholds`` does not
    give one threshold per non-finest level, or the coarsest patch (the finest patch *
    2**(levels-1)) does not divide ``model.image_size``: what the model would refuse
    once torch and timm have loaded, said from the settings alone."""
    if isinstance(m.thresholds, list):
        require(
            len(m.thresholds) == m.levels - 1,
            "model.thresholds",
            f"expected {m.levels - 1} values (one per non-finest level of model.levels={m.levels}), "
            f"got {len(m.thresholds)}",
        )
    patch = finest_patch(m)
    if patch is None or patch < 1 or m.levels < 2 or m.image_size < 1:
        return
    coarse = patch * 2 ** (m.levels - 1)
    require(
        m.image_size % coarse == 0,
        "model.image_size",
        # the words of the model's own check (QuadtreeGeometry), said before it loads
        f"image size {m.image_size}x{m.image_size} is not a multiple of the coarsest patch {coarse} "
        f"(patch_size {patch} * 2**(levels-1) with levels={m.levels}); use an image side that is a "
        f"multiple of {coarse}",
    )


# ---------------------------------------------------------------------- where things go
#: MLflow's tracking stores by URI scheme (``mlflow.tracking._tracking_service.utils``):
#: a folder (no scheme, ``file``), a server, Databricks; databases below.
TRACKING_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc")
#: The databases of MLflow's SQLAlchemy store: ``sqlite:///runs/mlflow.db``, ``postgresql+psycopg2://...``.
TRACKING_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow has no tracking store for ``uri`` (an unknown scheme), else None.

    Asked before MLflow loads: MLflow itself answers an unknown scheme with a long
    traceback after its import. Schemes that an installed plugin registers (the
    ``mlflow.tracking_store`` entry points) are accepted."""
    scheme = urlparse(uri).scheme.lower()
    if scheme in TRACKING_SCHEMES or (len(scheme) == 1 and scheme.isalpha()):  # C:\... is a path
        return None
    database, plus, driver = scheme.partition("+")
    if database in TRACKING_DATABASES and (not plus or re.fullmatch(r"[a-z0-9_]+", driver)):
        return None
    from importlib.metadata import entry_points

    if scheme in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        return None
    return (
        f"MLflow has no tracking store for scheme {scheme!r} in {redact_uri(uri)}; use a path or file:///PATH, "
        "sqlite:///PATH.db (or postgresql://, mysql://, mssql://), http(s)://HOST:PORT or databricks"
    )


def writable_folder_problem(folder: Path) -> str | None:
    """None when ``folder`` exists and is writable, or can be created (its nearest
    existing ancestor is a writable folder); else why not. Leaves nothing behind."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" + ("" if probe == folder else f" (so {folder} cannot be created)")
    # permissions can say yes where the file system says no (/proc, a read-only mount):
    # a folder made and removed again is the real test
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".splitvit-preflight-", dir=probe))
    except OSError as exc:
        return f"{probe} cannot hold new folders ({exc.strerror or exc})"
    return None


def storage_path_problem(path: str) -> str | None:
    """Why ``storage.path`` cannot hold the runs, as far as this machine can tell
    without a network: a scheme other than a local path, ``file://`` or
    ``s3://bucket/prefix``, an ``s3://`` URI without a bucket, or a local folder that
    cannot be made or written. None otherwise (an ``s3://`` bucket is the preflight's)."""
    if path.startswith("s3://"):
        return None if path[len("s3://") :].split("/", 1)[0] else f"{path!r} names no bucket (s3://bucket/prefix)"
    if "://" in path and not path.startswith("file://"):
        return f"unsupported storage URI {path!r}: expected a local path, file:///PATH or s3://bucket/prefix"
    local = Path(urlparse(path).path if path.startswith("file://") else path).expanduser()
    why = writable_folder_problem(local.absolute())
    return f"cannot write to {path}: {why}" if why else None


def tracking_key(config: ExperimentConfig) -> str:
    """The setting the experiment's tracking URI comes from, to name it in an error."""
    if config.tracking.tracking_uri:
        return "tracking.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "MLFLOW_TRACKING_URI"
    return "storage.path"


def check_locations(config: ExperimentConfig) -> None:
    """The command line's checks of where a run reads and writes, before torch loads:
    the tracking URI's scheme, ``storage.path`` (:func:`storage_path_problem`) and a
    COCO dataset's annotation files (there, and COCO's shape:
    :func:`~splitvit.data.coco_format.check_coco_file`). Raises
    :class:`~splitvit.config.ConfigError`, ``FileNotFoundError`` or ``CocoFormatError``.
    The network (a server, a bucket) is the preflight's."""
    if config.tracking.enabled:
        why = tracking_uri_problem(config.tracking_uri())
        if why:
            raise ConfigError(tracking_key(config), why)
    why = storage_path_problem(config.storage.path)
    if why:
        raise ConfigError("storage.path", why)
    if config.data.name == "coco":
        for key, value in sorted(config.data.options.items()):
            if key.endswith("_annotations") and isinstance(value, str) and value:
                check_coco_file(value, f"data.options.{key}")
