"""The Pareto frontier of quality (accuracy or mIoU, maximised) versus tokens per
image (minimised), and its hypervolume, on Optuna's own multi-objective code.

The frontier is Optuna's: every point becomes a trial of an in-memory two-objective
study and ``study.best_trials`` returns the non-dominated ones. The hypervolume is
the exact area in (quality, token ratio) space, by a sweep over the points (two
objectives need no more; Optuna's own routine is private API), against
:class:`~splitvit.tune.space.ParetoSettings`' reference point (default ``quality 0,
token ratio 1``: the worst value of each objective). :class:`Point` is a place on
that plane; :class:`Baseline` a sweep's baseline on the same axes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, TypeVar

from ..jsontypes import JsonObject

if TYPE_CHECKING:
    from ..train.points import EvaluatedPoint
    from .space import ConfigValue


@dataclass
class Point:
    """One evaluated (checkpoint, thresholds) pair: a place on the accuracy-tokens plane.

    Attributes:
        quality: accuracy (classification) or mIoU (dense).
        tokens_per_image: mean image tokens the encoder attended to.
        token_ratio: tokens per image over full-resolution tokens.
        kind: ``trial`` (stage one: the trial's own thresholds) or ``threshold``
            (stage two: other thresholds on the trial's checkpoint).
        trial_id: the Tune trial.
        thresholds: per-level split thresholds of this evaluation.
        params: the trial's searched parameters.
        checkpoint: the trial's checkpoint (local path or ``s3://``).
        run_id: the MLflow run that records this point.
        on_frontier: non-dominated among the sweep's points; of several points with
            equal objectives only one (the first in frontier order) is on it.
        hv_contribution: hypervolume lost without this point (frontier points only).
        ties: on a frontier point, the other points with exactly its objectives
            (``label()`` of each): equally good, counted once.
        tie_of: on such a tied point, the ``label()`` of the frontier point kept for it.
        extras: other figures (``images_per_s``, ...).
    """

    quality: float
    tokens_per_image: float
    token_ratio: float
    kind: str = "trial"
    trial_id: str = ""
    thresholds: list[float] = field(default_factory=list)
    params: dict[str, ConfigValue] = field(default_factory=dict)
    checkpoint: str | None = None
    run_id: str | None = None
    on_frontier: bool = False
    hv_contribution: float = 0.0
    model_uri: str | None = None
    ties: list[str] = field(default_factory=list)
    tie_of: str | None = None
    extras: dict[str, float] = field(default_factory=dict)

    def label(self) -> str:
        """Which evaluation this is, for people: the trial and its thresholds."""
        taus = ",".join(f"{t:.3g}" for t in self.thresholds)
        return f"{self.trial_id or '?'} [{taus}]" if taus else self.trial_id or "?"

    @property
    def finite(self) -> bool:
        """Both objectives are real numbers (a diverged evaluation is not a point)."""
        return all(
            isinstance(v, (int, float)) and math.isfinite(v)
            for v in (self.quality, self.tokens_per_image, self.token_ratio)
        )

    def to_dict(self, metric: str = "accuracy") -> JsonObject:
        """JSON-ready dict; the quality figure is named ``metric`` (``accuracy``/``miou``)."""
        data = asdict(self)
        data[metric] = data.pop("quality")
        return data

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str = "accuracy") -> Point:
        """The inverse of :meth:`to_dict` (keys it does not know are ignored)."""
        known = {f.name for f in fields(cls)} - {"quality"}
        return cls(quality=data[metric], **{k: v for k, v in data.items() if k in known})


#: :class:`Baseline` figures a sweep may not have recorded (``None``: not in its JSON).
_OPTIONAL_BASELINE_FIGURES = ("target_ratio", "images_per_s", "images", "fine_on_object", "object_coverage")


@dataclass
class Baseline:
    """A sweep's baseline: the best point's backbone and data under another split policy
    (:func:`splitvit.tune.stage_two.baselines`), on the same axes as the points.

    Attributes:
        baseline: the policy: ``full`` (every node splits: full resolution),
            ``entropy`` (APT-style) or ``random`` (thresholds calibrated to a budget).
        label: its name in tables and plots (``full resolution``, ``entropy t=0.5``,
            ``random @ 0.42``).
        quality: accuracy (classification) or mIoU (dense).
        tokens_per_image: mean image tokens the encoder attended to.
        token_ratio: tokens per image over full-resolution tokens.
        thresholds: the per-level split thresholds it was evaluated at.
        trial_id: the trial whose checkpoint (backbone) it ran on.
        images_per_s: evaluation throughput (``None``: not recorded).
        images: images evaluated (``None``: not recorded, older sweeps).
        target_ratio: ``random`` only: the token ratio its thresholds were calibrated to.
        fine_on_object: on data with object masks, the share of fine tokens on the object.
        object_coverage: on data with object masks, the share of the object kept fine.
        held_out: its figures on the held-out split (``test_<metric>``,
            ``test_tokens_per_image``, ``test_token_ratio``), where evaluated there.
    """

    baseline: str
    label: str
    quality: float
    tokens_per_image: float
    token_ratio: float
    thresholds: list[float]
    trial_id: str
    images_per_s: float | None = None
    images: int | None = None
    target_ratio: float | None = None
    fine_on_object: float | None = None
    object_coverage: float | None = None
    held_out: dict[str, float] | None = None

    def to_dict(self, metric: str = "accuracy") -> JsonObject:
        """JSON-ready dict (``baselines`` of ``sweep.json``, ``baselines.json``), keys in
        the evaluation's order: the quality under both ``metric`` (``accuracy``/``miou``)
        and ``quality``; the optional figures only where recorded."""
        data = {
            "baseline": self.baseline,
            "label": self.label,
            "target_ratio": self.target_ratio,
            "tokens_per_image": self.tokens_per_image,
            "token_ratio": self.token_ratio,
            "images_per_s": self.images_per_s,
            "images": self.images,
            metric: self.quality,
            "fine_on_object": self.fine_on_object,
            "object_coverage": self.object_coverage,
            "thresholds": self.thresholds,
            "quality": self.quality,
            "trial_id": self.trial_id,
            **(self.held_out or {}),
        }
        return {k: v for k, v in data.items() if v is not None or k not in _OPTIONAL_BASELINE_FIGURES}

    @classmethod
    def of_evaluation(cls, baseline: str, label: str, point: EvaluatedPoint, trial_id: str) -> Baseline:
        """The baseline ``baseline`` (labelled ``label``) evaluated at ``point`` on trial
        ``trial_id``'s backbone."""
        return cls.from_dict({**point.to_dict(), "baseline": baseline, "label": label, "trial_id": trial_id})

    @classmethod
    def from_dict(cls, data: JsonObject) -> Baseline:
        """The inverse of :meth:`to_dict` (keys it does not know, the metric's name among
        them, are ignored: ``quality`` holds that figure)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's per-trial INFO lines for the duration (restoring the level)."""
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def pareto_indices(values: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(quality, tokens)`` pairs (quality up, tokens down).

    Non-finite pairs are never on the frontier. Equal pairs are all kept (neither
    dominates the other).
    """
    import optuna

    keep = [i for i, (q, t) in enumerate(values) if math.isfinite(q) and math.isfinite(t)]
    if not keep:
        return []
    with quiet_optuna():
        study = optuna.create_study(directions=["maximize", "minimize"])
        study.add_trials(
            [
                optuna.trial.create_trial(values=[float(values[i][0]), float(values[i][1])], user_attrs={"index": i})
                for i in keep
            ]
        )
        return sorted(int(t.user_attrs["index"]) for t in study.best_trials)


def hypervolume(values: Sequence[tuple[float, float]], reference: tuple[float, float] = (0.0, 1.0)) -> float:
    """Area dominated by ``(quality, token_ratio)`` pairs, bounded by ``reference``.

    Pairs worse than the reference in either objective add nothing. With the default
    reference ``(0, 1)`` the result lies in ``[0, 1]``.
    """
    worst_quality, worst_ratio = float(reference[0]), float(reference[1])
    inside = [
        (float(q), float(r))
        for q, r in values
        if math.isfinite(q) and math.isfinite(r) and q >= worst_quality and r <= worst_ratio
    ]
    # best quality first: each point adds the strip between its token ratio and the
    # lowest ratio seen so far, as wide as its quality is above the reference
    area, lowest_ratio = 0.0, worst_ratio
    for quality, ratio in sorted(inside, key=lambda p: (-p[0], p[1])):
        if ratio < lowest_ratio:
            area += (quality - worst_quality) * (lowest_ratio - ratio)
            lowest_ratio = ratio
    return area


def annotate(points: list[Point], reference: tuple[float, float] = (0.0, 1.0)) -> float:
    """Mark each point's ``on_frontier`` and ``hv_contribution``; return the hypervolume.

    Only finite points count. Points with equal objectives are one place on the
    plane: the first of them in frontier order stays on the frontier and lists the
    others in ``ties`` (each marks ``tie_of``), so counts and contributions see the
    place once. The contribution of a frontier point is the hypervolume lost without
    it (how much of the frontier it alone holds up).
    """
    for p in points:
        p.on_frontier, p.hv_contribution, p.ties, p.tie_of = False, 0.0, [], None
    usable = [p for p in points if p.finite]
    non_dominated = [usable[i] for i in pareto_indices([(p.quality, p.tokens_per_image) for p in usable])]
    front: list[Point] = []
    kept: dict[tuple[float, float], Point] = {}
    for p in sorted(non_dominated, key=_frontier_order):
        first = kept.setdefault((p.quality, p.tokens_per_image), p)
        if first is p:
            p.on_frontier = True
            front.append(p)
        else:
            first.ties.append(p.label())
            p.tie_of = first.label()
    pairs = [(p.quality, p.token_ratio) for p in front]
    total = hypervolume(pairs, reference)
    for i, p in enumerate(front):
        p.hv_contribution = total - hypervolume(pairs[:i] + pairs[i + 1 :], reference)
    return total


def _frontier_order(p: Point) -> tuple:
    """Fewest tokens first; among equals a trial's own evaluation before stage two's."""
    return (p.tokens_per_image, -p.quality, p.trial_id, p.kind != "trial", p.thresholds)


def frontier(points: list[Point]) -> list[Point]:
    """The frontier points of an annotated list, by tokens per image (ascending)."""
    return sorted((p for p in points if p.on_frontier), key=_frontier_order)


def best_point(points: list[Point]) -> Point | None:
    """The frontier point with the largest hypervolume contribution (the knee of the
    trade-off); ties go to higher quality."""
    front = [p for p in points if p.on_frontier]
    if not front:
        return None
    return max(front, key=lambda p: (round(p.hv_contribution, 12), p.quality, -p.tokens_per_image))


def standard_error(accuracy: float, images: int) -> float:
    """The standard error of an accuracy measured on ``images`` images (a binomial
    proportion's): how far a figure on these images may sit from the model's own."""
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / images)


def within_noise(front: list[Point], images: int) -> list[tuple[Point, Point]]:
    """Neighbouring points of an accuracy frontier (by tokens per image) whose
    accuracies differ by less than one standard error on ``images`` images: which of
    the two is better, and so where the frontier steps, these images cannot tell."""
    ordered = sorted(front, key=_frontier_order)
    return [
        (a, b)
        for a, b in zip(ordered, ordered[1:])
        if abs(b.quality - a.quality) < standard_error((a.quality + b.quality) / 2, images)
    ]


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` dominates ``b`` in (quality up, tokens down): no worse in both, better in one."""
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


#: A table cell's type: rounding keeps a float a float, and leaves every other cell as it is.
Cell = TypeVar("Cell")

#: Columns whose figures are counts of tokens or images: shown with one decimal.
ONE_DECIMAL = frozenset({"tokens_per_image", "tokens/image", "images_per_s", "timed_images_per_s"})


def round_figures(row: dict[str, Cell]) -> dict[str, Cell]:
    """A table row for people: token counts and throughputs to one decimal, every
    other float (quality, ratios, hypervolume shares, speed-ups, searched values) to
    four significant digits; everything else as it is. For display only: the JSON
    keeps full precision, so nothing computed downstream starts from rounded values."""
    out: dict[str, Cell] = {}
    for key, value in row.items():
        if isinstance(value, float) and math.isfinite(value):
            value = round(value, 1) if key in ONE_DECIMAL else float(f"{value:.4g}")
        out[key] = value
    return out
