"""Preflight: what would only fail once Ray has started, checked in the driver first.

``splitvit train``, ``sweep``, ``study`` and ``eval`` call :func:`preflight` (or
:func:`preflight_eval`) before Ray starts, so that bad input found only at run time
ends in seconds with one line naming the setting, instead of a hang or a worker
traceback:

* **config** -- the experiment config is fully validated first
  (:func:`splitvit.train.experiment.validate_experiment`; a
  :class:`~splitvit.config.ConfigError` naming the key), whoever built it;
* **capacity** -- the cluster can ever hold the requested workers (and a sweep's
  or study's trial driver): in total and per node (a worker's bundle must fit on
  one node; ``STRICT_PACK`` puts them all on one, ``STRICT_SPREAD`` one per
  node). A local run is checked against this machine (Ray's CPU count, torch's
  GPU count) before ``ray.init``; a cluster address is first checked to answer
  (a TCP connect with a short timeout), then joined and checked against its live
  nodes, or, for an autoscaling cluster, against the node groups its autoscaler
  declares (``max_count`` of each, what Ray Train itself checks);
* **Ray address** -- ``--address`` / ``$RAY_ADDRESS`` answers, and is not a
  dashboard URL (that is for ``splitvit submit``);
* **MLflow** -- an ``http(s)`` tracking server answers one request within a few
  seconds (no retries); a SQLite store's folder exists or can be created, writable;
* **storage** -- a local storage folder can be created and written; for
  ``s3://``: the endpoint answers, the bucket exists, the credentials are
  accepted and an object can be written and deleted (the check of ``data push``,
  :func:`splitvit.storage.check_bucket`, plus a write);
* **data** -- the dataset opens in the driver, has items, and its labels fit
  ``model.num_classes`` (read from the dataset's class list, label list or
  manifest, else from a bounded sample; nothing is rendered or decoded in bulk);
  a detection set's splits name the same categories, ``model.num_classes`` of them;
  parquet shards hold the task's items (detection shards for ``model.task:
  detection`` only; their manifest says, read before the shards).

Every other failure raises :class:`PreflightError` (a ``ValueError``), which the
command line prints as ``splitvit <command>: error: <key>: <reason>``, exit 2.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config import ExperimentConfig, redact_uri
from ..model.names import DETECTION_TASK
from ..train.names import tracking_key, tracking_uri_problem, writable_folder_problem

log = logging.getLogger(__name__)

#: Seconds one network check may take (connect; a reply gets as long again).
NETWORK_TIMEOUT_S = 4.0
#: Items read to find the labels of a dataset that keeps no label list.
LABEL_SAMPLE = 64
#: Resource names Ray always has on a node but that are not worth checking here.
_UNCHECKED = ("memory", "object_store_memory")


class PreflightError(ValueError):
    """Bad input found before the run starts. ``key`` is the setting to change
    (a config key, an option or an environment variable), ``reason`` what is wrong."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")

    def __reduce__(self):  # picklable (Ray, multiprocessing) with both fields
        return (type(self), (self.key, self.reason))


@dataclass
class PreflightReport:
    """What the preflight checked, one line each (logged at INFO)."""

    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    data_line: str = ""  # "data: NAME from FOLDER: N train, M val items, K classes"
    data_source: str | None = None  # the folder or URI the data come from ("" when generated)

    def add(self, line: str) -> None:
        self.lines.append(line)
        log.info("preflight: %s", line)


# ---------------------------------------------------------------------- capacity
def worker_resources(scaling) -> dict[str, float]:
    """Ray resources of one Ray Train worker, by Ray Train's own rule
    (``ScalingConfig._resources_per_worker_not_none``): ``resources_per_worker``
    without zeros, else ``{CPU: 1}`` (or ``{GPU: 1}`` with ``use_gpu``); ``use_gpu``
    adds ``GPU: 1`` when no GPU amount is given."""
    if scaling.resources_per_worker:
        out = {k: float(v) for k, v in scaling.resources_per_worker.items() if v}
    else:
        out = {"GPU": 1.0} if scaling.use_gpu else {"CPU": 1.0}
    if scaling.use_gpu:
        out.setdefault("GPU", 1.0)
    return out


def _fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` fit on ``node`` (a large number for an empty bundle)."""
    counts = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0 and k not in _UNCHECKED]
    return min(counts) if counts else 10**9


def _amount(value: float) -> str:
    return f"{value:g}"


def _plural(n: float, word: str) -> str:
    return f"{_amount(n)} {word}" + ("" if n == 1 or word.endswith("s") else "s")


def _key_for(resource: str, scaling) -> str:
    if resource == "GPU" and scaling.use_gpu and "GPU" not in scaling.resources_per_worker:
        return "scaling.use_gpu"
    if resource == "CPU":
        return "scaling.num_workers"  # the multiplier; the message names resources_per_worker.CPU too
    return f"scaling.resources_per_worker.{resource}"


def check_capacity(
    scaling,
    nodes: Sequence[Mapping[str, float]],
    *,
    where: str,
    extra: Mapping[str, float] | None = None,
    extra_key: str = "search.trial_resources",
) -> str:
    """Raise :class:`PreflightError` unless ``nodes`` (each a map of Ray resources)
    can ever hold ``scaling.num_workers`` workers (and the bundle ``extra``: a Tune
    trial's driver). Returns a one-line summary.

    Checks, in order: the trial driver fits some node; the total of every resource
    asked for; that one worker fits some node; that all workers fit at once, node
    by node (``STRICT_PACK``: on one node; ``STRICT_SPREAD``: on as many nodes).
    ``where`` describes the nodes for the message ("this machine", "the cluster at ...").
    """
    per = worker_resources(scaling)
    n = scaling.num_workers
    extra = {k: float(v) for k, v in (extra or {}).items() if v}
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    has = ", ".join(f"{_plural(totals.get(r, 0.0), r)}" for r in sorted(set(per) | set(extra)) if r not in _UNCHECKED)
    node_word = f"{len(nodes)} node" + ("" if len(nodes) == 1 else "s")
    in_nodes = "" if where == "this machine" else f" ({node_word})"
    if extra and not any(_fits(node, extra) for node in nodes):
        raise PreflightError(
            extra_key,
            f"a trial's driver asks for {_bundle(extra)}, but no node of {where} has that "
            f"much ({node_word}, {has}); lower {extra_key}",
        )
    for resource in sorted(set(per) | set(extra)):
        if resource in _UNCHECKED:
            continue
        need = per.get(resource, 0.0) * n + extra.get(resource, 0.0)
        have = totals.get(resource, 0.0)
        if need > have + 1e-9:
            key = _key_for(resource, scaling) if resource in per else f"{extra_key}.{resource}"
            asked = f"{n} worker{'s' if n != 1 else ''} x {_plural(per.get(resource, 0.0), resource)}"
            if extra.get(resource):
                asked += f" + {_plural(extra[resource], resource)} for the trial's driver ({extra_key})"
            hint = {
                "scaling.use_gpu": "set scaling.use_gpu=false to train on CPUs, "
                "or run on a cluster with GPUs (--address)",
                "scaling.num_workers": "lower scaling.num_workers (or scaling.resources_per_worker.CPU), or run on a "
                "larger cluster (--address)",
            }.get(key, f"lower {key} or scaling.num_workers, or run on a cluster that has them (--address)")
            raise PreflightError(
                key,
                f"asks for {asked} = {_plural(need, resource)}, but {where} has "
                f"{_plural(have, resource)}{in_nodes}; Ray would wait for them forever. {hint}",
            )
    fits = [_fits(node, per) for node in nodes]
    if not any(fits):
        largest = max(nodes, key=lambda node: _fits(node, {k: 1.0 for k in per}), default={})
        raise PreflightError(
            _key_for(max(per, key=lambda r: per[r] / max(totals.get(r, 0.0), 1e-9)), scaling),
            f"one worker asks for {_bundle(per)}, but no node of {where} has that much (largest: "
            f"{_bundle({k: largest.get(k, 0.0) for k in per})}): a worker runs on one node",
        )
    strategy = scaling.placement_strategy
    if strategy == "STRICT_PACK":
        if not any(f >= n for f in fits):
            raise PreflightError(
                "scaling.placement_strategy",
                f"STRICT_PACK puts all {n} workers ({_bundle(per)} each) on "
                f"one node, but the largest node of {where} holds {max(fits)}",
            )
    elif strategy == "STRICT_SPREAD":
        if sum(1 for f in fits if f >= 1) < n:
            raise PreflightError(
                "scaling.placement_strategy",
                f"STRICT_SPREAD puts each of the {n} workers on its own node, "
                f"but {where} has {sum(1 for f in fits if f >= 1)} node(s) "
                f"that hold one",
            )
    elif sum(fits) < n:
        raise PreflightError(
            _key_for(next(iter(per)), scaling),
            f"{n} workers x {_bundle(per)} do not fit on the nodes of {where} ({node_word}: "
            f"{'; '.join(_bundle({k: node.get(k, 0.0) for k in per}) for node in nodes[:8])}"
            f"{'; ...' if len(nodes) > 8 else ''}): at most {sum(fits)} at once",
        )
    return (
        f"capacity: {n} worker(s) x {_bundle(per)}"
        + (f" + trial driver {_bundle(extra)}" if extra else "")
        + f" fit {where} ({node_word}, {has})"
    )


def _bundle(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in resources.items() if k not in _UNCHECKED) + "}"


def local_nodes() -> list[dict[str, float]]:
    """This machine as the one node a local Ray would start: Ray's CPU count
    (cgroup limits included), torch's GPU count (``CUDA_VISIBLE_DEVICES`` included)."""
    try:
        from ray._private.utils import get_num_cpus

        cpus = float(get_num_cpus())
    except Exception:  # noqa: BLE001 - a private helper: fall back to the OS count
        cpus = float(os.cpu_count() or 1)
    try:
        import torch

        gpus = float(torch.cuda.device_count())
    except Exception:  # noqa: BLE001
        gpus = 0.0
    return [{"CPU": cpus, "GPU": gpus}]


def ray_nodes() -> tuple[list[dict[str, float]], bool]:
    """The nodes of the Ray this process is connected to, as resource maps, and
    whether they come from an autoscaler's declared node groups (each group
    repeated ``max_count`` times) rather than from the live nodes."""
    import ray

    groups = []
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
        for group in config.node_group_configs if config is not None else []:
            resources = {k: float(v) for k, v in group.resources.items()}
            count = int(group.max_count)
            if resources and count != 0:
                groups.append((resources, count))
    except Exception as exc:  # noqa: BLE001 - an older or newer Ray: the live nodes then
        log.debug("no autoscaler cluster config: %s", exc)
    if groups:
        nodes = []
        for resources, count in groups:
            nodes += [dict(resources)] * (64 if count < 0 else min(count, 64))
        return nodes, True
    live = [{k: float(v) for k, v in node.get("Resources", {}).items()} for node in ray.nodes() if node.get("Alive")]
    return live, False


# ---------------------------------------------------------------------- Ray address
def resolve_ray_address(address: str | None) -> tuple[str | None, str]:
    """``(address, where it came from)``: ``--address``, else ``$RAY_ADDRESS``;
    ``(None, "")`` for a local Ray."""
    if address:
        return address, "--address"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env, "RAY_ADDRESS"
    return None, ""


def _tcp_check(host: str, port: int, timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def check_ray_address_form(address: str, source: str) -> tuple[str, int] | None:
    """Raise :class:`PreflightError` unless ``address`` has the form of a Ray cluster's
    address (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``, ``local``): what the address
    alone decides, said before Ray (or torch) loads. Returns ``(host, port)``, or None
    for ``auto`` and ``local`` (they are resolved by Ray)."""
    key = source
    if address in ("local", "auto"):
        return None
    if address.startswith(("http://", "https://")):
        raise PreflightError(
            key,
            f"{address} is a Ray dashboard / job server address; this command joins a cluster by "
            "its GCS address (HOST:6379) or ray://HOST:10001. To run on a cluster through its job "
            "server, use `splitvit submit` (it reads RAY_API_SERVER_ADDRESS or --address)",
        )
    return _host_port(address, address, key)


def _host_port(target: str, address: str, key: str) -> tuple[str, int]:
    rest = target[len("ray://") :] if target.startswith("ray://") else target
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise PreflightError(key, f"{address!r} is not a Ray address (HOST:PORT, ray://HOST:PORT or auto)")
    return host.strip("[]") or "127.0.0.1", int(port)


def check_ray_address(address: str, source: str, timeout: float = NETWORK_TIMEOUT_S) -> str:
    """Raise :class:`PreflightError` unless the Ray cluster at ``address`` answers;
    returns the address Ray will join (``auto`` resolved)."""
    key = source
    if address == "local":
        return address
    check_ray_address_form(address, source)
    target = address
    if address == "auto":
        try:
            from ray._private.utils import read_ray_address

            target = read_ray_address()
        except Exception:  # noqa: BLE001
            target = None
        if not target:
            raise PreflightError(
                key,
                "'auto': no Ray cluster was started on this machine (`ray start --head` or "
                "`splitvit stack up`); unset it to start a local Ray",
            )
    host, port = _host_port(target, address, key)
    reason = _tcp_check(host, port, timeout)
    if reason:
        raise PreflightError(
            key,
            f"no Ray cluster answers at {target} within {timeout:g}s ({reason}); is it up "
            "(`ray status`, `splitvit stack status`)? Unset it to start a local Ray",
        )
    return address


# ---------------------------------------------------------------------- MLflow
_tracking_key = tracking_key
#: the check of a local folder: it exists and is writable, or can be created (shared
#: with the command line's checks before torch loads, :mod:`splitvit.train.names`)
_writable_folder = writable_folder_problem


def check_tracking(uri: str, key: str, timeout: float = NETWORK_TIMEOUT_S, *, write: bool = True) -> str:
    """Raise :class:`PreflightError` unless the MLflow store at ``uri`` answers
    (an ``http(s)`` server: one GET with a ``timeout``, no retries) or can be
    written (a SQLite file or local folder; ``write=False``: a command that only
    reads, such as ``eval`` of a ``models:/`` URI, checks a server alone, and a
    local store is the missing-store check's, :func:`splitvit.tracking.runs.missing_store`).
    A scheme MLflow has no store for is refused first (MLflow's own answer is a
    traceback after its import)."""
    shown = redact_uri(uri)
    unsupported = tracking_uri_problem(uri)
    if unsupported:
        raise PreflightError(key, unsupported)
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        import requests

        headers = {}
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        auth = None
        if os.environ.get("MLFLOW_TRACKING_USERNAME") and os.environ.get("MLFLOW_TRACKING_PASSWORD"):
            auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
        base = uri.rstrip("/")
        try:
            # the API itself, not /health: a server behind a path prefix or a proxy has the API under the URI
            response = requests.get(
                f"{base}/api/2.0/mlflow/experiments/get-by-name",
                params={"experiment_name": "splitvit-preflight"},
                headers=headers,
                auth=auth,
                timeout=(timeout, timeout),
                allow_redirects=True,
            )
        except requests.RequestException as exc:
            raise PreflightError(
                key,
                f"no MLflow server answers at {shown} within {timeout:g}s ({_http_reason(exc)}); "
                "is it up (`splitvit stack status`)?",
            ) from None
        if response.status_code in (401, 403):
            raise PreflightError(
                key,
                f"the MLflow server at {shown} refused us (HTTP {response.status_code}): set "
                "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN",
            )
        if response.status_code == 200 or (response.status_code == 404 and "RESOURCE_DOES_NOT_EXIST" in response.text):
            return f"MLflow: server {shown} answers"
        raise PreflightError(
            key,
            f"{shown} answers, but not as an MLflow tracking server (GET "
            f"/api/2.0/mlflow/experiments/get-by-name: HTTP {response.status_code})",
        )
    if not write:
        return f"MLflow: {shown} not written (read only)"
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :]).expanduser()
        if db.exists() and (not db.is_file() or not os.access(db, os.R_OK | os.W_OK)):
            raise PreflightError(key, f"the MLflow store {db} ({shown}) is not a writable file")
        why = _writable_folder(db.parent)
        if why:
            raise PreflightError(key, f"the MLflow store {shown} cannot be written: {why}")
        return f"MLflow: store {shown} writable"
    if scheme in ("", "file"):
        folder = Path(urlparse(uri).path if scheme == "file" else uri).expanduser()
        why = _writable_folder(folder)
        if why:
            raise PreflightError(key, f"the MLflow store {shown} cannot be written: {why}")
        return f"MLflow: store {shown} writable"
    return f"MLflow: {shown} not checked (scheme {scheme!r})"


def _http_reason(exc: Exception) -> str:
    """``ConnectionError: [Errno 111] Connection refused`` rather than urllib3's whole retry story."""
    inner = getattr(exc.args[0], "reason", None) if exc.args else None
    text = str(inner if inner is not None else exc).strip().splitlines()
    detail = text[0].rsplit(": ", 1)[-1] if text else ""
    return f"{type(exc).__name__}: {_short(detail)}" if detail else type(exc).__name__


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- storage
def check_storage(
    path: str, key: str = "storage.path", *, write: bool = True, timeout: float = NETWORK_TIMEOUT_S
) -> str:
    """Raise :class:`PreflightError` unless ``path`` (a local folder or ``s3://``)
    can be reached (and, with ``write``, written): for S3 the endpoint answers, the
    bucket exists and the credentials are accepted; a test object is written and
    deleted. A local folder must exist or be creatable, and be writable."""
    from ..storage import StorageError, check_bucket, is_s3, s3_client, split_s3_uri
    from ..storage.s3 import s3_error_reason

    if not is_s3(path):
        local = Path(path[len("file://") :] if path.startswith("file://") else path).expanduser()
        why = _writable_folder(local)
        if why:
            raise PreflightError(key, f"cannot write to {path}: {why}")
        return f"storage: {local.resolve()} writable"
    client = s3_client(timeout)
    try:
        where = check_bucket(path, client=client)
    except (StorageError, ValueError) as exc:
        raise PreflightError(key, str(exc)) from None
    if write:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, prefix = split_s3_uri(path)
        probe = "/".join(x for x in (prefix, f".splitvit-preflight-{uuid.uuid4().hex[:12]}") if x)
        try:
            client.put_object(Bucket=bucket, Key=probe, Body=b"splitvit preflight\n")
            client.delete_object(Bucket=bucket, Key=probe)
        except (ClientError, BotoCoreError) as exc:
            raise PreflightError(key, f"cannot write to {path} at {where}: {s3_error_reason(exc)}") from None
    return f"storage: {path} at {where} {'writable' if write else 'readable'}"


# ---------------------------------------------------------------------- data
def _data_key(options: Mapping[str, Any], split: str) -> str:
    for name in ("uri", "root", f"{split}_annotations"):
        if options.get(name):
            return f"data.options.{name}"
    return "data.name"


def dataset_source(name: str, options: Mapping[str, Any]) -> str | None:
    """Where dataset ``name``'s files come from (the folder or URI; a COCO set's
    annotation files), for the log; None for a dataset made without files."""
    if name.startswith("cluttered-fashion-mnist") or name == "fashion-det":
        from ..data import find_fashion_mnist

        return str(find_fashion_mnist(options.get("root"), download=False))  # the dataset was built: no download
    for key in ("uri", "root"):
        if options.get(key):
            return str(options[key])
    files = [str(value) for key, value in options.items() if key.endswith("_annotations") and value]
    return ", ".join(files) or None


def dataset_labels(dataset) -> tuple[int | None, str]:
    """``(number of classes the labels need, how it was found)``: the largest label
    + 1, read without rendering or decoding the dataset where it keeps its labels
    (a label list, a class list, a manifest), else from up to ``LABEL_SAMPLE`` items.
    ``None`` when nothing tells (a dense dataset without ``num_classes``)."""
    import numpy as np

    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple) and isinstance(samples[0][1], int):
        return max(label for _, label in samples) + 1, "its file list"  # imagefolder
    renderer = getattr(dataset, "renderer", None)
    if renderer is not None and getattr(renderer, "labels", None) is not None and len(renderer.labels):
        # cluttered Fashion-MNIST: the item pool's labels; the dense variant paints class k as k + 1
        shift = 1 if getattr(dataset, "classes", (None,))[0] == "background" else 0
        return int(np.max(renderer.labels)) + 1 + shift, "its item labels"
    manifest = getattr(dataset, "manifest", None)
    if manifest and manifest.num_classes:
        return int(manifest.num_classes), "its manifest"
    files = getattr(dataset, "files", None)
    if files and getattr(dataset, "columns", None) and "label" in dataset.columns:
        import pyarrow.parquet as pq

        from ..storage import filesystem_for

        top = -1
        for uri in files[:8]:  # the label column only: a few bytes per row
            fs, path = filesystem_for(uri)
            with fs.open_input_file(path) as f:
                column = pq.read_table(f, columns=["label"]).column("label").to_numpy()
            if len(column):
                top = max(top, int(column.max()))
        if top >= 0:
            return top + 1, f"the label column of {min(len(files), 8)} shard(s)"
    if getattr(dataset, "num_classes", None):
        return int(dataset.num_classes), "its num_classes"
    top, count = -1, min(len(dataset), LABEL_SAMPLE)
    for i in np.linspace(0, len(dataset) - 1, count).astype(int) if count else []:
        target = dataset[int(i)][1]
        if np.ndim(target) == 0:
            top = max(top, int(target))
        else:
            values = np.asarray(target)
            values = values[values != 255]
            if values.size:
                top = max(top, int(values.max()))
    return (top + 1 if top >= 0 else None), f"{count} sampled items"


def check_data(config: ExperimentConfig, splits: Sequence[str] | None = None) -> tuple[str, str]:
    """Raise :class:`PreflightError` unless the config's dataset opens in this
    process with items in every split the run reads, and labels that fit
    ``model.num_classes``. Returns ``(summary line, data source)``."""
    from ..data import build_dataset
    from ..storage import is_s3

    d, m = config.data, config.model
    options = dict(d.options)
    # nothing in bulk: no canvas cache to render, no up-front decode of every file
    options.pop("cache_dir", None)
    options.pop("verify", None)
    uri = options.get("uri") or options.get("root")
    if d.name == "parquet" and uri and is_s3(str(uri)):
        check_storage(str(uri), _data_key(options, "train"), write=False)
    splits = list(splits or dict.fromkeys(["train", d.val_split]))
    sizes, need, how = {}, None, ""
    categories: dict[str, tuple[str, ...]] = {}  # a detection set's, by split
    for split in splits:
        key = _data_key(options, split)
        try:
            if d.name == "parquet" and uri:
                _check_shard_task(str(uri), split, m.task, key)
            dataset = build_dataset(d.name, split, image_size=m.image_size, seed=d.seed, **options)
        except OSError as exc:  # missing or empty folders, storage
            raise PreflightError(key, _one_line(str(exc))) from None
        except PreflightError:
            raise
        except ValueError as exc:  # options the dataset rejects
            raise PreflightError("data", _one_line(str(exc))) from None
        sizes[split] = len(dataset)
        if sizes[split] < 1:
            raise PreflightError(key, f"the {d.name} {split} split has no items")
        if m.task == DETECTION_TASK:
            categories[split] = tuple(dataset.categories)
        elif need is None:
            need, how = dataset_labels(dataset)
    try:
        source = dataset_source(d.name, options)
    except (ValueError, OSError):
        source = str(uri) if uri else None
    named = f"the {d.name} data" + (f" in {source}" if source else "")
    if categories:
        need = _object_classes(categories, named, m.num_classes)
    elif need is not None and need > m.num_classes:
        raise PreflightError(
            "model.num_classes",
            f"is {m.num_classes}, but {named} have labels up to {need - 1} (from {how}): set model.num_classes={need}",
        )
    counts = ", ".join(f"{n} {s}" for s, n in sizes.items())
    return (
        f"data: {d.name} "
        + (f"from {source}" if source else "(generated)")
        + f": {counts} items"
        + (f", {need} {'object ' if categories else ''}classes" if need else "")
    ), source or ""


def _check_shard_task(uri: str, split: str, task: str, key: str) -> None:
    """Raise :class:`PreflightError` (``key``: where the uri is set) unless ``split``'s shards
    under ``uri`` hold what ``task`` learns, as their manifest says: detection shards
    for ``model.task: detection``, classification or dense ones for the other tasks.
    Read before the shards are opened, so this is what a mismatch reports."""
    from ..data.parquet import resolve_shard_dir
    from ..data.shards import MANIFEST

    folder, manifest = resolve_shard_dir(uri, split)
    held = manifest.task if manifest else None
    if task == DETECTION_TASK and held != "detection":
        what = f"{held} shards (no object boxes)" if held else f"shards without a {MANIFEST} (so no detection shards)"
        raise PreflightError(
            key,
            f"{folder} holds {what}, but model.task is 'detection': prepare detection shards "
            "(`splitvit data prepare coco|fashion-det ...`) or set model.task",
        )
    if task != DETECTION_TASK and held == "detection":
        raise PreflightError(
            key,
            f"{folder} holds detection shards (boxes and masks of objects), but model.task is {task!r}: "
            "set model.task=detection, or point it at classification or dense shards",
        )


def _object_classes(categories: Mapping[str, tuple[str, ...]], named: str, num_classes: int) -> int:
    """The object classes ``K`` of a detection set whose splits name ``categories``:
    :class:`PreflightError` unless every split names the same (labels ``1..K`` mean
    one class throughout) and ``num_classes`` is ``K`` (the background not counted)."""
    (first, classes), *others = categories.items()
    for split, other in others:
        if other != classes:
            differ = sorted(set(classes) ^ set(other))
            how = f"{', '.join(differ[:5])} in one only" if differ else "the same names in another order"
            raise PreflightError(
                "data",
                f"{named}: the {first} and {split} splits name different categories ({len(classes)} and "
                f"{len(other)}: {how}), so their labels would mean different classes",
            )
    if num_classes != len(classes):
        raise PreflightError(
            "model.num_classes",
            f"is {num_classes}, but {named} have {len(classes)} object classes (labels 1..{len(classes)}; "
            f"the background is not counted): set model.num_classes={len(classes)}",
        )
    return len(classes)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 3 else lines[0]


# ---------------------------------------------------------------------- the whole preflight
def preflight(
    config: ExperimentConfig,
    *,
    ray_address: str | None = None,
    tracking_uri: str | None = None,
    trial_resources: Mapping[str, float] | None = None,
    trial_key: str = "search.trial_resources",
    check_ray: bool = True,
    worker_logs: bool | None = None,
) -> PreflightReport:
    """Every check of the module docstring for a run of ``config``; the cheap ones
    first, joining a Ray cluster (``ray_address`` or ``$RAY_ADDRESS``) last.

    ``tracking_uri`` is checked instead of the config's own (a study's runs log
    nothing themselves; its parent run does); ``trial_resources`` is a Tune trial's
    driver bundle (sweep, study); ``worker_logs`` goes to ``init_ray`` when joining a
    cluster. Raises :class:`~splitvit.config.ConfigError` for a bad config (checked
    first, in well under a second), else :class:`PreflightError`.
    """
    # imported here: it loads torch and timm, which the command line's own checks of an
    # address, a store or a folder (this module's other functions) do not need
    from ..train.experiment import validate_experiment

    start = time.monotonic()
    validate_experiment(config)
    report = PreflightReport()
    address, source = resolve_ray_address(ray_address)
    if address == "local":  # a new Ray on this machine, as without an address
        address = None
    import ray

    joined = ray.is_initialized()
    if check_ray and address and not joined:
        check_ray_address(address, source)
        report.add(f"Ray: {address} answers")
    if check_ray and not address and not joined:
        report.add(
            check_capacity(
                config.scaling, local_nodes(), where="this machine", extra=trial_resources, extra_key=trial_key
            )
        )
    uri = tracking_uri or (config.tracking_uri() if config.tracking.enabled else None)
    if uri:
        report.add(check_tracking(uri, _tracking_key(config)))
    report.add(check_storage(config.storage.path if config.storage.is_remote else config.storage.resolved_path()))
    report.data_line, report.data_source = check_data(config)
    report.add(report.data_line)
    if check_ray and (address or joined):
        if not joined:
            from ..train.ray_trainer import init_ray

            init_ray(ray_address, worker_logs=worker_logs)
        nodes, declared = ray_nodes()
        where = (
            "the cluster"
            + (f" at {address}" if address else "")
            + (" (as far as its autoscaler may scale it)" if declared else "")
        )
        report.add(check_capacity(config.scaling, nodes, where=where, extra=trial_resources, extra_key=trial_key))
    report.seconds = time.monotonic() - start
    log.info("preflight passed in %.1fs", report.seconds)
    return report


def preflight_eval(checkpoint: str, device: str = "cpu") -> PreflightReport:
    """The preflight of ``splitvit eval``: the device exists, an ``s3://`` checkpoint's
    endpoint, bucket and credentials answer (a read-only check)."""
    from ..storage import is_s3

    report = PreflightReport()
    start = time.monotonic()
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        index = int(device.split(":", 1)[1]) if ":" in device and device.split(":", 1)[1].isdigit() else 0
        if index >= count:
            raise PreflightError(
                "--device", f"{device}: this machine has {count} CUDA GPU(s)" + ("" if count else "; use --device cpu")
            )
    report.add(f"device: {device}")
    if is_s3(checkpoint):
        report.add(check_storage(checkpoint, "checkpoint", write=False))
    report.seconds = time.monotonic() - start
    return report
