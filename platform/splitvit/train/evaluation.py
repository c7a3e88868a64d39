"""Evaluate a training checkpoint (local or ``s3://``) on its experiment's data."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..model import validate_thresholds
from .checkpoints import load_payload, model_from_payload
from .steps import evaluate

log = logging.getLogger(__name__)


def evaluate_checkpoint(
    checkpoint: str,
    *,
    thresholds: list[float] | None = None,
    policy: str | None = None,
    split: str = "val",
    batch_size: int | None = None,
    samples: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Accuracy (or mIoU), tokens per image, token ratio and images/s of a checkpoint;
    on data with object masks also ``fine_on_object`` and ``object_coverage``.

    Args:
        checkpoint: a checkpoint folder or its ``model.pt``, local or ``s3://``.
        thresholds: per-level split thresholds for this evaluation (validated).
        policy: evaluate with another split policy (``entropy``, ``full``...) on the
            checkpoint's backbone.
        split: the data split (``val`` or ``test``) of the experiment's dataset.
        batch_size: evaluation batch size (default: the experiment's).
        samples: evaluate on this many images (default: the experiment's split size).
        device: torch device.
    """
    payload = load_payload(checkpoint)
    overrides = {"policy": policy} if policy else {}
    model = model_from_payload(payload, str(checkpoint), **overrides).to(device)
    if thresholds is not None:
        validate_thresholds(thresholds, model.levels)  # a clear error before any data are read
    config = payload.get("config") or {}
    data = config.get("data") or {}
    if not data.get("name"):
        raise ValueError(f"checkpoint {checkpoint} holds no experiment config; it was not written by splitvit train")
    options = dict(data.get("options") or {})
    if samples is not None:
        options[f"{split}_samples"] = samples
    from ..data import build_dataset

    dataset = build_dataset(
        data["name"],
        split,
        image_size=model.geometry.image_size[0],
        interpolation=model.data_config["interpolation"],
        seed=int(data.get("seed", 0)),
        **options,
    )
    loader = DataLoader(
        dataset, batch_size=batch_size or data.get("eval_batch_size") or data.get("batch_size") or 64, shuffle=False
    )
    use_amp = torch.device(device).type == "cuda"
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=use_amp):
        result = evaluate(
            model,
            loader,
            thresholds=thresholds,
            num_classes=(config.get("model") or {}).get("num_classes"),
            object_masks=True,  # counted where the data carry object masks
        )
    used = thresholds if thresholds is not None else model.thresholds.tolist()
    return {
        **result,
        "checkpoint": str(checkpoint),
        "epoch": payload.get("epoch"),
        "policy": model.policy.name,
        "thresholds": [float(t) for t in used],
        "split": split,
    }
