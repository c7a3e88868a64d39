"""The two steps of 2026-12-05, old and new, timed interleaved in one process.

    .venv/bin/python docs/measurements/cpu-2026-12-05-speed/stage_ab.py

On the dense study's recipe (random weights, thresholds calibrated to 50% and 70% of
the tokens; ratio 1.0 is the ``full`` policy): the fine map the dense head reads (old:
``_to_layout`` + ``_fill_fine``, a scatter and a masked sum of every level; new:
``_scatter_to_fine``, one row gather), checked equal first; and the coarse levels' 2x2
pooling (old: ``F.avg_pool2d``; new: ``_area_downsample``). Medians of 21 rounds.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "platform"))  # this checkout's splitvit

from splitvit.bench.parts import _images  # noqa: E402
from splitvit.model.splitvit import _area_downsample  # noqa: E402
from splitvit.study.spec import load_study  # noqa: E402
from splitvit.train.experiment import build_model  # noqa: E402
from splitvit.train.steps import calibrate_thresholds  # noqa: E402

METHOD = "split-0.5-agg-mixed-ctx"
BATCHES = (1, 8, 64, 256)


def interleaved(steps: dict[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, float]:
    """Median ms per call of each step, the steps taking turns round by round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(3):
            step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(inner):
                step()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def calls_per_round(batch: int) -> int:
    return 20 if batch < 64 else (4 if batch == 64 else 1)


def main() -> None:
    torch.manual_seed(0)
    spec = load_study(f"{Path(__file__).resolve().parents[3]}/studies/study_fashion_seg.yaml", methods=[METHOD, "full"])
    base = build_model(spec.run_config(0, METHOD, "bench").model, pretrained=False).eval()
    images = _images(base, 256, 0, torch.device("cpu"))
    print("threads", torch.get_num_threads())
    for ratio in (0.5, 0.7, 1.0):
        model = copy.deepcopy(base)
        if ratio == 1.0:
            model.set_policy("full")
        else:
            model.set_thresholds(calibrate_thresholds(model, images, ratio))
        for batch in BATCHES:
            with torch.inference_mode():
                enc = model._encode_leaves(images[:batch], None, None, False, None, None)
                tokens = enc.features[:, model.vit.num_prefix_tokens :]

                def old(model=model, enc=enc, tokens=tokens):
                    grids = model._to_layout(tokens, enc.layout, enc.leaves, enc.geometry)
                    return model._fill_fine(grids, enc.leaves, enc.geometry).permute(0, 3, 1, 2)

                def new(model=model, enc=enc):
                    return model._scatter_to_fine(enc.features, enc.layout, enc.leaves, enc.geometry)

                assert torch.equal(old(), new())
                ms = interleaved({"old": old, "new": new}, 21, calls_per_round(batch))
            print(f"fine map  ratio {ratio} batch {batch:3d}: old {ms['old']:.3f} ms new {ms['new']:.3f} ms")
    for batch in BATCHES:
        x = images[:batch]
        with torch.inference_mode():
            steps = {"old": lambda x=x: F.avg_pool2d(x, 2), "new": lambda x=x: _area_downsample(x, 2)}
            ms = interleaved(steps, 21, calls_per_round(batch))
        print(f"2x2 pool batch {batch:3d}: old {ms['old']:.3f} ms new {ms['new']:.3f} ms")


if __name__ == "__main__":
    main()
