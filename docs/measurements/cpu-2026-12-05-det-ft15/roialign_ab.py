"""A detection training step with torchvision's RoIAlign backward against the vectorised
one (`splitvit.model.roi_align`), interleaved in one process on the same batches.

    .venv/bin/python docs/measurements/cpu-2026-12-05-det-ft15/roialign_ab.py CHECKPOINT [STEPS] [ROUNDS]

CHECKPOINT: a detection study checkpoint (its model, data and SPLIT objective). Each round
trains STEPS steps from the checkpoint's weights with each pool class (SGD, one thread, the
study's batch of 16 training canvases) and prints ms per step and the first losses, which
agree until rounding differences grow; the last line gives the medians and their ratio.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "platform"))

from splitvit.config import SplitLossConfig  # noqa: E402
from splitvit.data import detection_collate  # noqa: E402
from splitvit.model.roi_align import MultiScaleRoIAlign  # noqa: E402
from splitvit.train.detection import detection_training_step  # noqa: E402
from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402

POOLS = {"torchvision": torchvision.ops.MultiScaleRoIAlign, "vectorised": MultiScaleRoIAlign}


def main() -> None:
    checkpoint = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.set_num_threads(1)  # as a study's run
    evaluator = CheckpointEvaluator(checkpoint, split="val", samples=16)
    detector = evaluator.model
    trained = evaluator.payload["config"]["train"]
    fields = {f.name for f in dataclasses.fields(SplitLossConfig)}
    cfg = SplitLossConfig(**{key: value for key, value in trained.items() if key in fields})
    loader = DataLoader(
        evaluator.split_dataset("train"),
        batch_size=16,
        shuffle=True,
        collate_fn=detection_collate,
        generator=torch.Generator().manual_seed(0),
    )
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == steps:
            break
    weights = {key: value.clone() for key, value in detector.state_dict().items()}

    def train(pool: type) -> tuple[float, list[float]]:
        detector.load_state_dict(weights)
        detector.roi_heads.box_roi_pool.__class__ = pool
        detector.roi_heads.mask_roi_pool.__class__ = pool
        optimizer = torch.optim.SGD([p for p in detector.parameters() if p.requires_grad], lr=1e-3)
        detector.train()
        torch.manual_seed(0)
        losses = []
        start = time.perf_counter()
        for step, (images, targets) in enumerate(batches):
            loss, _ = detection_training_step(detector, images, targets, cfg, epoch=5, step=step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return (time.perf_counter() - start) / len(batches), losses

    times: dict[str, list[float]] = {name: [] for name in POOLS}
    for round_ in range(rounds):
        for name, pool in POOLS.items():
            seconds, losses = train(pool)
            times[name].append(seconds)
            shown = " ".join(f"{value:.6f}" for value in losses[:3])
            print(f"{name:11s} round {round_}: {seconds * 1000:6.1f} ms/step  losses {shown} ... {losses[-1]:.6f}")
    before, after = (statistics.median(times[name]) for name in POOLS)
    print(
        f"{Path(checkpoint).parent.name}: median step torchvision {before * 1000:.1f} ms, "
        f"vectorised {after * 1000:.1f} ms: {before / after:.2f}x"
    )


if __name__ == "__main__":
    main()
