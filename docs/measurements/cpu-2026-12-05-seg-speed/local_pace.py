"""The dense study's trained control and recipe fine-tuned in the plain loop
(``splitvit.train.local.fit_local``, no Ray) on the study's own training canvases: one
epoch of 1,600 canvases each, batch 32, one thread, the learning rate at 0 (the weights
and the recipe's splits stay as trained), alternating, two rounds. Prints each epoch's
images/s (data loading included, as the study's pace).

    .venv/bin/python docs/measurements/cpu-2026-12-05-seg-speed/local_pace.py
    MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000 \\
        .venv/bin/python docs/measurements/cpu-2026-12-05-seg-speed/local_pace.py

Needs a finished dense study's checkpoints under runs/study_fashion_seg/train.
"""

from __future__ import annotations

import torch
from torch.utils.data import Subset

from splitvit.data import build_dataset
from splitvit.study.spec import load_study
from splitvit.train.checkpoints import load_payload, model_from_payload
from splitvit.train.local import fit_local

TRAIN = "runs/study_fashion_seg/train"
METHODS = ("full", "split-0.5-agg-mixed-ctx")
CANVASES = 1600


def main() -> None:
    torch.set_num_threads(1)  # as each study run
    spec = load_study("studies/study_fashion_seg.yaml", methods=list(METHODS))
    for round_ in range(2):
        for method in METHODS:
            config = spec.run_config(0, method, "bench")
            checkpoint = f"{TRAIN}/{method}-s0/checkpoint_epoch0011"
            model = model_from_payload(load_payload(checkpoint), checkpoint)
            data = config.data
            canvases = build_dataset(
                data.name, "train", seed=data.seed, image_size=config.model.image_size, **data.options
            )
            (epoch,) = fit_local(
                model, Subset(canvases, range(CANVASES)), config.train.loss_config(), epochs=1, batch_size=32, lr=0.0
            )
            pace, share = epoch["images_per_s"], epoch["token_ratio"]
            print(f"round {round_} {method}: {pace:.1f} images/s at {share:.2f} of the tokens")


if __name__ == "__main__":
    main()
