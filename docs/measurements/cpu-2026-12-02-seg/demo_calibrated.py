"""The smoke sweep's trials at calibrated token ratios instead of searched thresholds.

    .venv/bin/python docs/measurements/cpu-2026-12-02-seg/demo_calibrated.py runs/smoke-A runs/smoke-B ...

For each sweep folder (``splitvit sweep search_spaces/smoke.yaml``), every trial's last
checkpoint is calibrated to each token ratio on validation images 512-1023 and
evaluated on images 0-511; printed: the best accuracy over the sweep's trials at each
ratio, and the token ratio it measured. Stage two searches raw thresholds, so a policy
whose scores crowd into a narrow band could lose the sweep's hypervolume to the search
rather than to its ranking; calibrated thresholds take the search out.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "platform"))

from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402

RATIOS = [0.08, 0.1, 0.15, 0.2, 0.3, 0.4]


def main() -> None:
    torch.set_num_threads(1)
    for sweep in sys.argv[1:]:
        best = dict.fromkeys(RATIOS, (0.0, 0.0))
        for checkpoint in sorted(glob.glob(f"{sweep}/train/*/checkpoint_epoch0003")):
            evaluator = CheckpointEvaluator(checkpoint, split="val", samples=512)
            held_out = CheckpointEvaluator(checkpoint, split="val", samples=1024).batches()
            calibration = torch.cat([batch[0] for batch in held_out])[512:]
            for ratio in RATIOS:
                result = evaluator.evaluate(evaluator.calibrate(calibration, ratio))
                if result["quality"] > best[ratio][0]:
                    best[ratio] = (result["quality"], result["token_ratio"])
        cells = ", ".join(f"{r:.2f}: {q:.3f} at {t:.3f}" for r, (q, t) in best.items())
        print(f"{sweep}: best accuracy at a calibrated ratio (measured ratio) {cells}")


if __name__ == "__main__":
    main()
