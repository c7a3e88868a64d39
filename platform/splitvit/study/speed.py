"""The study's speed step, on trained checkpoints: every method's evaluated points
side by side against full resolution (:func:`points_speed`, timed by
:func:`~splitvit.bench.speed.time_operating_points`, the timing routine sweeps use too)
and the matched SPLIT point (:func:`matched_speed`): read from that timing where it
timed the point, so the goal line and the speed table quote one measurement, else
timed on its own (:func:`speed_comparison`). Each result is a dataclass whose
``to_dict()`` is its part of the study's JSON (``speed``, ``point_speed``) and whose
``from_dict()`` reads it back.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..bench.speed import FullTiming, MachineInfo, SpeedRecord, TimedPoint, read_speed_fields, without_unset_backbone
from ..jsontypes import JsonObject
from .goals import StudyRow, matched_point
from .runs import MethodRun
from .spec import StudySpec

#: ``run(fn, *args, **kwargs)``: runs a timing where the checkpoints' device is
Runner = Callable[..., Any]

#: :attr:`MatchedSpeed.timing`: the point's figures are the speed table's (:func:`points_speed`)
POINTS_TIMING = "points"
#: :attr:`MatchedSpeed.timing`: the point was timed alone beside full resolution (:func:`speed_comparison`)
OWN_TIMING = "own"


def _here(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A timing run here, on the CPU."""
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class SpeedComparison:
    """A SPLIT checkpoint at a target ratio against the full-resolution checkpoint,
    timed interleaved on the same batch (:func:`speed_comparison`)."""

    batch_size: int
    rounds: int
    device: str
    thresholds: list[float]  # calibrated on validation images for the target ratio
    token_fraction: float  # SPLIT's tokens on the timed batch / full tokens
    ideal_ratio: float  # 1 / token_fraction: the speed-up if time followed tokens
    split_images_per_s: float  # at the median
    full_images_per_s: float
    ratio: float  # median full seconds / median SPLIT seconds: the measured speed-up
    ratio_fastest_round: float  # the same of the fastest rounds
    # a detector's backbones alone, timed in the same rounds (None for a classifier)
    backbone_split_images_per_s: float | None = field(default=None, kw_only=True)
    backbone_full_images_per_s: float | None = field(default=None, kw_only=True)
    backbone_ratio: float | None = field(default=None, kw_only=True)

    def to_dict(self) -> JsonObject:
        """The JSON form: one key per field, in field order (``backbone_*`` only for a detector)."""
        return without_unset_backbone(asdict(self))


@dataclass(frozen=True)
class MatchedSpeed(SpeedComparison):
    """The speed comparison of the study's matched point (the study JSON's ``speed``)."""

    method: str
    target_ratio: float | None
    seed: int  # the seed whose checkpoints were timed
    matches_full: bool  # the point is within the goal's points of full resolution
    metric: str  # the JSON's key for ``quality``
    quality: float  # the point's quality, the mean over seeds
    # which timing the figures are: POINTS_TIMING or OWN_TIMING (None: a file written
    # before the field existed, whose point was timed alone)
    timing: str | None = None

    def to_dict(self) -> JsonObject:
        """As in the study's JSON: the comparison's keys, then the point's (``timing``
        where known, so that older files read back to themselves)."""
        data = without_unset_backbone(asdict(self))
        del data["metric"], data["quality"]
        if data["timing"] is None:
            del data["timing"]
        data[self.metric] = self.quality
        return data

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> MatchedSpeed:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``, but for
        ``timing``, absent from files written before it existed)."""
        values = {"timing": None, **data, "metric": metric, "quality": data[metric]}
        return cls(**read_speed_fields(cls, values))


@dataclass(frozen=True)
class StudyTimedPoint(TimedPoint):
    """A method's evaluated point, timed against the full method's model."""

    method: str
    target_ratio: float | None  # None: a method evaluated once (coarse)
    seed: int


@dataclass(frozen=True)
class PointSpeed(SpeedRecord):
    """Every method's evaluated points of one seed timed against full resolution, side
    by side (the study JSON's ``point_speed``): the timing record, its points labelled."""

    points: list[StudyTimedPoint]
    full_method: str  # the method whose checkpoint is the full-resolution model (the JSON labels ``full[0]``)
    seed: int

    def to_dict(self) -> JsonObject:
        """As in the study's JSON: the timing record, the first full-resolution model
        labelled with its ``method`` and ``seed``, then ``seed``."""
        data = SpeedRecord.to_dict(self)
        del data["full_method"]
        data["full"][0].update({"method": self.full_method, "seed": self.seed})
        return data

    @classmethod
    def from_dict(cls, data: JsonObject) -> PointSpeed:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        values = {f.name: data[f.name] for f in fields(SpeedRecord)}
        values["machine"] = MachineInfo.from_dict(data["machine"])
        values["full"] = [FullTiming.from_dict(f) for f in data["full"]]
        values["points"] = [StudyTimedPoint.from_dict(p) for p in data["points"]]
        return cls(**values, full_method=data["full"][0]["method"], seed=data["seed"])

    @property
    def full_timing(self) -> FullTiming:
        """The full method's model: the baseline of every point of its architecture."""
        return self.full[0]


def speed_comparison(
    split_checkpoint: str,
    full_checkpoint: str,
    *,
    target_ratio: float,
    split: str,
    batch_size: int,
    rounds: int,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
) -> SpeedComparison:
    """Forward images/s of a trained SPLIT checkpoint at ``target_ratio`` against the
    trained full-resolution checkpoint, timed interleaved on the same batch."""
    import torch

    from ..bench.speed import backbone_call, split_output
    from ..bench.timing import time_interleaved
    from ..train.evaluation import CheckpointEvaluator

    split_eval = CheckpointEvaluator(split_checkpoint, samples=batch_size, device=device, split=split)
    full_eval = CheckpointEvaluator(full_checkpoint, samples=batch_size, device=device, split=split)
    calibration = split_eval.first_images(calibration_samples, split="val")
    torch.manual_seed(seed)
    thresholds = split_eval.calibrate(calibration, target_ratio)
    images = split_eval.first_images(batch_size)
    sync = torch.cuda.synchronize if images.device.type == "cuda" else (lambda: None)
    with torch.no_grad(), split_eval.autocast():  # the precision the study evaluated in
        tokens = split_output(split_eval.model(images, thresholds=thresholds))
        fns = {
            "split": lambda: split_eval.model(images, thresholds=thresholds),
            "full": lambda: full_eval.model(images),
        }
        split_backbone = backbone_call(split_eval.model, images, thresholds=thresholds)
        detector = split_backbone is not None
        if detector:  # and each backbone alone, in the same rounds
            fns["split_backbone"], fns["full_backbone"] = split_backbone, backbone_call(full_eval.model, images)
        times = time_interleaved(fns, repeats=rounds, warmup=2, sync=sync)
    fraction = float(tokens.tokens.float().mean()) / tokens.full_tokens
    median = {k: statistics.median(v) for k, v in times.items()}
    backbone = {}
    if detector:
        backbone = {
            "backbone_split_images_per_s": batch_size / median["split_backbone"],
            "backbone_full_images_per_s": batch_size / median["full_backbone"],
            "backbone_ratio": median["full_backbone"] / median["split_backbone"],
        }
    return SpeedComparison(
        batch_size=batch_size,
        rounds=rounds,
        device=str(images.device),
        thresholds=thresholds,
        token_fraction=fraction,
        ideal_ratio=1.0 / fraction,
        split_images_per_s=batch_size / median["split"],
        full_images_per_s=batch_size / median["full"],
        ratio=median["full"] / median["split"],
        ratio_fastest_round=min(times["full"]) / min(times["split"]),
        **backbone,
    )


def _full_method(spec: StudySpec) -> str:
    """The study's full-resolution method (the control): every study has one."""
    return next(m for m in spec.methods if spec.policy(m) == "full")


def matched_speed(
    spec: StudySpec,
    rows: list[StudyRow],
    runs: list[MethodRun],
    point_speed: PointSpeed | None = None,
    run: Runner = _here,
) -> MatchedSpeed | None:
    """The :func:`~splitvit.study.goals.matched_point` against full resolution, on the
    lowest seed that trained both (``None`` when there is no such pair).

    Where ``point_speed`` (:func:`points_speed`) timed that point on that seed, its
    figures are that timing's (``timing == POINTS_TIMING``): the goal line quotes the
    number the speed table shows, not a second timing of the same point, which on a
    shared CPU differs from the first by its rounds' spread. Otherwise the point is
    timed alone (:func:`speed_comparison`; ``run(fn, *args, **kwargs)`` runs it where
    the checkpoints' device is, default here, on the CPU)."""
    point = matched_point(rows, spec.goals)
    if point is None:
        return None
    row = point.row
    seed = min(int(s) for s in row.per_seed)
    checkpoints = {(r.method, r.seed): r.checkpoint for r in runs}
    full = _full_method(spec)
    if (full, seed) not in checkpoints:
        return None
    timed, source = _from_points(point_speed, row.method, row.target_ratio, seed), POINTS_TIMING
    if timed is None:
        source = OWN_TIMING
        timed = run(
            speed_comparison,
            checkpoints[(row.method, seed)],
            checkpoints[(full, seed)],
            target_ratio=row.target_ratio,
            split=spec.split,
            batch_size=spec.speed_batch,
            rounds=spec.speed_rounds,
            calibration_samples=spec.calibration_samples,
            seed=seed,
        )
    return MatchedSpeed(
        **{f.name: getattr(timed, f.name) for f in fields(SpeedComparison)},
        method=row.method,
        target_ratio=row.target_ratio,
        seed=seed,
        matches_full=point.matches_full,
        metric=row.metric,
        quality=row.quality,
        timing=source,
    )


def _from_points(
    record: PointSpeed | None, method: str, target_ratio: float | None, seed: int
) -> SpeedComparison | None:
    """``method``'s point at ``target_ratio`` as :func:`points_speed` timed it, in
    :func:`speed_comparison`'s terms (``None`` where it was not timed on ``seed``)."""
    if record is None or record.seed != seed:
        return None
    found = timed_points(record).get((method, target_ratio))
    if not isinstance(found, StudyTimedPoint) or found.thresholds is None:
        return None
    return SpeedComparison(
        batch_size=record.batch_size,
        rounds=record.rounds,
        device=record.device,
        thresholds=list(found.thresholds),
        token_fraction=found.token_ratio,
        ideal_ratio=1.0 / found.token_ratio,
        split_images_per_s=found.images_per_s,
        full_images_per_s=found.full_images_per_s,
        ratio=found.speedup_vs_full,
        ratio_fastest_round=found.speedup_vs_full_fastest,
        backbone_split_images_per_s=found.backbone_images_per_s,
        backbone_full_images_per_s=found.backbone_full_images_per_s,
        backbone_ratio=found.backbone_speedup_vs_full,
    )


def points_speed(spec: StudySpec, runs: list[MethodRun], run: Runner = _here) -> PointSpeed | None:
    """Every method's evaluated operating points timed against full resolution, side
    by side in one interleaved run (:func:`~splitvit.bench.speed.time_operating_points`).

    What is timed, to stay within a bounded time: one seed (the lowest that trained
    the ``full`` method); the ``full`` method's checkpoint is the full-resolution
    model; every other method's points of that seed at the evaluation ratios (one
    point for ``coarse``), each with the thresholds its evaluation calibrated (as
    stored with the point), so the timed point is the evaluated one. SPLIT's methods
    (the learned policy) are timed at every evaluated ratio, so that each of their
    accuracies has its speed beside it; the other methods share what is left of
    ``speed.max_points`` equally (at least one point each), spread over their ratios
    (both ends kept). The cost is ``(warmup + rounds) x (points + 1)``
    forward passes of ``speed.batch_size`` images. ``run(fn, *args, **kwargs)`` runs
    it where the checkpoints' device is (default: here, on the CPU).

    Returns the timing record, its points labelled with their method, target ratio and
    seed (``None`` when there is no full-resolution run or nothing to time).
    """
    from ..bench.speed import OperatingPoint, spread, time_operating_points

    full = _full_method(spec)
    seeds = sorted(int(r.seed) for r in runs if r.method == full)
    if not seeds:
        return None
    seed = seeds[0]
    by_method = {r.method: r for r in runs if int(r.seed) == seed}
    others = [m for m in spec.methods if m != full and m in by_method]
    if not others:
        return None
    recipes = [m for m in others if spec.policy(m) == "learned"]
    baselines = [m for m in others if m not in recipes]
    share = None
    if spec.speed_max_points is not None and baselines:
        left = spec.speed_max_points - sum(len(by_method[m].points) for m in recipes)
        share = max(1, left // len(baselines))
    operating: list[OperatingPoint] = []
    labels: list[tuple[str, float | None]] = []  # each point's method and target ratio
    for method in others:
        stored = sorted(by_method[method].points, key=lambda p: (p.target_ratio is None, p.target_ratio or 0.0))
        for point in stored if method in recipes else spread(stored, share):
            operating.append(
                OperatingPoint(
                    checkpoint=by_method[method].checkpoint,
                    thresholds=point.thresholds,
                    budget=point.target_ratio,  # what a budget-conditioned policy was told
                    label=f"{method}@{point.target_ratio}",
                )
            )
            labels.append((method, point.target_ratio))
    record: SpeedRecord = run(
        time_operating_points,
        operating,
        full_checkpoint=by_method[full].checkpoint,
        split=spec.split,
        batch_size=spec.speed_batch,
        rounds=spec.speed_rounds,
        warmup=spec.speed_warmup,
    )
    points = [
        StudyTimedPoint(**{f.name: getattr(p, f.name) for f in fields(p)}, method=m, target_ratio=r, seed=seed)
        for p, (m, r) in zip(record.points, labels)
    ]
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return PointSpeed(**{**values, "points": points}, full_method=full, seed=seed)


def with_timed_speed(rows: list[StudyRow], record: PointSpeed | None) -> list[StudyRow]:
    """``rows`` with the speed step's timing of their points (images/s and the ratio
    to full resolution's, on the timed seed) where :func:`points_speed` timed them."""
    timed = timed_points(record)
    out = []
    for row in rows:
        found = timed.get((row.method, row.target_ratio))
        if found is None:
            out.append(row)
            continue
        is_point = isinstance(found, StudyTimedPoint)  # else the full method's model, at 1.0x
        speedup = found.speedup_vs_full if is_point else 1.0
        # a detector's backbone alone
        backbone = None if found.backbone_images_per_s is None else found.backbone_speedup_vs_full if is_point else 1.0
        out.append(
            replace(
                row,
                timed_images_per_s=found.images_per_s,
                speedup_vs_full=speedup,
                backbone_speedup_vs_full=backbone,
            )
        )
    return out


def timed_points(record: PointSpeed | None) -> dict[tuple[str, float | None], FullTiming | StudyTimedPoint]:
    """(method, target ratio) -> the timed point of :func:`points_speed` (the full
    method's model at 1.0x, at target ratio ``None``, included)."""
    if not record:
        return {}
    out: dict[tuple[str, float | None], FullTiming | StudyTimedPoint] = {
        (p.method, p.target_ratio): p for p in record.points
    }
    out[(record.full_method, None)] = record.full_timing
    return out
