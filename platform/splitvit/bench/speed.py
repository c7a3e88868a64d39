"""Measured speed of operating points: each (checkpoint, thresholds) point timed
against the full-resolution model, side by side, in one run on one device.

:func:`time_operating_points` is the one timing routine of sweeps (every frontier
point) and studies (every method's point at each evaluation ratio). It reuses
:mod:`splitvit.bench.timing`'s timer (:func:`~splitvit.bench.timing.time_beside_others`:
interleaved rounds, forward order then reverse, ``synchronize`` around each call on
CUDA, medians), so a figure here means what it means in ``splitvit bench forward``:

* every point's model (its checkpoint, its own policy, its thresholds) and the
  full-resolution model (the same checkpoint format with the ``full`` policy: every
  node splits, the sweep's "full resolution" baseline) run on **one fixed batch**:
  the first ``batch_size`` images of the evaluation split of the reference
  checkpoint;
* under ``torch.inference_mode()`` and the precision evaluations run in (bf16
  autocast on CUDA, float32 on the CPU), after ``warmup`` rounds, ``rounds`` rounds
  in which every model runs once;
* ``speedup_vs_full`` = median seconds of the full-resolution model / median
  seconds of the point (a ratio of medians, measured in the same run), beside the
  same ratio from the fastest rounds and the quartiles of the per-round ratio;
* ``token_ratio`` is measured on the timed batch (tokens per image / full tokens).

A detector's points (:class:`~splitvit.model.detection.SplitDetector` checkpoints) are
timed twice in the same rounds: the whole detector (backbone, pyramid, proposals and
RoI heads: the figures above) and its backbone alone (the SplitViT's
:meth:`~splitvit.model.splitvit.SplitViT.fine_features`: ``backbone_*``), each against
the full-resolution detector's same part, so the share of the speed-up the heads
take back is measured rather than inferred.

Points whose checkpoints differ in architecture (model, width, depth, image size,
levels) are each compared with a full-resolution model of their own architecture;
all of them run in the same interleaved rounds. Nothing here is judged against a
target: the figures are recorded as measured.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..jsontypes import JsonObject
from .records import MachineInfo

if TYPE_CHECKING:
    import torch

    from ..model import SplitViT
    from ..model.detection import SplitDetector
    from ..model.spec import CheckpointPayload
    from .timing import TimingSummary

log = logging.getLogger(__name__)

#: A timed call's name for a detector's backbone alone (``<name>:backbone``).
BACKBONE_SUFFIX = ":backbone"


@dataclass(frozen=True)
class OperatingPoint:
    """What :func:`time_operating_points` times: a checkpoint at its thresholds."""

    checkpoint: str  # a checkpoint folder or ``model.pt``
    thresholds: list[float] | None = None  # per level (None: the checkpoint's own)
    policy: str | None = None  # None: the checkpoint's
    budget: float | None = None  # the target ratio a budget-conditioned policy is told (None: the checkpoint's)
    label: str | None = None  # None: ``point<index>``


def without_unset_backbone(data: JsonObject) -> JsonObject:
    """``data`` without the ``backbone_*`` fields that are ``None`` (a classifier's:
    its JSON stays as it was before detectors were timed)."""
    return {k: v for k, v in data.items() if not (k.startswith("backbone_") and v is None)}


def read_speed_fields(cls: type, data: JsonObject) -> JsonObject:
    """``cls``'s fields from ``data``: a missing key raises ``KeyError``, but for the
    ``backbone_*`` fields (a detector's alone), which default to ``None``."""
    return {f.name: data.get(f.name) if f.name.startswith("backbone_") else data[f.name] for f in fields(cls) if f.init}


@dataclass(frozen=True)
class FullTiming:
    """A full-resolution model (a reference checkpoint run with the ``full`` policy: every
    node splits), timed beside the points of its architecture."""

    key: str  # "full<i>": what a timed point's ``full`` names
    checkpoint: str
    policy: str  # "full"
    median_s: float  # median seconds per call (a batch)
    min_s: float  # the fastest round's seconds
    images_per_s: float  # at the median
    tokens_per_image: float
    token_ratio: float  # 1.0
    speedup_vs_full: float  # 1.0
    # a detector's backbone alone, timed in the same rounds (None for a classifier)
    backbone_median_s: float | None = field(default=None, kw_only=True)
    backbone_images_per_s: float | None = field(default=None, kw_only=True)

    def to_dict(self) -> JsonObject:
        """The JSON form: one key per field, in field order (``backbone_*`` only for a detector)."""
        return without_unset_backbone(asdict(self))

    @classmethod
    def from_dict(cls, data: JsonObject) -> FullTiming:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        return cls(**read_speed_fields(cls, data))


@dataclass(frozen=True)
class TimedPoint:
    """One operating point timed against the full-resolution model of its architecture,
    in the same interleaved rounds, on the same batch."""

    index: int  # its place in the points given
    label: str
    checkpoint: str
    policy: str  # the policy it ran with
    thresholds: list[float] | None  # None: the checkpoint's own
    budget: float | None  # the target ratio a budget-conditioned policy was told (else None)
    full: str  # the :attr:`FullTiming.key` it was compared with
    tokens_per_image: float  # measured on the timed batch
    token_ratio: float  # tokens per image / full tokens
    median_s: float
    min_s: float
    images_per_s: float
    full_images_per_s: float
    speedup_vs_full: float  # median full seconds / median point seconds, same run
    speedup_vs_full_fastest: float  # the same ratio of the fastest rounds
    speedup_vs_full_per_round: dict[str, float]  # median, q1, q3 of the per-round ratio
    # a detector's backbone alone against the full-resolution detector's, same rounds
    # (None for a classifier: its figures above are its backbone's)
    backbone_median_s: float | None = field(default=None, kw_only=True)
    backbone_images_per_s: float | None = field(default=None, kw_only=True)
    backbone_full_images_per_s: float | None = field(default=None, kw_only=True)
    backbone_speedup_vs_full: float | None = field(default=None, kw_only=True)

    def to_dict(self) -> JsonObject:
        """The JSON form: one key per field, in field order (``backbone_*`` only for a detector)."""
        return without_unset_backbone(asdict(self))

    @classmethod
    def from_dict(cls, data: JsonObject) -> TimedPoint:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        return cls(**read_speed_fields(cls, data))


@dataclass(frozen=True)
class SpeedRecord:
    """What :func:`time_operating_points` measured: the setting, the full-resolution
    models and every point, in the order given."""

    device: str  # with the GPU's name on CUDA
    machine: MachineInfo  # :func:`~splitvit.bench.timing.machine_info`
    batch_size: int
    rounds: int
    warmup: int
    precision: str  # "bf16 autocast" on CUDA, else "float32"
    images: str  # which images were timed
    method: str  # how the figures were taken, in words
    full: list[FullTiming]
    points: list[TimedPoint]
    other_processes_cpus: float | None  # CPUs other processes used meanwhile (None: unknown)
    warnings: list[str]
    seconds: float  # the whole timing, loading included

    def to_dict(self) -> JsonObject:
        """The JSON form (``frontier_speed`` of a sweep): one key per field, in field order."""
        data = asdict(self)
        data["machine"] = self.machine.to_dict()
        data["full"] = [f.to_dict() for f in self.full]
        data["points"] = [p.to_dict() for p in self.points]
        return data

    @classmethod
    def from_dict(cls, data: JsonObject) -> SpeedRecord:
        """The inverse of :meth:`to_dict` (a missing key raises ``KeyError``)."""
        values = {f.name: data[f.name] for f in fields(cls)}
        values["machine"] = MachineInfo.from_dict(data["machine"])
        values["full"] = [FullTiming.from_dict(f) for f in data["full"]]
        values["points"] = [TimedPoint.from_dict(p) for p in data["points"]]
        return cls(**values)


def spread(items: list[Any], count: int | None) -> list[Any]:
    """At most ``count`` of ``items`` (kept in order): both ends and evenly in between."""
    if count is None or len(items) <= count:
        return list(items)
    if count <= 0:
        return []
    if count == 1:
        return [items[0]]
    picked = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)})
    return [items[i] for i in picked]


def _architecture(payload: CheckpointPayload) -> str:
    """What decides a forward pass's cost apart from the policy and thresholds."""
    spec = payload.get("spec") or {}
    kept = {k: v for k, v in spec.items() if not k.startswith("policy") and k != "thresholds"}
    if "detector" in payload:  # a detector's heads cost time too
        kept["detector"] = payload["detector"]
    return json.dumps(kept, sort_keys=True, default=str)


@dataclass
class _Reference:
    """A full-resolution model and the batch every point of its architecture runs on."""

    key: str
    architecture: str  # :func:`_architecture` of its checkpoint
    checkpoint: str
    model: SplitViT | SplitDetector
    images: torch.Tensor


@dataclass
class _Prepared:
    """A point ready to time: its model call and what it measured before timing."""

    index: int
    label: str
    checkpoint: str
    policy: str
    thresholds: list[float] | None
    budget: float | None
    full: str
    tokens_per_image: float
    token_ratio: float
    call: Callable[[], Any]
    batch: int  # images per call
    backbone_call: Callable[[], Any] | None  # a detector's backbone alone (else None)


def time_operating_points(
    points: Sequence[OperatingPoint],
    *,
    full_checkpoint: str | None = None,
    batch_size: int = 32,
    rounds: int = 5,
    warmup: int = 1,
    split: str | None = None,
    device: str = "cpu",
) -> SpeedRecord:
    """Time every operating point against the full-resolution model, interleaved.

    Args:
        points: the points to time (:class:`OperatingPoint`: a checkpoint, its
            thresholds and, optionally, its policy, the budget a budget-conditioned
            policy is told, as when the thresholds were calibrated, and a label).
        full_checkpoint: the full-resolution model's checkpoint (run with the ``full``
            policy) for the points of its architecture. Points of another
            architecture (or all, by default) are compared with the first of their
            checkpoints run with the ``full`` policy.
        batch_size, rounds, warmup: the timing (see the module docstring).
        split: the data split the batch comes from (default: the checkpoint's
            validation split).
        device: where to time (the device the sweep or study evaluated on).

    Returns:
        The :class:`SpeedRecord`: every point (in the order given) as a
        :class:`TimedPoint`, compared with the :class:`FullTiming` its ``full`` names.
    """
    import torch

    from ..train.checkpoints import load_payload
    from .timing import machine_info

    if not points:
        raise ValueError("no operating points to time")
    if batch_size < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"batch_size and rounds must be >= 1 and warmup >= 0, got {batch_size}, {rounds}, {warmup}")
    started = time.time()
    dev = torch.device(device)
    payload = functools.cache(load_payload)  # each checkpoint read once
    arch_of = {p.checkpoint: _architecture(payload(p.checkpoint)) for p in points}
    references, autocast = _full_models(points, arch_of, payload, full_checkpoint, batch_size, device, split)
    models = _point_models(points, payload, dev)
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(autocast())
        full_tokens = {
            key: float(split_output(ref.model(ref.images)).tokens.float().mean()) for key, ref in references.items()
        }
        prepared = _prepare_points(points, models, references, arch_of)
        samples, timings, others = _time_calls(references, prepared, batch_size, rounds=rounds, warmup=warmup, dev=dev)
    machine = machine_info(dev)
    n = min(int(ref.images.shape[0]) for ref in references.values())
    record = SpeedRecord(
        device=str(dev) + (f" ({machine.device_name})" if machine.device_name is not None else ""),
        machine=machine,
        batch_size=n,
        rounds=rounds,
        warmup=warmup,
        precision="bf16 autocast" if dev.type == "cuda" else "float32",
        images=f"the first {n} images of the {split or 'validation'} split",
        method="interleaved rounds (bench.time_beside_others); speedup_vs_full = median full-resolution seconds / "
        "median point seconds, same run, same batch",
        full=[
            _full_timing(ref, timings[key], full_tokens[key], timings.get(key + BACKBONE_SUFFIX))
            for key, ref in references.items()
        ],
        points=[_timed_point(p, samples, timings) for p in prepared],
        other_processes_cpus=others,
        warnings=_load_warnings(others, machine),
        seconds=time.time() - started,
    )
    for w in record.warnings:
        log.warning("speed: %s", w)
    return record


def _full_models(
    points: Sequence[OperatingPoint],
    arch_of: dict[str, str],
    payload: Callable[[str], CheckpointPayload],
    full_checkpoint: str | None,
    batch_size: int,
    device: str,
    split: str | None,
) -> tuple[dict[str, _Reference], Callable[[], AbstractContextManager[Any]]]:
    """The full-resolution models, one per architecture among the points (``full_checkpoint``'s
    first), each with its batch, by key; and the precision evaluations run in."""
    from ..train.evaluation import CheckpointEvaluator

    checkpoints: dict[str, str] = {}
    if full_checkpoint is not None:
        checkpoints[_architecture(payload(str(full_checkpoint)))] = str(full_checkpoint)
    for p in points:
        checkpoints.setdefault(arch_of[p.checkpoint], p.checkpoint)
    references: dict[str, _Reference] = {}
    evaluators = []
    for i, (arch, checkpoint) in enumerate((a, c) for a, c in checkpoints.items() if a in arch_of.values()):
        evaluator = CheckpointEvaluator(checkpoint, samples=batch_size, device=device, cache=False, split=split)
        images = evaluator.first_images(batch_size)
        references[f"full{i}"] = _Reference(f"full{i}", arch, checkpoint, evaluator.build("full"), images)
        evaluators.append(evaluator)
    return references, evaluators[0].autocast  # the points' architectures: at least one


def _point_models(
    points: Sequence[OperatingPoint], payload: Callable[[str], CheckpointPayload], dev: torch.device
) -> dict[tuple[str, str | None], SplitViT | SplitDetector]:
    """Every point's model (a SplitViT or a detector), one per (checkpoint, policy), in
    evaluation mode on ``dev``."""
    from ..train.checkpoints import model_from_payload

    models: dict[tuple[str, str | None], SplitViT | SplitDetector] = {}
    for p in points:
        key = (p.checkpoint, p.policy)
        if key not in models:
            overrides = {"policy": p.policy} if p.policy else {}
            models[key] = model_from_payload(payload(p.checkpoint), p.checkpoint, **overrides).to(dev).eval()
    return models


def split_output(out: Any) -> Any:
    """The backbone's :class:`~splitvit.model.splitvit.SplitOutput` of a model's output
    (a detector's carries it as ``split``)."""
    return getattr(out, "split", out)


def _call(model: SplitViT | SplitDetector, images: torch.Tensor, **kwargs: Any) -> Callable[[], Any]:
    """One timed call: ``model`` on ``images``."""
    return functools.partial(model, images, **kwargs)


def backbone_call(model: SplitViT | SplitDetector, images: torch.Tensor, **kwargs: Any) -> Callable[[], Any] | None:
    """A detector's backbone alone on ``images`` (the fine map its heads read); ``None``
    for a SplitViT, whose whole call is its backbone's."""
    from ..model.detection import SplitDetector

    if not isinstance(model, SplitDetector):
        return None
    return functools.partial(model.backbone.fine_features, images, **kwargs)


def _prepare_points(
    points: Sequence[OperatingPoint],
    models: dict[tuple[str, str | None], SplitViT | SplitDetector],
    references: dict[str, _Reference],
    arch_of: dict[str, str],
) -> list[_Prepared]:
    """Each point's call on its reference's batch, and the tokens it keeps there (run once)."""
    keys = {ref.architecture: key for key, ref in references.items()}
    prepared = []
    for i, p in enumerate(points):
        from ..model.detection import split_backbone

        model = models[(p.checkpoint, p.policy)]
        backbone = split_backbone(model)
        ref = references[keys[arch_of[p.checkpoint]]]
        thresholds = [float(t) for t in p.thresholds] if p.thresholds is not None else None
        budget = float(p.budget) if backbone.uses_budget and p.budget is not None else None
        out = split_output(model(ref.images, thresholds=thresholds, budget=budget))
        tokens = float(out.tokens.float().mean())
        prepared.append(
            _Prepared(
                index=i,
                label=p.label if p.label is not None else f"point{i}",
                checkpoint=p.checkpoint,
                policy=backbone.policy.name,
                thresholds=thresholds,
                budget=budget,
                full=ref.key,
                tokens_per_image=tokens,
                token_ratio=tokens / out.full_tokens,
                call=_call(model, ref.images, thresholds=thresholds, budget=budget),
                batch=int(ref.images.shape[0]),
                backbone_call=backbone_call(model, ref.images, thresholds=thresholds, budget=budget),
            )
        )
    return prepared


def _time_calls(
    references: dict[str, _Reference],
    prepared: list[_Prepared],
    batch_size: int,
    *,
    rounds: int,
    warmup: int,
    dev: torch.device,
) -> tuple[dict[str, list[float]], dict[str, TimingSummary], float | None]:
    """Every full-resolution model and point timed in the same interleaved rounds: the
    seconds per round and the figures (:func:`~splitvit.bench.timing.timing_summary`)
    by name (``full<i>``, ``point<i>``), and the CPUs other processes used meanwhile."""
    from .timing import synchronizer, time_beside_others, timing_summary

    log.info(
        "speed: timing %d operating point(s) against %d full-resolution model(s) on %s, batch %d, "
        "%d warm-up + %d interleaved rounds",
        len(prepared),
        len(references),
        dev,
        batch_size,
        warmup,
        rounds,
    )
    fns: dict[str, Callable[[], Any]] = {key: _call(ref.model, ref.images) for key, ref in references.items()}
    fns.update({f"point{p.index}": p.call for p in prepared})
    sizes = {key: int(ref.images.shape[0]) for key, ref in references.items()}  # images per call
    sizes.update({f"point{p.index}": p.batch for p in prepared})
    # a detector's backbone alone, in the same rounds (its full-resolution one beside it)
    for key, ref in references.items():
        backbone = backbone_call(ref.model, ref.images)
        if backbone is not None:
            fns[key + BACKBONE_SUFFIX], sizes[key + BACKBONE_SUFFIX] = backbone, sizes[key]
    for p in prepared:
        if p.backbone_call is not None:
            fns[f"point{p.index}{BACKBONE_SUFFIX}"], sizes[f"point{p.index}{BACKBONE_SUFFIX}"] = (
                p.backbone_call,
                p.batch,
            )
    samples, cpu_samples, others = time_beside_others(fns, repeats=rounds, warmup=warmup, sync=synchronizer(dev))
    timings = {name: timing_summary(s, cpu_samples[name], sizes[name]) for name, s in samples.items()}
    return samples, timings, others


def _full_timing(
    ref: _Reference, timing: TimingSummary, tokens: float, backbone: TimingSummary | None = None
) -> FullTiming:
    """A full-resolution model's figures (:func:`~splitvit.bench.timing.timing_summary`),
    and a detector's backbone's (``backbone``)."""
    return FullTiming(
        key=ref.key,
        checkpoint=ref.checkpoint,
        policy="full",
        median_s=timing.median_s,
        min_s=timing.min_s,
        images_per_s=timing.images_per_s,
        tokens_per_image=tokens,
        token_ratio=1.0,
        speedup_vs_full=1.0,
        **(
            {"backbone_median_s": backbone.median_s, "backbone_images_per_s": backbone.images_per_s} if backbone else {}
        ),
    )


def _timed_point(point: _Prepared, samples: dict[str, list[float]], timings: dict[str, TimingSummary]) -> TimedPoint:
    """A point's figures beside its full-resolution model's, from the same rounds."""
    from .timing import quartiles

    name = f"point{point.index}"
    t, f = timings[name], timings[point.full]
    per_round = [a / b for a, b in zip(samples[point.full], samples[name])]
    backbone: dict[str, float] = {}
    if name + BACKBONE_SUFFIX in timings:  # a detector: its backbone against full resolution's
        tb, fb = timings[name + BACKBONE_SUFFIX], timings[point.full + BACKBONE_SUFFIX]
        backbone = {
            "backbone_median_s": tb.median_s,
            "backbone_images_per_s": tb.images_per_s,
            "backbone_full_images_per_s": fb.images_per_s,
            "backbone_speedup_vs_full": fb.median_s / tb.median_s,
        }
    return TimedPoint(
        index=point.index,
        label=point.label,
        checkpoint=point.checkpoint,
        policy=point.policy,
        thresholds=point.thresholds,
        budget=point.budget,
        full=point.full,
        tokens_per_image=point.tokens_per_image,
        token_ratio=point.token_ratio,
        median_s=t.median_s,
        min_s=t.min_s,
        images_per_s=t.images_per_s,
        full_images_per_s=f.images_per_s,
        speedup_vs_full=f.median_s / t.median_s,
        speedup_vs_full_fastest=f.min_s / t.min_s,
        speedup_vs_full_per_round=quartiles(per_round),
        **backbone,
    )


def _load_warnings(others: float | None, machine: MachineInfo) -> list[str]:
    """What made the figures noisy: other processes busy on the CPUs meanwhile."""
    from .timing import OTHER_LOAD_WARNING

    if others is not None and others > OTHER_LOAD_WARNING:
        return [
            f"other processes used {others:.2f} of the {machine.cpu_count} CPUs on average while the "
            "models were timed: the wall-clock figures are noisy"
        ]
    return []
