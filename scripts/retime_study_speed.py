"""Time a study's SPLIT checkpoint against its full-resolution one again, with more rounds.

    .venv/bin/python scripts/retime_study_speed.py SPLIT_RUN FULL_RUN [SPLIT_RUN FULL_RUN ...] \
        [--rounds 40] [--repeats 2] [--target-ratio 0.5]

Each pair is a SPLIT run and the full-resolution run of the same seed (a run folder,
whose last checkpoint is timed, or a checkpoint folder), e.g.
``runs/study_fashion/train/split-0.5-agg-mixed-ctx-s0 runs/study_fashion/train/full-s0``.
The SPLIT model is calibrated to ``--target-ratio`` on 512 validation canvases and both are
timed on a test batch of 64 in interleaved rounds, as the study's last step does; every pair is
timed ``--repeats`` times in one process, to show the spread between repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.study.speed import speed_comparison  # noqa: E402


def latest_checkpoint(run: Path) -> Path:
    """A run folder's last checkpoint, or the folder itself when it is a checkpoint."""
    checkpoints = sorted(run.glob("checkpoint_epoch*"))
    return checkpoints[-1] if checkpoints else run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="SPLIT_RUN FULL_RUN pairs")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per timing")
    parser.add_argument("--repeats", type=int, default=2, help="timings of every pair")
    parser.add_argument("--target-ratio", type=float, default=0.5, help="the SPLIT model's token ratio")
    args = parser.parse_args()
    if len(args.runs) % 2:
        parser.error("runs come in pairs: SPLIT_RUN FULL_RUN")
    pairs = list(zip(args.runs[::2], args.runs[1::2]))
    for repeat in range(args.repeats):
        for split_run, full_run in pairs:
            r = speed_comparison(
                str(latest_checkpoint(split_run)),
                str(latest_checkpoint(full_run)),
                target_ratio=args.target_ratio,
                split="test",
                batch_size=64,
                rounds=args.rounds,
                calibration_samples=512,
                seed=0,
            )
            print(
                repeat,
                split_run.name,
                f"split {r.split_images_per_s:.0f} full {r.full_images_per_s:.0f} ratio {r.ratio:.2f} "
                f"fastest {r.ratio_fastest_round:.2f} ideal {r.ideal_ratio:.2f} tokens {r.token_fraction:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
