"""Training checkpoints: what a Ray Train checkpoint folder holds, and reading it back.

A checkpoint folder (one per epoch, ``checkpoint_epoch0003``) holds:

* ``model.pt`` — :meth:`SplitViT.save`'s payload (``spec`` + ``state_dict``) plus
  ``epoch``, ``metrics`` and the (redacted) experiment ``config``; so
  ``SplitViT.load(".../model.pt")`` rebuilds the model;
* ``train_state.pt`` — optimizer, LR scheduler, epoch, global step, metrics;
* ``rng_rank<r>.pt`` — each worker's RNG states (torch, CUDA, numpy, Python and the
  warm-up split generator), so a resumed run draws what the uninterrupted one would;
* ``metrics.json`` — the epoch's figures, for people.

Checkpoints may live in a local folder or under ``s3://``; :func:`fetch_checkpoint`
copies one (a folder or a ``model.pt``) to a local temporary folder with pyarrow.fs.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"


def rng_file(rank: int) -> str:
    """Name of worker ``rank``'s RNG-state file."""
    return f"rng_rank{rank}.pt"


def checkpoint_dir_name(epoch: int) -> str:
    """The checkpoint folder name of ``epoch`` (unique per epoch, sorts by epoch)."""
    return f"checkpoint_epoch{epoch:04d}"


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """This process's RNG states (and ``generator``'s)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def write_metrics(folder: Path, metrics: dict[str, Any]) -> None:
    """``metrics.json`` in ``folder``."""
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True, default=float) + "\n")


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
            raise FileNotFoundError(f"no checkpoint at {uri} (expected a checkpoint folder holding {MODEL_FILE}, or the file)")
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
        raise FileNotFoundError(f"no checkpoint at {uri} (expected a checkpoint folder holding {MODEL_FILE}, or the file)")
    local_dir = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="splitvit-ckpt-"))
    local_dir.mkdir(parents=True, exist_ok=True)
    local = local_dir / Path(fs_path).name
    with fs.open_input_stream(fs_path) as src, open(local, "wb") as out:
        shutil.copyfileobj(src, out, length=1 << 22)
    return local


def load_payload(uri: str | Path) -> dict[str, Any]:
    """The ``model.pt`` payload of checkpoint ``uri`` (see :func:`fetch_checkpoint`)."""
    local = fetch_checkpoint(uri)
    try:
        return torch.load(local, map_location="cpu", weights_only=False)
    finally:
        if is_uri(str(uri)):
            shutil.rmtree(local.parent, ignore_errors=True)


def init_weights(model: torch.nn.Module, uri: str | Path) -> list[str]:
    """Copy into ``model`` every tensor of checkpoint ``uri`` whose name and shape match.

    Used to start a run from another run's weights (``model.init_from``), e.g. every
    method of a study from one warmed-up backbone: the policy's own parameters are
    carried over only where both models have them; the split thresholds never are.
    Returns the names of ``model``'s
    tensors left as initialised; raises ``ValueError`` when any of the model's ViT
    backbone tensors is missing from the checkpoint or shaped differently (a
    different architecture), the classifier head excepted.
    """
    state = load_payload(uri)["state_dict"]
    own = model.state_dict()
    # the split thresholds are the run's own setting (or its calibration), not weights
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape and k != "thresholds"}
    backbone = [k for k in own if k.startswith("vit.") and not k.startswith("vit.head.")]
    missing = [k for k in backbone if k not in matched]
    if missing:
        raise ValueError(f"model.init_from: checkpoint {uri} has no ViT weights of this model's shapes for "
                         f"{len(missing)} of its {len(backbone)} backbone tensors (e.g. {missing[0]}): a different architecture?")
    model.load_state_dict(matched, strict=False)
    return sorted(set(own) - set(matched))
