"""The benchmarks' records that need no torch: what a benchmark ran on (:class:`MachineInfo`,
which :func:`~splitvit.bench.timing.machine_info` fills in), and :func:`without_unset`, how a
record leaves out of its JSON the fields it did not measure. Apart from the timer so that
reading a timing's record back (a sweep's, a study's) needs no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..jsontypes import JsonObject


def without_unset(data: JsonObject, keys: tuple[str, ...]) -> JsonObject:
    """``data`` without those of ``keys`` whose value is ``None``: figures a run did not
    measure stay out of its JSON, as they did before they existed."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


@dataclass(frozen=True)
class MachineInfo:
    """What a benchmark ran on (:func:`~splitvit.bench.timing.machine_info`): CPUs, threads, versions, load,
    and the GPU's name on CUDA."""

    cpu_count: int | None
    torch_threads: int
    torch_version: str
    timm_version: str
    python: str
    platform: str
    processor: str  # the CPU's model
    device: str
    load_average_end: list[float]  # 1, 5 and 15 minutes, when it was described
    device_name: str | None = None  # the GPU's (None: not on CUDA)

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, ``device_name`` only on CUDA."""
        return without_unset(asdict(self), ("device_name",))

    @classmethod
    def from_dict(cls, data: JsonObject) -> MachineInfo:
        """The inverse of :meth:`to_dict`; keys it does not know (a benchmark's own, such as
        ``load_average_start``) are left to the caller."""
        return cls(
            **{f.name: data[f.name] for f in fields(cls) if f.name != "device_name"},
            device_name=data.get("device_name"),
        )


@dataclass(frozen=True)
class PolicyAim:
    """Where :func:`~splitvit.bench.training.aim_learned_policy` put a learned policy: the
    offset added to its output biases and the expected token ratio it reached."""

    offset: float | None  # None: a policy without per-level linear outputs, left as it was
    expected_ratio: float

    @classmethod
    def from_dict(cls, data: JsonObject) -> PolicyAim:
        """The inverse of ``asdict`` (a child process's JSON)."""
        return cls(offset=data["offset"], expected_ratio=data["expected_ratio"])
