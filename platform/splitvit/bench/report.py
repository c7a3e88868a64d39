"""Targets and the text of the benchmarks' reports: what the ``bench forward`` and ``bench train`` reports share.

A target (:func:`make_target`) is judged on one ratio of medians and carries the same
ratio per interleaved round, whose quartiles show how well one run resolves it; the
report prints it as a row of :func:`target_table`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..jsontypes import JsonObject
from .records import without_unset
from .timing import quartiles

if TYPE_CHECKING:
    from .records import MachineInfo

#: The header of every report's table of targets (:func:`target_table`).
TARGET_HEADER = ["", "target", "measured", "bound", "", "per-round IQR", "note"]


@dataclass(frozen=True)
class RoundRatios:
    """A ratio measured within each interleaved round: its median and quartiles (how
    well one run resolves it) and the per-round values (its JSON: ``asdict``)."""

    median: float
    q1: float
    q3: float
    values: list[float]

    @classmethod
    def of(cls, values: list[float]) -> RoundRatios:
        """The quartiles of ``values``, with the values."""
        return cls(**quartiles(values), values=values)


@dataclass(frozen=True)
class Target:
    """One target judged on a measured ratio (:func:`make_target`)."""

    key: str  # the report's letter or name of the target ("a", "ray", ...)
    what: str
    value: float  # a ratio of medians
    op: str  # "<=" or ">="
    bound: float
    unit: str  # "percent" or "times"
    passed: bool
    note: str
    per_round: RoundRatios | None = None  # the same ratio per interleaved round (None: not measured)

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, ``per_round`` only where measured."""
        return without_unset(asdict(self), ("per_round",))


def make_target(
    key: str,
    what: str,
    value: float,
    op: str,
    bound: float,
    unit: str,
    note: str = "",
    rounds: list[float] | None = None,
) -> Target:
    """One target, judged on ``value`` (a ratio of medians). ``rounds`` are the same
    ratio within each interleaved round; their quartiles show how well one run
    resolves the figure."""
    passed = value <= bound if op == "<=" else value >= bound
    return Target(
        key=key,
        what=what,
        value=value,
        op=op,
        bound=bound,
        unit=unit,
        passed=bool(passed),
        note=note,
        per_round=RoundRatios.of(rounds) if rounds else None,
    )


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header and a rule, as lines."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return lines


def format_value(t: Target) -> str:
    """A target's measured value as the report prints it."""
    return (
        f"{t.value:+.1%}"
        if t.unit == "percent" and t.key == "a"
        else (f"{t.value:.1%}" if t.unit == "percent" else f"{t.value:.2f}x")
    )


def format_spread(t: Target) -> str:
    """Interquartile range of the per-round ratio, in the target's unit."""
    if t.per_round is None:
        return ""
    q1, q3 = t.per_round.q1, t.per_round.q3
    if t.unit == "percent":
        sign = "+" if t.key == "a" else ""
        return f"{q1:{sign}.1%} .. {q3:{sign}.1%}"
    return f"{q1:.2f}x .. {q3:.2f}x"


def format_bound(t: Target) -> str:
    """A target's bound as the report prints it (``<= 5%``, ``>= 1.6x``)."""
    return f"{t.op} {t.bound:.0%}" if t.unit == "percent" else f"{t.op} {t.bound:.3g}x"


def target_table(targets: list[Target]) -> list[str]:
    """The targets as table lines: measured value, bound, PASS or MISS, per-round IQR, note."""
    rows = [
        [t.key, t.what, format_value(t), format_bound(t), "PASS" if t.passed else "MISS", format_spread(t), t.note]
        for t in targets
    ]
    return text_table(TARGET_HEADER, rows)


def device_label(machine: MachineInfo) -> str:
    """``cuda:0 (NVIDIA H200), 16 CPUs (model)``: where a benchmark ran, from :func:`~.timing.machine_info`."""
    name = f" ({machine.device_name})" if machine.device_name is not None else ""
    return f"{machine.device}{name}, {machine.cpu_count} CPUs ({machine.processor})"
