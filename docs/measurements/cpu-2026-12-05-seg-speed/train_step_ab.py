"""A study's recipe (or lever) against its control, one training step at a time
(issue 35's fine-tune-step goal), on their trained checkpoints: one optimisation step
each in turn on the same batch of the study's validation canvases (the study's batch
size, one torch thread as each study run has), medians of interleaved rounds. Round
``i`` is step ``i`` of an epoch, so a method with ``train.teacher_every: k`` runs its
teacher on every k-th round, as in training. The optimiser takes its whole step at a
learning rate of 0, so the weights, and the recipe's sampled splits, stay as trained.
Prints both steps' milliseconds, the recipe's token ratio and the control's step time
over the recipe's.

    .venv/bin/python docs/measurements/cpu-2026-12-05-seg-speed/train_step_ab.py \\
        STUDY CONTROL_CHECKPOINT RECIPE_CHECKPOINT [METHOD] [ROUNDS]

e.g. STUDY studies/study_fashion_seg.yaml and a finished study's
runs/study_fashion_seg/train/{full,split-0.5-agg-mixed-ctx}-s0/checkpoint_epoch0011;
METHOD: the study's method the recipe checkpoint trained as (default
split-0.5-agg-mixed-ctx), whose training settings the step uses.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from splitvit.study.spec import load_study
from splitvit.train.checkpoints import load_payload, model_from_payload
from splitvit.train.evaluation import CheckpointEvaluator
from splitvit.train.steps import model_classes, training_step

RECIPE, CONTROL = "split-0.5-agg-mixed-ctx", "full"  # the default recipe, the control
WARMUP = 3


def main(study: str, control_checkpoint: str, recipe_checkpoint: str, recipe: str, rounds: int) -> None:
    torch.set_num_threads(1)  # each study run has one thread (two runs share the 2 cores)
    spec = load_study(study, methods=[CONTROL, recipe])
    batch = spec.run_config(0, recipe, "bench").data.batch_size
    steps = {}
    for method, checkpoint in ((CONTROL, control_checkpoint), (recipe, recipe_checkpoint)):
        config = spec.run_config(0, method, "bench")
        model = model_from_payload(load_payload(checkpoint), checkpoint).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=config.train.weight_decay)
        steps[method] = (model, config.train.loss_config(), optimizer)
    images = CheckpointEvaluator(recipe_checkpoint, samples=batch).first_images(batch, split="val")
    model = steps[CONTROL][0]
    shape = (batch, *images.shape[-2:]) if model.task == "dense" else (batch,)
    target = torch.randint(0, model_classes(model), shape, generator=torch.Generator().manual_seed(0))
    ratios: list[float] = []

    def step(method: str, index: int) -> float:
        model, loss_config, optimizer = steps[method]
        started = time.perf_counter()
        loss, stats = training_step(model, images, target, loss_config, epoch=1, step=index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if method == recipe:
            ratios.append(stats["token_ratio"])
        return time.perf_counter() - started

    times: dict[str, list[float]] = {m: [] for m in steps}
    for i in range(WARMUP + rounds):
        for method in steps:
            seconds = step(method, i)
            if i >= WARMUP:
                times[method].append(seconds)
    # the mean over rounds: with a teacher on every k-th step the step times alternate
    control, split = (statistics.fmean(times[m]) for m in (CONTROL, recipe))
    print(f"torch {torch.__version__}, 1 thread, {rounds} interleaved rounds after {WARMUP} warm-up")
    print(f"{study}: {control_checkpoint} against {recipe_checkpoint} ({recipe})")
    print(
        f"batch {batch}: control step {control * 1e3:.1f} ms, {recipe} step {split * 1e3:.1f} ms (means) at "
        f"{statistics.fmean(ratios):.2f} of the tokens: its step runs {control / split:.2f}x the control's"
    )


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5, 6):
        sys.exit(__doc__)
    method = sys.argv[4] if len(sys.argv) > 4 else RECIPE
    main(*sys.argv[1:4], method, int(sys.argv[5]) if len(sys.argv) > 5 else 20)
