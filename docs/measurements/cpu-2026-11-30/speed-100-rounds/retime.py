"""Re-time the study's speed comparison for the 2- and 4-method-epoch seed-0
checkpoints, twice each, in one process (run from the repository root, with the
runs of both studies under runs/):

    .venv/bin/python docs/measurements/cpu-2026-11-30/speed-100-rounds/retime.py 40
"""

import glob
import sys

from splitvit.study.speed import speed_comparison

PAIRS = {"main (2 epochs)": "runs/study_fashion/train", "e4 (4 epochs)": "runs/study_e4/train"}


def latest(run: str) -> str:
    return sorted(glob.glob(run + "/checkpoint_epoch*"))[-1]


rounds = int(sys.argv[1])
for go in range(2):
    for name, train in PAIRS.items():
        r = speed_comparison(
            latest(f"{train}/split-0.45-s0"),
            latest(f"{train}/full-s0"),
            target_ratio=0.5,
            split="test",
            batch_size=64,
            rounds=rounds,
            calibration_samples=512,
            seed=0,
        )
        print(
            go,
            name,
            f"split {r.split_images_per_s:.0f} full {r.full_images_per_s:.0f} ratio {r.ratio:.2f} "
            f"fastest {r.ratio_fastest_round:.2f} ideal {r.ideal_ratio:.2f} tokens {r.token_fraction:.3f}",
            flush=True,
        )
