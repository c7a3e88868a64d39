"""Where a study's figures and goal lines are computed: the aggregation over seeds
(:func:`aggregate`: a :class:`StudyRow` per method and ratio), the goals measured on it
(:func:`check_goals`: :class:`GoalVerdicts`, parity with full resolution and the
margins over the baselines), the gaps to the control (:func:`gap_spread`), the point the
speed comparison times (:func:`matched_point`), the reference's convergence
(:func:`reference_convergence`), the study's time (:func:`study_time`) and the recipe
ablation (:func:`lever_table`).

Every figure is a dataclass whose ``to_dict()`` is its part of the study's JSON
(``splitvit study --json``; docs/usage.md, "The study JSON") and whose ``from_dict()``
reads that back. Where the JSON names a key after the quality metric (``accuracy``,
``miou``), the dataclass has ``quality`` and carries the ``metric``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..jsontypes import JsonObject
from .spec import Goals

if TYPE_CHECKING:
    from ..train.points import EvaluatedPoint
    from .runs import BackboneRun, MethodRun

EPS = 1e-9  # points: means of seeds' accuracies are not exact in binary
POINTS = 100.0  # a quality of 1.0 is 100 points


# ---------------------------------------------------------------------- the figures
@dataclass(frozen=True)
class StudyRow:
    """One method at one target token ratio, over the seeds that evaluated it."""

    method: str
    policy: str
    target_ratio: float | None  # None: a method evaluated once (full, coarse)
    seeds: int  # how many seeds evaluated it
    metric: str  # the quality metric ("accuracy", "miou"): the JSON's keys for the next four
    quality: float  # the mean over seeds
    quality_std: float  # the standard deviation over seeds (0.0 with one)
    quality_min: float
    quality_max: float
    tokens_per_image: float  # this and the next two: means over seeds
    token_ratio: float  # measured on the evaluated images
    images_per_s: float  # the evaluation's throughput (not timed side by side)
    per_seed: dict[str, float]  # seed (as text) -> quality
    # the speed step's timing of this row's point on one seed, beside full resolution's
    # (:func:`~splitvit.study.speed.points_speed`); None where it was not timed
    timed_images_per_s: float | None = None
    speedup_vs_full: float | None = None
    # a detector's backbone alone, timed beside full resolution's (None elsewhere)
    backbone_speedup_vs_full: float | None = None
    # the companion qualities (a detector's mask_ap): metric -> seed (as text) -> value
    companions: dict[str, dict[str, float]] = field(default_factory=dict)

    def companion(self, metric: str) -> float:
        """Companion quality ``metric``'s mean over seeds."""
        return statistics.fmean(self.companions[metric].values())

    def to_dict(self) -> JsonObject:
        """A row of the study's table, as in its JSON (``rows``; the timed speed's keys
        only where the point was timed; each companion quality ``<m>`` with ``<m>_std``
        and ``per_seed_<m>``)."""
        timed = {}
        if self.speedup_vs_full is not None:
            timed = {"timed_images_per_s": self.timed_images_per_s, "speedup_vs_full": self.speedup_vs_full}
        if self.backbone_speedup_vs_full is not None:
            timed["backbone_speedup_vs_full"] = self.backbone_speedup_vs_full
        companions: dict[str, float | dict[str, float]] = {}
        for metric, values in self.companions.items():
            companions[metric] = self.companion(metric)
            companions[f"{metric}_std"] = statistics.stdev(values.values()) if len(values) > 1 else 0.0
            companions[f"per_seed_{metric}"] = dict(values)
        return {
            "method": self.method,
            "policy": self.policy,
            "target_ratio": self.target_ratio,
            "seeds": self.seeds,
            self.metric: self.quality,
            f"{self.metric}_std": self.quality_std,
            f"{self.metric}_min": self.quality_min,
            f"{self.metric}_max": self.quality_max,
            "tokens_per_image": self.tokens_per_image,
            "token_ratio": self.token_ratio,
            "images_per_s": self.images_per_s,
            **timed,
            "per_seed": dict(self.per_seed),
            **companions,
        }

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> StudyRow:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        return cls(
            method=data["method"],
            policy=data["policy"],
            target_ratio=data["target_ratio"],
            seeds=data["seeds"],
            metric=metric,
            quality=data[metric],
            quality_std=data[f"{metric}_std"],
            quality_min=data[f"{metric}_min"],
            quality_max=data[f"{metric}_max"],
            tokens_per_image=data["tokens_per_image"],
            token_ratio=data["token_ratio"],
            images_per_s=data["images_per_s"],
            per_seed=dict(data["per_seed"]),
            timed_images_per_s=data.get("timed_images_per_s"),
            speedup_vs_full=data.get("speedup_vs_full"),
            backbone_speedup_vs_full=data.get("backbone_speedup_vs_full"),
            companions={
                key.removeprefix("per_seed_"): dict(values)
                for key, values in data.items()
                if key.startswith("per_seed_")
            },
        )


@dataclass(frozen=True)
class CompanionGap:
    """A companion quality's gap to full resolution on a parity verdict's row (a
    detector's mask AP beside its box AP): ``met`` at most ``goal_points`` below."""

    metric: str
    quality: float  # the row's mean over seeds
    full_quality: float
    gap_points: float  # full's minus the row's, in points
    gap_std_points: float | None  # its spread over seeds (None: fewer than two seeds)
    goal_points: float
    met: bool

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.match.companions``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> CompanionGap:
        """The inverse of :meth:`to_dict`."""
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ParityVerdict:
    """Parity with full resolution at a token share: the most accurate SPLIT row at no
    more than ``max_token_ratio`` of the tokens (measured, within ``ratio_tolerance``)
    and its gap to full resolution (``met``: at most ``goal_points`` below, and so is
    every companion quality's gap on the same row)."""

    method: str
    target_ratio: float | None
    token_ratio: float  # measured
    metric: str  # the JSON's key for ``quality``
    quality: float
    gap_points: float  # full resolution's quality minus this row's, in points (negative: above full)
    gap_std_points: float | None  # its spread over seeds, seed by seed (None: fewer than two seeds)
    goal_points: float
    max_token_ratio: float
    ratio_tolerance: float
    met: bool
    companions: list[CompanionGap] = field(default_factory=list)

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.match``, ``goals.match_also``; ``companions``
        only where the task has them)."""
        companions = {"companions": [c.to_dict() for c in self.companions]} if self.companions else {}
        return {
            "method": self.method,
            "target_ratio": self.target_ratio,
            "token_ratio": self.token_ratio,
            self.metric: self.quality,
            "gap_points": self.gap_points,
            "gap_std_points": self.gap_std_points,
            "goal_points": self.goal_points,
            "max_token_ratio": self.max_token_ratio,
            "ratio_tolerance": self.ratio_tolerance,
            "met": self.met,
            **companions,
        }

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> ParityVerdict:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        return cls(
            metric=metric,
            quality=data[metric],
            companions=[CompanionGap.from_dict(c) for c in data.get("companions", [])],
            **_known(cls, data, skip=("metric", "quality", "companions")),
        )


@dataclass(frozen=True)
class Margin:
    """SPLIT's margin over one baseline at one target ratio, in points (best row of each)."""

    target_ratio: float
    versus: str  # "entropy" or "random"
    margin_points: float

    def to_dict(self) -> JsonObject:
        """As in the study's JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> Margin:
        """The inverse of :meth:`to_dict`."""
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class BaselinesVerdict:
    """SPLIT above entropy and random at every evaluated ratio in ``ratio_range``
    (``met``: the smallest margin, ``worst``, is positive)."""

    ratio_range: tuple[float, float]  # the JSON's "range"
    margins: list[Margin]
    worst: Margin
    met: bool

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.above_baselines``)."""
        return {
            "range": list(self.ratio_range),
            "margins": [m.to_dict() for m in self.margins],
            "worst": self.worst.to_dict(),
            "met": self.met,
        }

    @classmethod
    def from_dict(cls, data: JsonObject) -> BaselinesVerdict:
        """The inverse of :meth:`to_dict`."""
        low, high = data["range"]
        return cls(
            ratio_range=(low, high),
            margins=[Margin.from_dict(m) for m in data["margins"]],
            worst=Margin.from_dict(data["worst"]),
            met=data["met"],
        )


@dataclass(frozen=True)
class EntropyMargin:
    """SPLIT's margin over entropy at ``target_ratio`` (``met``: at least ``goal_points``)."""

    target_ratio: float
    margin_points: float
    goal_points: float
    met: bool

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.margin_over_entropy``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> EntropyMargin:
        """The inverse of :meth:`to_dict`."""
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class SeedConvergence:
    """One seed's reference (backbone): its validation curve and its last gain."""

    curve: list[float]  # the validation quality per epoch
    epochs: int
    gain_points: float | None  # over the last ``over_epochs`` epochs (None: too short a curve)
    met: bool  # gained less than the goal (False when it cannot tell)

    def to_dict(self) -> JsonObject:
        """As in the study's JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> SeedConvergence:
        """The inverse of :meth:`to_dict`."""
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ReferenceConvergence:
    """Whether each seed's reference had converged (``met``: every seed's had)."""

    over_epochs: int
    goal_points: float
    seeds: dict[str, SeedConvergence]  # seed (as text) -> its curve and verdict
    met: bool

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.reference_converged``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> ReferenceConvergence:
        """The inverse of :meth:`to_dict`."""
        seeds = {seed: SeedConvergence.from_dict(record) for seed, record in data["seeds"].items()}
        return cls(over_epochs=data["over_epochs"], goal_points=data["goal_points"], seeds=seeds, met=data["met"])


@dataclass(frozen=True)
class StudyTime:
    """How long the invocation took against the goal, and on what machine."""

    minutes: float
    goal_minutes: float
    runs: int  # the study's own runs (borrowed references are another study's)
    begun_earlier: list[str]  # runs an earlier invocation had started or finished
    failed_runs: int
    borrowed_references: bool
    cpus: int | None
    reference_images_per_s: float | None  # the references this invocation trained (None: none)
    met: bool | None  # None: no verdict, the time is a part of the study's (absent from the JSON)

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``goals.study_time``; ``met`` only with a verdict)."""
        data = asdict(self)
        if self.met is None:
            del data["met"]
        return data

    @classmethod
    def from_dict(cls, data: JsonObject) -> StudyTime:
        """The inverse of :meth:`to_dict`."""
        return cls(**_known(cls, data, skip=("met",)), met=data.get("met"))


@dataclass(frozen=True)
class GoalVerdicts:
    """The goals as measured (``splitvit study --json``'s ``goals``): each verdict is
    ``None`` (absent from the JSON) when the study sets no such goal or nothing could
    measure it."""

    metric: str  # the quality metric: the JSON's "full_<metric>"
    full_quality: float | None = None  # full resolution's quality (None: no full-resolution row)
    match: ParityVerdict | None = None  # parity at the goals' match_ratio
    match_also: list[ParityVerdict] = field(default_factory=list)  # and at each of also_match_at
    above_baselines: BaselinesVerdict | None = None
    margin_over_entropy: EntropyMargin | None = None
    reference_converged: ReferenceConvergence | None = None
    study_time: StudyTime | None = None

    def verdicts(self) -> dict[str, bool]:
        """Each single goal's verdict by its JSON key (``match``, ``above_baselines``, ...;
        not ``match_also``): what MLflow records as ``goal_<key>_met``."""
        single = {
            "match": self.match,
            "above_baselines": self.above_baselines,
            "margin_over_entropy": self.margin_over_entropy,
            "reference_converged": self.reference_converged,
            "study_time": self.study_time,
        }
        return {key: bool(goal.met) for key, goal in single.items() if goal is not None and goal.met is not None}

    def to_dict(self) -> JsonObject:
        """As in the study's JSON: only the goals measured."""
        data: JsonObject = {}
        if self.full_quality is not None:
            data[f"full_{self.metric}"] = self.full_quality
        if self.match is not None:
            data["match"] = self.match.to_dict()
        if self.match_also:
            data["match_also"] = [m.to_dict() for m in self.match_also]
        for key, goal in (
            ("above_baselines", self.above_baselines),
            ("margin_over_entropy", self.margin_over_entropy),
            ("reference_converged", self.reference_converged),
            ("study_time", self.study_time),
        ):
            if goal is not None:
                data[key] = goal.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> GoalVerdicts:
        """The inverse of :meth:`to_dict`."""

        def read(key: str, parse: Any) -> Any:
            return parse(data[key]) if key in data else None

        return cls(
            metric=metric,
            full_quality=data.get(f"full_{metric}"),
            match=read("match", lambda d: ParityVerdict.from_dict(d, metric)),
            match_also=[ParityVerdict.from_dict(m, metric) for m in data.get("match_also", [])],
            above_baselines=read("above_baselines", BaselinesVerdict.from_dict),
            margin_over_entropy=read("margin_over_entropy", EntropyMargin.from_dict),
            reference_converged=read("reference_converged", ReferenceConvergence.from_dict),
            study_time=read("study_time", StudyTime.from_dict),
        )


@dataclass(frozen=True)
class MatchedPoint:
    """The SPLIT row the speed comparison times (:func:`matched_point`)."""

    row: StudyRow
    matches_full: bool  # within the goal's points of full resolution (else: the best under its share)


@dataclass(frozen=True)
class LeverCell:
    """One SPLIT method at one parity ratio in the recipe ablation."""

    metric: str  # the JSON's key for ``quality``
    quality: float  # the mean over seeds
    std: float  # over seeds
    seeds: int
    token_ratio: float
    gap_points: float | None  # to the full-resolution control (None: no control)
    gap_std_points: float | None  # its spread over seeds, seed by seed

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (a cell of ``levers``)."""
        return {
            self.metric: self.quality,
            "std": self.std,
            "seeds": self.seeds,
            "token_ratio": self.token_ratio,
            "gap_points": self.gap_points,
            "gap_std_points": self.gap_std_points,
        }

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> LeverCell:
        """The inverse of :meth:`to_dict`."""
        return cls(metric=metric, quality=data[metric], **_known(cls, data, skip=("metric", "quality")))


@dataclass(frozen=True)
class LeverRow:
    """One SPLIT method of the recipe ablation: a cell per parity ratio."""

    method: str
    cells: dict[float, LeverCell | None]  # parity ratio -> its cell (None: not evaluated there)

    def to_dict(self) -> JsonObject:
        """As in the study's JSON (``levers``): a key ``r<ratio>`` per parity ratio."""
        cells = {f"r{ratio:g}": None if cell is None else cell.to_dict() for ratio, cell in self.cells.items()}
        return {"method": self.method, **cells}

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> LeverRow:
        """The inverse of :meth:`to_dict`."""
        cells = {
            float(key[1:]): None if cell is None else LeverCell.from_dict(cell, metric)
            for key, cell in data.items()
            if key != "method"
        }
        return cls(method=data["method"], cells=cells)


def _known(cls: type, data: JsonObject, skip: Sequence[str] = ()) -> dict[str, Any]:
    """``cls``'s fields (but ``skip``) read from ``data``: a missing key raises ``KeyError``."""
    return {f.name: data[f.name] for f in fields(cls) if f.name not in skip}


# ---------------------------------------------------------------------- aggregation
def aggregate(results: list[MethodRun], metric: str, companions: Sequence[str] = ()) -> list[StudyRow]:
    """One row per (method, target ratio) of the method runs' stored ``results``: mean,
    standard deviation, min and max over seeds of the quality, each seed's ``companions``
    qualities (read from the points by name), and the means of tokens per image, token
    ratio and images/s. Full resolution first, then SPLIT, then the rest."""
    groups: dict[tuple[str, float | None], list[tuple[int, EvaluatedPoint]]] = {}
    policies: dict[str, str] = {}
    for result in results:
        policies[result.method] = result.policy
        for point in result.points:
            groups.setdefault((result.method, point.target_ratio), []).append((result.seed, point))
    rows = []
    for (method, ratio), seeded in groups.items():
        points = [p for _, p in seeded]
        q = [float(p.quality) for p in points]
        rows.append(
            StudyRow(
                method=method,
                policy=policies[method],
                target_ratio=ratio,
                seeds=len(points),
                metric=metric,
                quality=statistics.fmean(q),
                quality_std=statistics.stdev(q) if len(q) > 1 else 0.0,
                quality_min=min(q),
                quality_max=max(q),
                tokens_per_image=statistics.fmean(float(p.tokens_per_image) for p in points),
                token_ratio=statistics.fmean(float(p.token_ratio) for p in points),
                images_per_s=statistics.fmean(float(p.images_per_s) for p in points),
                per_seed={str(seed): float(p.quality) for seed, p in seeded},
                companions={c: {str(seed): p.figure(c) for seed, p in seeded} for c in companions},
            )
        )
    rows.sort(key=lambda r: (r.policy != "full", r.policy != "learned", r.method, r.target_ratio or 0.0))
    return rows


def _full_row(rows: list[StudyRow]) -> StudyRow | None:
    """The full-resolution control's row."""
    return next((r for r in rows if r.policy == "full"), None)


def _best(rows: list[StudyRow], policy: str, ratio: float) -> StudyRow | None:
    """The most accurate row of ``policy`` at target ratio ``ratio``."""
    found = [
        r for r in rows if r.policy == policy and r.target_ratio is not None and math.isclose(r.target_ratio, ratio)
    ]
    return max(found, key=lambda r: r.quality) if found else None


# ---------------------------------------------------------------------- the goals
def check_goals(rows: list[StudyRow], goals: Goals, metric: str) -> GoalVerdicts:
    """The goals, measured on the aggregated rows (means over seeds; points): parity
    with full resolution at each share, SPLIT above the baselines, and its margin over
    entropy. Nothing is measured without a full-resolution row."""
    full = _full_row(rows)
    if full is None:
        return GoalVerdicts(metric)
    also = [_match(rows, full, ratio, goals) for ratio in goals.also_match_at]
    return GoalVerdicts(
        metric=metric,
        full_quality=full.quality,
        match=_match(rows, full, goals.match_ratio, goals),
        match_also=[m for m in also if m],
        above_baselines=_above_baselines(rows, goals),
        margin_over_entropy=_margin_over_entropy(rows, goals),
    )


def gap_spread(full: StudyRow, row: StudyRow) -> float | None:
    """The standard deviation over seeds, in points, of ``row``'s gap to ``full`` taken
    seed by seed (each method starts from its seed's reference, so a seed's reference
    lifts or lowers both): how much of a mean gap is more than noise. ``None`` with
    fewer than two seeds in common."""
    seeds = sorted(set(full.per_seed) & set(row.per_seed))
    if len(seeds) < 2:
        return None
    return statistics.stdev((full.per_seed[s] - row.per_seed[s]) * POINTS for s in seeds)


def _match(rows: list[StudyRow], full: StudyRow, max_ratio: float, goals: Goals) -> ParityVerdict | None:
    """The most accurate SPLIT row at no more than ``max_ratio`` of the tokens (measured,
    within ``goals.ratio_tolerance``), and its gap to full resolution in points (``met``:
    at most ``goals.match_points``)."""
    within = [r for r in rows if r.policy == "learned" and r.token_ratio <= max_ratio + goals.ratio_tolerance + 1e-9]
    if not within:
        return None
    top = max(within, key=lambda r: r.quality)
    gap = (full.quality - top.quality) * POINTS
    companions = [_companion_gap(full, top, metric, goals) for metric in top.companions if metric in full.companions]
    return ParityVerdict(
        method=top.method,
        target_ratio=top.target_ratio,
        token_ratio=top.token_ratio,
        metric=top.metric,
        quality=top.quality,
        gap_points=gap,
        gap_std_points=gap_spread(full, top),
        goal_points=goals.match_points,
        max_token_ratio=max_ratio,
        ratio_tolerance=goals.ratio_tolerance,
        met=gap <= goals.match_points + EPS and all(c.met for c in companions),
        companions=companions,
    )


def _companion_gap(full: StudyRow, row: StudyRow, metric: str, goals: Goals) -> CompanionGap:
    """``row``'s companion quality ``metric`` against full resolution's, held to the same
    number of points as the main quality."""
    gap = (full.companion(metric) - row.companion(metric)) * POINTS
    seeds = sorted(set(full.companions[metric]) & set(row.companions[metric]))
    spread = (
        statistics.stdev((full.companions[metric][s] - row.companions[metric][s]) * POINTS for s in seeds)
        if len(seeds) > 1
        else None
    )
    return CompanionGap(
        metric=metric,
        quality=row.companion(metric),
        full_quality=full.companion(metric),
        gap_points=gap,
        gap_std_points=spread,
        goal_points=goals.match_points,
        met=gap <= goals.match_points + EPS,
    )


def _above_baselines(rows: list[StudyRow], goals: Goals) -> BaselinesVerdict | None:
    """SPLIT's margin over entropy and random at every evaluated ratio in ``goals.beat_range``."""
    if not goals.beat_range:
        return None
    lo, hi = goals.beat_range
    margins = []
    for ratio in sorted({r.target_ratio for r in rows if r.target_ratio is not None}):
        if not lo - 1e-9 <= ratio <= hi + 1e-9:
            continue
        split = _best(rows, "learned", ratio)
        for other in ("entropy", "random"):
            rival = _best(rows, other, ratio)
            if split and rival:
                margins.append(Margin(ratio, other, (split.quality - rival.quality) * POINTS))
    if not margins:
        return None
    worst = min(margins, key=lambda m: m.margin_points)
    return BaselinesVerdict(ratio_range=(lo, hi), margins=margins, worst=worst, met=worst.margin_points > 0)


def _margin_over_entropy(rows: list[StudyRow], goals: Goals) -> EntropyMargin | None:
    """SPLIT's margin over entropy at ``goals.margin_at`` (met: at least ``goals.margin`` points)."""
    if goals.margin_at is None:
        return None
    split, rival = _best(rows, "learned", goals.margin_at), _best(rows, "entropy", goals.margin_at)
    if not (split and rival):
        return None
    margin = (split.quality - rival.quality) * POINTS
    return EntropyMargin(
        target_ratio=goals.margin_at, margin_points=margin, goal_points=goals.margin, met=margin >= goals.margin - EPS
    )


def reference_convergence(backbones: list[BackboneRun], goals: Goals, metric: str) -> ReferenceConvergence | None:
    """Whether each seed's backbone (the reference every method starts from; its stored
    result) had converged: its validation ``metric`` gained less than
    ``goals.converge_points`` over its last ``goals.converge_epochs`` epochs. Each seed's
    curve comes along. None when the study sets no such goal."""
    if goals.converge_points is None:
        return None
    k = goals.converge_epochs
    seeds: dict[str, SeedConvergence] = {}
    for backbone in backbones:
        curve = [float(h[metric]) for h in backbone.history or [] if metric in h]
        if len(curve) > k:
            gain = (curve[-1] - curve[-1 - k]) * POINTS
            seeds[str(backbone.seed)] = SeedConvergence(curve, len(curve), gain, gain < goals.converge_points)
        else:  # too short a curve to tell (or one stored before curves were kept)
            seeds[str(backbone.seed)] = SeedConvergence(curve, len(curve), None, False)
    if not seeds:
        return None
    return ReferenceConvergence(
        over_epochs=k, goal_points=goals.converge_points, seeds=seeds, met=all(s.met for s in seeds.values())
    )


def study_time(
    seconds: float,
    backbones: list[BackboneRun],
    runs: int,
    goals: Goals,
    *,
    begun: Sequence[str] = (),
    failed: int = 0,
    borrowed_references: bool = False,
) -> StudyTime | None:
    """How long this invocation of a study of ``runs`` runs took, against
    ``goals.max_minutes``; None when the study sets no such goal.

    The verdict (``met``) is given only for an invocation that ran the whole study
    from the start, every run finishing: runs an earlier invocation had started or
    finished (``begun``, by name: :func:`~splitvit.study.runs.begun_runs`), references
    borrowed from another study, or failed runs would make the time a part of the
    study's. The machine comes along, as the time is as much its as the study's: its CPU
    count and the references' training throughput (``backbones``' last epoch, images/s
    per run, the mean over seeds), of the references this invocation trained: a
    ``reused`` one's (borrowed, or finished earlier) is another invocation's, maybe
    another machine's.
    """
    if goals.max_minutes is None:
        return None
    speeds = [b.metrics["train_images_per_s"] for b in backbones if not b.reused and "train_images_per_s" in b.metrics]
    minutes = seconds / 60.0
    whole = not begun and not failed and not borrowed_references
    return StudyTime(
        minutes=minutes,
        goal_minutes=goals.max_minutes,
        runs=runs,
        begun_earlier=list(begun),
        failed_runs=failed,
        borrowed_references=borrowed_references,
        cpus=os.cpu_count(),
        reference_images_per_s=sum(map(float, speeds)) / len(speeds) if speeds else None,
        met=minutes <= goals.max_minutes if whole else None,
    )


def matched_point(rows: list[StudyRow], goals: Goals) -> MatchedPoint | None:
    """The SPLIT point for the speed comparison: the fewest tokens among those within
    ``goals.match_points`` of full resolution; failing that, the most accurate one at
    or under ``goals.match_ratio``."""
    full = _full_row(rows)
    learned = [r for r in rows if r.policy == "learned"]
    if full is None or not learned:
        return None
    close = [r for r in learned if (full.quality - r.quality) * POINTS <= goals.match_points + EPS]
    if close:
        return MatchedPoint(min(close, key=lambda r: r.token_ratio), matches_full=True)
    capped = [r for r in learned if r.token_ratio <= goals.match_ratio + goals.ratio_tolerance + 1e-9] or learned
    return MatchedPoint(max(capped, key=lambda r: r.quality), matches_full=False)


def lever_table(rows: list[StudyRow], ratios: list[float]) -> list[LeverRow]:
    """The recipe ablation: every SPLIT method's quality at each of ``ratios`` (mean and
    standard deviation over seeds) and its gap to the full-resolution control in
    points; one row per method, a ``None`` cell where the method was not evaluated there."""
    full = _full_row(rows)
    table = []
    for method in dict.fromkeys(r.method for r in rows if r.policy == "learned"):
        cells: dict[float, LeverCell | None] = {}
        for ratio in ratios:
            row = next(
                (
                    r
                    for r in rows
                    if r.method == method and r.target_ratio is not None and math.isclose(r.target_ratio, ratio)
                ),
                None,
            )
            cells[ratio] = (
                None
                if row is None
                else LeverCell(
                    metric=row.metric,
                    quality=row.quality,
                    std=row.quality_std,
                    seeds=row.seeds,
                    token_ratio=row.token_ratio,
                    gap_points=None if full is None else (full.quality - row.quality) * POINTS,
                    gap_std_points=None if full is None else gap_spread(full, row),
                )
            )
        table.append(LeverRow(method, cells))
    return table
