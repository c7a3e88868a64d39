"""A sweep's trials at calibrated token ratios instead of searched thresholds.

    .venv/bin/python scripts/sweep_calibrated_ratios.py SWEEP_DIR [SWEEP_DIR ...] [--ratios 0.08,0.1,0.15,0.2,0.3,0.4]

For each sweep folder (``splitvit sweep search_spaces/smoke.yaml`` writes one under
``runs/``), every trial's last checkpoint is calibrated to each token ratio on
validation images 512-1023 and evaluated on images 0-511; printed: the best accuracy
over the sweep's trials at each ratio, and the token ratio it measured. Stage two
searches raw thresholds, so a policy whose scores crowd into a narrow band could lose
the sweep's hypervolume to the search rather than to its ranking; calibrated
thresholds take the search out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402


def last_checkpoints(sweep: Path) -> list[Path]:
    """Each trial's last checkpoint in a sweep folder (``train/<trial>/checkpoint_epochNNNN``)."""
    trials = sorted(p for p in (sweep / "train").iterdir() if p.is_dir())
    return [sorted(t.glob("checkpoint_epoch*"))[-1] for t in trials if any(t.glob("checkpoint_epoch*"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders")
    parser.add_argument("--ratios", default="0.08,0.1,0.15,0.2,0.3,0.4", help="token ratios to calibrate to")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    torch.set_num_threads(1)
    for sweep in args.sweeps:
        best = dict.fromkeys(ratios, (0.0, 0.0))
        for checkpoint in last_checkpoints(sweep):
            evaluator = CheckpointEvaluator(str(checkpoint), split="val", samples=512)
            held_out = CheckpointEvaluator(str(checkpoint), split="val", samples=1024).batches()
            calibration = torch.cat([batch[0] for batch in held_out])[512:]
            for ratio in ratios:
                result = evaluator.evaluate(evaluator.calibrate(calibration, ratio))
                if result.quality > best[ratio][0]:
                    best[ratio] = (result.quality, result.token_ratio)
        cells = ", ".join(f"{r:.2f}: {q:.3f} at {t:.3f}" for r, (q, t) in best.items())
        print(f"{sweep}: best accuracy at a calibrated ratio (measured ratio) {cells}")


if __name__ == "__main__":
    main()
