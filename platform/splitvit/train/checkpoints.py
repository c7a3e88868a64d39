"""Training checkpoints: what a Ray Train checkpoint folder holds, and reading it back.

A checkpoint folder (one per epoch, ``checkpoint_epoch0003``) holds:

* ``model.pt`` — :meth:`SplitViT.save`'s payload (:class:`~splitvit.model.spec.CheckpointPayload`:
  ``spec`` + ``state_dict``, whose ``input_mean`` / ``input_std`` buffers normalise the
  inputs, + ``data_config``: timm's mean, std, interpolation and crop settings) plus
  ``epoch``, ``metrics`` and the (redacted) experiment ``config``; so
  ``SplitViT.load(".../model.pt")`` rebuilds the model;
* ``train_state.pt`` — :class:`TrainState`: optimizer, LR scheduler, epoch, global step, metrics;
* ``rng_rank<r>.pt`` — :class:`RngState`: each worker's RNG states (torch, CUDA, numpy,
  Python and the warm-up split generator), so a resumed run draws what the
  uninterrupted one would;
* ``metrics.json`` — the epoch's figures, for people;
* ``history.json`` — ``{"history": [...]}``, every epoch's figures so far, earlier
  attempts' included (a resumed run carries them on): the run's curves, e.g. whether
  a study's reference model converged.

Checkpoints may live in a local folder or under ``s3://``; :func:`fetch_checkpoint`
copies one (a folder or a ``model.pt``) to a local temporary folder with pyarrow.fs.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict

import numpy as np
import torch

from ..errors import DeterministicError

if TYPE_CHECKING:
    from ..model.spec import CheckpointPayload

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.json"
#: Ray Train's record of a run's reported checkpoints (the one a re-run resumes from)
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
PAYLOAD_KEYS = ("spec", "state_dict")


class CheckpointError(DeterministicError, ValueError):
    """A file that is no readable SplitViT checkpoint; ``source`` names it, ``reason``
    says why. Deterministic: reading it again fails the same way (no retry)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"checkpoint {source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self):  # Ray pickles a worker's exception: rebuild from source and reason
        return (type(self), (self.source, self.reason), dict(self.__dict__))


class RngState(TypedDict, total=False):
    """A worker's random states (``rng_rank<r>.pt``): torch's, numpy's and Python's, CUDA's
    where it has GPUs, and the warm-up split ``generator``'s where it was given one."""

    torch: Required[torch.Tensor]
    numpy: Required[tuple[str, np.ndarray, int, int, float]]  # np.random.get_state()
    python: Required[tuple[int, tuple[int, ...], float | None]]  # random.getstate()
    cuda: list[torch.Tensor]
    generator: torch.Tensor


class TrainState(TypedDict, total=False):
    """What ``train_state.pt`` holds: the epoch done, the optimizer's and LR scheduler's
    own state dicts, that epoch's figures and every epoch's so far (older checkpoints
    lack ``history``), the workers and the steps taken."""

    epoch: Required[int]
    optimizer: Required[dict[str, Any]]  # torch's Optimizer.state_dict(), as torch reads it back
    scheduler: Required[dict[str, Any]]  # torch's LRScheduler.state_dict()
    metrics: dict[str, float]
    history: list[dict[str, float]]
    world_size: int
    global_step: int


def rng_file(rank: int) -> str:
    """Name of worker ``rank``'s RNG-state file."""
    return f"rng_rank{rank}.pt"


def checkpoint_dir_name(epoch: int) -> str:
    """The checkpoint folder name of ``epoch`` (unique per epoch, sorts by epoch)."""
    return f"checkpoint_epoch{epoch:04d}"


def rng_state(generator: torch.Generator | None = None) -> RngState:
    """This process's RNG states (and ``generator``'s)."""
    state: RngState = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: RngState, generator: torch.Generator | None = None) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def write_metrics(folder: Path, metrics: dict[str, float]) -> None:
    """``metrics.json`` in ``folder``: an epoch's figures."""
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True, default=float) + "\n")


def write_history(folder: Path, history: list[dict[str, float]]) -> None:
    """``history.json`` in ``folder``: every epoch's figures so far."""
    (folder / HISTORY_FILE).write_text(json.dumps({"history": history}, default=float) + "\n")


def read_history(checkpoint_uri: str) -> list[dict[str, float]]:
    """The per-epoch figures in checkpoint folder ``checkpoint_uri`` (local or
    ``s3://``); ``[]`` for a checkpoint written before they were kept."""
    from ..storage import exists, join_uri, read_bytes

    uri = join_uri(checkpoint_uri, HISTORY_FILE)
    if not exists(uri):
        return []
    return list(json.loads(read_bytes(uri))["history"])


def is_uri(path: str) -> bool:
    """True for ``scheme://...`` other than ``file://``."""
    return "://" in path and not path.startswith("file://")


def fetch_checkpoint(uri: str | Path, dest: str | Path | None = None) -> Path:
    """A local path to the ``model.pt`` of checkpoint ``uri``.

    ``uri`` may be a checkpoint folder or a ``model.pt`` file, local or ``s3://``
    (read with pyarrow.fs through :func:`splitvit.storage.filesystem_for`: endpoint
    and credentials from the usual AWS settings). A remote checkpoint is copied into ``dest`` (default: a new
    temporary folder the caller may delete).
    """
    uri = str(uri)
    if not is_uri(uri):
        path = Path(uri[len("file://") :] if uri.startswith("file://") else uri).expanduser()
        if path.is_dir():
            path = path / MODEL_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no checkpoint at {uri} (expected a checkpoint folder holding {MODEL_FILE}, or the file)"
            )
        return path
    import pyarrow.fs as pafs

    from ..storage import filesystem_for

    fs, fs_path = filesystem_for(uri)
    fs_path = fs_path.rstrip("/")
    info = fs.get_file_info(fs_path)
    if info.type == pafs.FileType.Directory:
        fs_path = f"{fs_path}/{MODEL_FILE}"
        info = fs.get_file_info(fs_path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(
            f"no checkpoint at {uri} (expected a checkpoint folder holding {MODEL_FILE}, or the file)"
        )
    local_dir = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="splitvit-ckpt-"))
    local_dir.mkdir(parents=True, exist_ok=True)
    local = local_dir / Path(fs_path).name
    with fs.open_input_stream(fs_path) as src, open(local, "wb") as out:
        shutil.copyfileobj(src, out, length=1 << 22)
    return local


def load_payload(uri: str | Path) -> CheckpointPayload:
    """The ``model.pt`` payload of checkpoint ``uri`` (see :func:`fetch_checkpoint`).

    Raises:
        FileNotFoundError: nothing at ``uri``.
        CheckpointError: a file torch cannot read (truncated, garbage) or a torch file
            that is no SplitViT checkpoint (no ``spec`` and ``state_dict``).
    """
    local = fetch_checkpoint(uri)
    try:
        return read_payload(local, str(uri))
    finally:
        if is_uri(str(uri)):
            shutil.rmtree(local.parent, ignore_errors=True)


def read_payload(path: str | Path, source: str | None = None) -> CheckpointPayload:
    """Read a local ``model.pt`` and check it is a SplitViT checkpoint (``source``: the
    name errors give, default ``path``); see :func:`load_payload`."""
    source = source or str(path)
    payload = torch_load(path, source)
    check_payload(payload, source)
    return payload


def torch_load(path: str | Path, source: str | None = None) -> Any:
    """``torch.load`` of a local file onto the CPU; a file torch cannot read raises
    :class:`CheckpointError` naming ``source`` (default ``path``) and its size.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: a truncated or foreign file.
    """
    from ..errors import describe

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle: the file is not a checkpoint
        try:
            size = f"{Path(path).stat().st_size} bytes"
        except OSError:
            size = "size unknown"
        raise CheckpointError(
            source or str(path),
            f"not a readable torch file ({size}; truncated, or not written by torch.save?): {describe(exc)}",
        ) from exc


def read_training_checkpoint(
    folder: Path, rank: int, source: str
) -> tuple[CheckpointPayload, TrainState, RngState | None]:
    """What a resumed worker needs from the local checkpoint ``folder`` (``source``: its
    URI, for errors): the model payload, the training state and rank ``rank``'s RNG
    state (``None`` when the checkpoint has none for it, e.g. more workers now).

    Raises:
        CheckpointError: a file is missing, truncated or not torch's, named by its URI.
    """
    loaded = []
    for name in (MODEL_FILE, STATE_FILE):
        try:
            loaded.append(torch_load(folder / name, f"{source}/{name}"))
        except FileNotFoundError:
            raise CheckpointError(f"{source}/{name}", "missing") from None
    payload, state = loaded
    check_payload(payload, f"{source}/{MODEL_FILE}")
    own = folder / rng_file(rank)
    rng = torch_load(own, f"{source}/{own.name}") if own.is_file() else None
    return payload, state, rng


def earlier_checkpoints(path: str, filesystem: Any) -> list[str]:
    """The epoch checkpoint folders beside checkpoint folder ``path`` (on pyarrow
    ``filesystem``) that sort before it, newest first: where a resume falls back to
    when ``path`` is unreadable. ``[]`` when the folder cannot be listed."""
    import posixpath

    import pyarrow.fs as pafs

    parent, own = posixpath.split(path.rstrip("/"))
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(parent, recursive=False, allow_not_found=True))
    except (OSError, ValueError):
        return []
    names = sorted(
        i.base_name
        for i in infos
        if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_epoch") and i.base_name < own
    )
    return [posixpath.join(parent, name) for name in reversed(names)]


def checkpoint_problem(checkpoint_uri: str) -> str | None:
    """Why checkpoint folder ``checkpoint_uri`` (local or ``s3://``) cannot be resumed
    from, found cheaply (its files present, each a whole zip archive as ``torch.save``
    writes: a truncated file has no end record), else None. A cheap look for the
    driver's warning before training; the worker's full read decides."""
    import zipfile

    from ..storage import filesystem_for

    try:
        fs, path = filesystem_for(checkpoint_uri)
    except (OSError, ValueError) as exc:
        return f"{checkpoint_uri}: {exc}"
    path = path.rstrip("/")
    for name in (MODEL_FILE, STATE_FILE):
        try:
            with fs.open_input_file(f"{path}/{name}") as f:
                zipfile.ZipFile(f).close()  # reads the archive's directory at its end
        except FileNotFoundError:
            return f"{checkpoint_uri.rstrip('/')}/{name} is missing"
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            size = size_of(fs, path, name)
            return f"{checkpoint_uri.rstrip('/')}/{name} is not a readable torch file ({size}): {exc}"
    return None


def size_of(fs: Any, path: str, name: str) -> str:
    """``"N bytes"`` of ``path/name`` on ``fs``, or ``"size unknown"``."""
    try:
        return f"{fs.get_file_info(f'{path}/{name}').size} bytes"
    except (OSError, ValueError, TypeError):
        return "size unknown"


def check_payload(payload: Any, source: str) -> None:
    """A CheckpointError unless ``payload`` is what :meth:`SplitViT.save` writes."""
    expected = "a SplitViT checkpoint holds a dict with 'spec' and 'state_dict' (SplitViT.save, splitvit train)"
    if not isinstance(payload, dict):
        raise CheckpointError(
            source, f"a torch file holding a {type(payload).__name__}, not a SplitViT checkpoint: {expected}"
        )
    missing = [k for k in PAYLOAD_KEYS if k not in payload]
    if missing:
        raise CheckpointError(
            source,
            f"a torch file without {' and '.join(repr(k) for k in missing)}, not a SplitViT checkpoint: {expected}",
        )
    if not isinstance(payload["spec"], dict) or "name" not in payload["spec"]:
        raise CheckpointError(source, "its 'spec' names no timm model ('spec.name'): not written by SplitViT.save")


def model_from_payload(payload: CheckpointPayload, source: str, **overrides: Any):
    """:meth:`SplitViT.from_checkpoint` (:meth:`SplitDetector.from_checkpoint` for a
    detector's), with a CheckpointError naming ``source`` when the weights do not fit
    the model the spec builds."""
    from ..model import SplitViT
    from ..model.detection import SplitDetector

    check_payload(payload, source)
    cls = SplitDetector if payload.get("kind") == "detector" else SplitViT
    try:
        return cls.from_checkpoint(payload, **overrides)
    except (RuntimeError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(source, f"its weights do not fit the model its spec builds: {first}") from exc


def latest_checkpoint(run_uri: str) -> str | None:
    """The checkpoint a re-run of the Ray Train run at ``run_uri`` resumes from: the
    latest committed one in Ray's snapshot, else the newest epoch folder holding
    ``model.pt`` and ``train_state.pt``; None when there is none (or it cannot be read)."""
    import pyarrow.fs as pafs

    from ..storage import filesystem_for, join_uri

    try:
        fs, path = filesystem_for(run_uri)
    except (OSError, ValueError):
        return None
    path = path.rstrip("/")
    try:
        with fs.open_input_stream(f"{path}/{SNAPSHOT_FILE}") as f:
            latest = (json.loads(f.read().decode()).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
        if latest:
            return join_uri(run_uri, latest)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
        names = sorted(
            i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
        )
        for name in reversed(names):
            files = {i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{path}/{name}"))}
            if {MODEL_FILE, STATE_FILE} <= files:
                return join_uri(run_uri, name)
    except (OSError, ValueError):
        pass
    return None


def init_weights(model: torch.nn.Module, uri: str | Path) -> list[str]:
    """Copy into ``model`` every tensor of checkpoint ``uri`` whose name and shape match.

    Used to start a run from another run's weights (``model.init_from``), e.g. every
    method of a study from one warmed-up backbone: the policy's own parameters are
    carried over only where both models have them; the split thresholds and the
    budget a conditioned policy is told never are. A detector
    (:class:`~splitvit.model.detection.SplitDetector`) starts from a detector's
    checkpoint (every tensor, heads included) or from a classifier's, whose SplitViT
    becomes its backbone (the heads keep their initialisation).
    Returns the names of ``model``'s
    tensors left as initialised; raises ``ValueError`` when any of the model's ViT
    backbone tensors is missing from the checkpoint or shaped differently (a
    different architecture), the classifier head excepted.
    """
    from ..model.detection import SplitDetector
    from ..model.splitvit import fill_legacy_normalisation

    state = dict(load_payload(uri)["state_dict"])
    # a SplitViT's tensors sit under "backbone." in a detector
    prefix = "backbone." if isinstance(model, SplitDetector) else ""
    if prefix and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}  # a classifier's checkpoint: its SplitViT
    # an older checkpoint's backbone was trained on un-normalised inputs: its
    # normalisation (mean 0, std 1) comes with its weights, like the newer ones'
    fill_legacy_normalisation(state, prefix)
    own = model.state_dict()
    # the split thresholds and the budget the policy is told are the run's own settings
    # (or its calibration), not weights
    settings = (prefix + "thresholds", prefix + "budget")
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape and k not in settings}
    backbone = [k for k in own if k.startswith(prefix + "vit.") and not k.startswith(prefix + "vit.head.")]
    missing = [k for k in backbone if k not in matched]
    if missing:
        raise ValueError(
            f"model.init_from: checkpoint {uri} has no ViT weights of this model's shapes for "
            f"{len(missing)} of its {len(backbone)} backbone tensors (e.g. {missing[0]}): a different architecture?"
        )
    model.load_state_dict(matched, strict=False)
    return sorted(set(own) - set(matched))
