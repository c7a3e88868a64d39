"""``splitvit bench train --parts allocators``: the plain training loop under each memory allocator.

An allocator is chosen when a process starts (:mod:`splitvit.train.allocator`), so
each run is a child process of its own, started with that allocator's environment
(the allocator variables this process has are removed from it first). Each child
trains one model from scratch with :func:`~splitvit.train.local.fit_config`, the plain
loop, on the benchmark's config:

* ``full``: the full-resolution control (the config with ``model.policy.kind: full``);
* ``split``: the config's learned SplitViT, its policy aimed at ``train.budget.target_ratio``
  of the tokens before training (:func:`~splitvit.bench.training.aim_learned_policy`),
  one random-split warm-up epoch and then the learned policy: every batch holds other
  images and draws other decisions, so the step's token counts, and its tensors' sizes,
  change from step to step as in real training.

Runs alternate round by round: (glibc, full), (glibc, split), (jemalloc, full), ... in
even rounds, the reverse order in odd ones. Per allocator and model: steady-state
training images/s (training images over training-loop seconds of the epochs after
``skip_epochs``; the median over rounds, with the spread), its ratio to the default
allocator (``glibc``, always run), the child's peak RSS (``ru_maxrss``: the memory
footprint) and how much of it training added (the peak before the first epoch holds
torch, the model and the data), and over the steady epochs its minor page faults per image and the share
of its CPU time spent in the kernel (where pages mapped afresh show up). Each child
reports the allocator variables it saw and whether a preloaded library is mapped, so
that a figure is known to come from the allocator it is labelled with.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..config import ExperimentConfig
from ..jsontypes import JsonObject
from ..train.allocator import (
    ALLOCATORS,
    DEFAULT_ALLOCATOR,
    AllocatorError,
    allocator_env_seen,
    get_allocator,
    loaded_library,
    resolve_allocator_env,
    strip_allocator_env,
)
from .records import PolicyAim
from .report import RoundRatios, Target, make_target, target_table, text_table

log = logging.getLogger(__name__)

#: the models each allocator trains: the full-resolution control and the SPLIT config
ALLOCATOR_MODELS = ("full", "split")
#: the issue's bar: an allocator is worth adopting where it speeds training up this much
ALLOCATOR_GAIN_TARGET = 1.03


# ---------------------------------------------------------------------- choosing
@dataclass(frozen=True)
class ChosenAllocators:
    """The allocators to run (:func:`choose_allocators`), the default first."""

    env: dict[str, dict[str, str]]  # per allocator, the environment that selects it here
    skipped: list[str]  # a line per allocator of ``all`` not installed


def choose_allocators(names: tuple[str, ...], search_dirs: tuple[str, ...] | None = None) -> ChosenAllocators:
    """The allocators to run, the default first, each with the environment that selects
    it here; ``all`` is every known one, those not installed skipped with a line each.
    An allocator named explicitly that is not installed is an
    :class:`~splitvit.train.allocator.AllocatorError` (its library, the directories
    searched), raised before anything runs."""
    everything = "all" in names
    wanted = list(ALLOCATORS) if everything else [DEFAULT_ALLOCATOR, *names]
    for name in wanted:
        get_allocator(name)  # an unknown name fails before any library is looked for
    envs: dict[str, dict[str, str]] = {}
    skipped: list[str] = []
    for name in dict.fromkeys(wanted):
        try:
            envs[name] = resolve_allocator_env(name, search_dirs)
        except AllocatorError as exc:
            if not everything or name in names:
                raise
            skipped.append(f"skipped: {exc}")
    return ChosenAllocators(env=envs, skipped=skipped)


def model_configs(config: ExperimentConfig) -> dict[str, ExperimentConfig]:
    """Each model's experiment (a child gets it as a plain dict): ``full`` is ``config``
    at full resolution, validated here, not in a child; ``split`` the config itself (a
    learned policy)."""
    from ..train.experiment import experiment_from_dict

    if not config.model.policy.kind == "learned":
        raise ValueError(f"the allocators' SPLIT run needs model.policy.kind learned, got {config.model.policy.kind!r}")
    full = config.to_dict(redact=False)
    full["model"]["policy"]["kind"] = "full"
    return {"full": experiment_from_dict(full), "split": config}


# ---------------------------------------------------------------------- one child
def _rusage() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": time.perf_counter(),
        "max_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "minor_faults": usage.ru_minflt,
        "user_s": usage.ru_utime,
        "system_s": usage.ru_stime,
    }


def train_in_this_process(spec: JsonObject) -> JsonObject:
    """A child's work: train ``spec``'s model (``spec["config"]``, a plain experiment
    dict) with ``fit_config`` at ``spec["threads"]`` torch threads; per epoch its images/s,
    token fraction, minor page faults and user/system CPU seconds; the peak RSS, and the
    allocator this process runs under (its variables, the preloaded library mapped)."""
    import torch
    from torch.utils.data import DataLoader

    from ..data import build_dataset
    from ..train.experiment import build_model, experiment_from_dict
    from ..train.local import fit_config
    from .training import aim_learned_policy

    torch.set_num_threads(int(spec["threads"]))
    config = experiment_from_dict(spec["config"])
    mc, dc, tc = config.model, config.data, config.train
    device = torch.device(spec.get("device", "cpu"))
    torch.manual_seed(dc.seed * 1000)
    model = build_model(mc).to(device)
    data = build_dataset(
        dc.name,
        "train",
        seed=dc.seed,
        image_size=mc.image_size,
        interpolation=model.data_config["interpolation"],
        **dc.options,
    )
    aim = None
    if model.policy.learned:  # start the learned epochs at the operating point the budget trains towards
        images = next(iter(DataLoader(data, batch_size=dc.batch_size, shuffle=False)))[0].to(device)
        aim = aim_learned_policy(model, images, tc.budget.target_ratio)
    marks: list[dict[str, float]] = []
    history = fit_config(
        model,
        data,
        config,
        epoch_hook=lambda epoch, m: marks.append(_rusage()),
        on_epoch=lambda epoch, stats: marks.append(_rusage()),
    )
    per_batch = (len(data) // dc.batch_size) * dc.batch_size
    epochs = []
    for stats, start, end in zip(history, marks[0::2], marks[1::2]):
        epochs.append(
            {
                "epoch": int(stats["epoch"]),
                "images": per_batch,
                "train_s": per_batch / stats["images_per_s"],
                "images_per_s": stats["images_per_s"],
                "token_ratio": stats.get("token_ratio", 1.0),
                **{key: end[key] - start[key] for key in ("minor_faults", "user_s", "system_s")},
            }
        )
    allocator = spec["allocator"]
    return {
        "pid": os.getpid(),
        "epochs": epochs,
        "max_rss_mib": _rusage()["max_rss_mib"],
        # the peak before the first epoch (torch, the model, the data): what training added is the rest
        "max_rss_before_training_mib": marks[0]["max_rss_mib"] if marks else None,
        "allocator_env": allocator_env_seen(),
        "preloaded_library": loaded_library(allocator),
        "torch_threads": torch.get_num_threads(),
        "policy_aim": None if aim is None else asdict(aim),
    }


def _run_child(spec: JsonObject, env: dict[str, str], folder: Path, label: str) -> tuple[JsonObject, float]:
    """One child process under ``env`` (the allocator's variables on this process's
    environment without its own), running :func:`train_in_this_process` on ``spec``:
    what it wrote, and its wall seconds."""
    spec_path, out_path = folder / f"{label}-spec.json", folder / f"{label}-out.json"
    spec_path.write_text(json.dumps(spec))
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding splitvit/
    child_env = strip_allocator_env(dict(os.environ))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    child_env.update(env)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", __name__, str(spec_path), str(out_path)],
        env=child_env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"bench train allocators: the {label} run failed (exit {done.returncode}):\n{tail}")
    return json.loads(out_path.read_text()), time.perf_counter() - start


# ---------------------------------------------------------------------- figures
@dataclass(frozen=True)
class AllocatorSteady:
    """A run's steady epochs (:func:`_steady`)."""

    images_per_s: float  # training images over the training loop's seconds
    token_fraction: float
    minor_faults_per_image: float
    system_cpu_share: float | None  # the kernel's share of the CPU time (None: no CPU time)


@dataclass(frozen=True)
class AllocatorRun:
    """One child's run: what it wrote (:func:`train_in_this_process`), its wall seconds,
    which round, allocator and model it was, and its steady figures."""

    pid: int
    epochs: list[dict[str, float]]  # per epoch: images, seconds, token ratio, faults, CPU seconds
    max_rss_mib: float
    max_rss_before_training_mib: float | None  # the peak before the first epoch (None: no epoch marked)
    allocator_env: dict[str, str]  # the allocator variables the child saw
    preloaded_library: str | None
    torch_threads: int
    policy_aim: PolicyAim | None  # the split model's (None: full resolution)
    wall_s: float
    round: int
    allocator: str
    model: str
    env: dict[str, str]  # what the child was given
    steady: AllocatorSteady

    @classmethod
    def of_child(cls, written: JsonObject, **given: Any) -> AllocatorRun:
        """The run from the child's JSON and what the parent knows of it (``given``)."""
        aim = written["policy_aim"]
        child = {f.name: written[f.name] for f in fields(cls) if f.name in written}
        return cls(**{**child, "policy_aim": None if aim is None else PolicyAim.from_dict(aim)}, **given)


@dataclass(frozen=True)
class AllocatorSummary:
    """One allocator and model over the rounds, and its ratios to the default's (:func:`_summary`)."""

    images_per_s: float  # steady, the median over rounds
    images_per_s_min: float
    images_per_s_max: float
    images_per_s_rounds: list[float]
    ratio_to_default: float
    ratio_per_round: RoundRatios  # paired by round with the default's run
    max_rss_mib: float
    max_rss_mib_max: float
    rss_ratio_to_default: float
    rss_growth_in_training_mib: float
    minor_faults_per_image: float
    system_cpu_share: float | None
    token_fraction: float


@dataclass(frozen=True)
class AllocatorChoice:
    """An allocator as part C ran it: what it is, and the environment that selected it."""

    description: str
    env: dict[str, str]


@dataclass(frozen=True)
class AllocatorConfig:
    """Part C's ``config``: the experiment and how every child was run."""

    experiment: ExperimentConfig  # the SPLIT config (its JSON redacted: :meth:`to_dict`)
    threads: int
    device: str
    rounds: int
    skip_epochs: int
    allocators: dict[str, AllocatorChoice]  # the default first
    inherited_allocator_env: dict[str, str]  # this process's allocator variables (kept from the children)

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, the experiment as :meth:`ExperimentConfig.to_dict` redacts it."""
        return {
            "experiment": self.experiment.to_dict(redact=True),
            "threads": self.threads,
            "device": self.device,
            "rounds": self.rounds,
            "skip_epochs": self.skip_epochs,
            "allocators": {name: asdict(choice) for name, choice in self.allocators.items()},
            "inherited_allocator_env": dict(self.inherited_allocator_env),
        }


@dataclass(frozen=True)
class AllocatorReport:
    """Part C's result (:func:`run_allocator_benchmark`): every run, per allocator and
    model its summary, the targets and the runs that did not run as labelled."""

    config: AllocatorConfig
    skipped: list[str]
    load_average_start: list[float]
    load_average_end: list[float]
    runs: list[AllocatorRun]
    figures: dict[str, dict[str, AllocatorSummary]]  # per allocator, per model
    targets: list[Target]
    warnings: list[str]

    def to_dict(self) -> JsonObject:
        """Its part of the JSON (``allocators``)."""
        data = asdict(self)
        data["config"] = self.config.to_dict()
        data["targets"] = [t.to_dict() for t in self.targets]
        return data


def _steady(epochs: list[dict[str, float]], skip: int) -> AllocatorSteady:
    """A run's steady epochs (after ``skip``): images/s over the training loop's
    seconds, token fraction, minor faults per image and the kernel's share of CPU time."""
    kept = [e for e in epochs if e["epoch"] >= skip]
    images, seconds = sum(e["images"] for e in kept), sum(e["train_s"] for e in kept)
    cpu = sum(e["user_s"] + e["system_s"] for e in kept)
    return AllocatorSteady(
        images_per_s=images / seconds,
        token_fraction=statistics.fmean(e["token_ratio"] for e in kept),
        minor_faults_per_image=sum(e["minor_faults"] for e in kept) / images,
        system_cpu_share=sum(e["system_s"] for e in kept) / cpu if cpu > 0 else None,
    )


def _summary(rounds: list[AllocatorRun], baseline: list[AllocatorRun]) -> AllocatorSummary:
    """One allocator and model over the rounds, and its ratios to the default's runs
    of the same rounds (paired by round)."""
    speeds = [r.steady.images_per_s for r in rounds]
    base = [r.steady.images_per_s for r in baseline]
    rss = [r.max_rss_mib for r in rounds]
    grown = [r.max_rss_mib - r.max_rss_before_training_mib for r in rounds]
    paired = [s / b for s, b in zip(speeds, base)]
    shares = [r.steady.system_cpu_share for r in rounds if r.steady.system_cpu_share is not None]
    return AllocatorSummary(
        images_per_s=statistics.median(speeds),
        images_per_s_min=min(speeds),
        images_per_s_max=max(speeds),
        images_per_s_rounds=speeds,
        ratio_to_default=statistics.median(speeds) / statistics.median(base),
        ratio_per_round=RoundRatios.of(paired),
        max_rss_mib=statistics.median(rss),
        max_rss_mib_max=max(rss),
        rss_ratio_to_default=statistics.median(rss) / statistics.median(r.max_rss_mib for r in baseline),
        rss_growth_in_training_mib=statistics.median(grown),
        minor_faults_per_image=statistics.median(r.steady.minor_faults_per_image for r in rounds),
        system_cpu_share=statistics.median(shares) if shares else None,
        token_fraction=statistics.fmean(r.steady.token_fraction for r in rounds),
    )


def _checks(runs: list[AllocatorRun]) -> list[str]:
    """Runs whose child did not run under the allocator it was given."""
    warnings = []
    for run in runs:
        preloads = get_allocator(run.allocator).preloads
        if run.allocator_env != run.env or (preloads and run.preloaded_library is None):
            warnings.append(
                f"allocators: round {run.round + 1}, {run.allocator} {run.model}: the child saw "
                f"{run.allocator_env} and preloaded {run.preloaded_library}"
            )
    return warnings


# ---------------------------------------------------------------------- the benchmark
def run_allocator_benchmark(
    config: ExperimentConfig,
    *,
    allocators: tuple[str, ...] = ("all",),
    rounds: int = 3,
    threads: int | None = None,
    skip_epochs: int = 1,
    device: str = "cpu",
    search_dirs: tuple[str, ...] | None = None,
) -> AllocatorReport:
    """The plain training loop of the control and the SPLIT config under each
    allocator, side by side (see the module doc).

    Args:
        config: the SPLIT experiment (a learned policy); its control is the same at
            full resolution.
        allocators: names from :data:`~splitvit.train.allocator.ALLOCATORS`, or
            ``all``; the default allocator always runs (every ratio's baseline).
        rounds: runs of every allocator and model, the order reversed every other round.
        threads: torch threads of every child (default: this process's).
        skip_epochs: leading epochs left out of the steady-state figures.
        device: the children's torch device.
        search_dirs: where libraries are looked for (default: the standard directories).
    """
    import torch

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not 0 <= skip_epochs < config.train.epochs:
        raise ValueError(f"skip_epochs must be in [0, train.epochs) = [0, {config.train.epochs}), got {skip_epochs}")
    threads = int(threads or torch.get_num_threads())
    chosen = choose_allocators(allocators, search_dirs)  # every library found before anything runs
    for line in chosen.skipped:  # said now, before the runs; the report lists them again
        log.warning("bench train allocators: %s", line)
    configs = model_configs(config)
    order = [(a, m) for a in chosen.env for m in ALLOCATOR_MODELS]
    load_start = list(os.getloadavg())
    runs: list[AllocatorRun] = []
    with tempfile.TemporaryDirectory(prefix="splitvit-bench-alloc-") as tmp:
        for r in range(rounds):
            for allocator, model in order if r % 2 == 0 else order[::-1]:
                log.info("bench train: allocators round %d/%d, %s %s", r + 1, rounds, allocator, model)
                env = chosen.env[allocator]
                spec = {
                    "config": configs[model].to_dict(redact=False),
                    "threads": threads,
                    "allocator": allocator,
                    "device": device,
                }
                written, wall_s = _run_child(spec, env, Path(tmp), f"r{r}-{allocator}-{model}")
                steady = _steady(written["epochs"], skip_epochs)
                given = dict(wall_s=wall_s, round=r, allocator=allocator, model=model, env=env, steady=steady)
                runs.append(AllocatorRun.of_child(written, **given))
    figures = {
        a: {
            m: _summary(
                [x for x in runs if x.allocator == a and x.model == m],
                [x for x in runs if x.allocator == DEFAULT_ALLOCATOR and x.model == m],
            )
            for m in ALLOCATOR_MODELS
        }
        for a in chosen.env
    }
    targets = [
        make_target(
            f"allocator-{a}-{m}",
            f"{a} vs {DEFAULT_ALLOCATOR}: steady training images/s, {m}",
            figures[a][m].ratio_to_default,
            ">=",
            ALLOCATOR_GAIN_TARGET,
            "times",
            note=f"peak RSS {figures[a][m].rss_ratio_to_default:.2f}x, {rounds} round(s)",
            rounds=figures[a][m].ratio_per_round.values,
        )
        for a in chosen.env
        if a != DEFAULT_ALLOCATOR
        for m in ALLOCATOR_MODELS
    ]
    return AllocatorReport(
        config=AllocatorConfig(
            experiment=config,
            threads=threads,
            device=device,
            rounds=rounds,
            skip_epochs=skip_epochs,
            allocators={a: AllocatorChoice(ALLOCATORS[a].description, e) for a, e in chosen.env.items()},
            inherited_allocator_env=allocator_env_seen(),
        ),
        skipped=chosen.skipped,
        load_average_start=load_start,
        load_average_end=list(os.getloadavg()),
        runs=runs,
        figures=figures,
        targets=targets,
        warnings=_checks(runs),
    )


def format_allocator_lines(result: AllocatorReport) -> list[str]:
    """The allocators part of ``bench train``'s report: one row per allocator and model."""
    cfg = result.config
    epochs = cfg.experiment.train.epochs
    lines = [
        "",
        f"C. allocators: the plain loop (fit_local) trained from scratch in a child process per run, "
        f"{cfg.threads} torch threads, {epochs} epochs (steady: epochs >= {cfg.skip_epochs}), "
        f"{cfg.rounds} round(s) alternating the order; split: a learned policy aimed at "
        f"{cfg.experiment.train.budget.target_ratio:.0%} of the tokens, other images and decisions every step",
    ]
    lines += [f"  {name}: {a.description} {a.env or ''}".rstrip() for name, a in cfg.allocators.items()]
    lines += [f"  {line}" for line in result.skipped]
    rows = []
    for allocator, models in result.figures.items():
        for model, f in models.items():
            rows.append(
                [
                    allocator,
                    model,
                    f"{f.images_per_s:.1f}",
                    f"{f.images_per_s_min:.1f}-{f.images_per_s_max:.1f}",
                    f"{f.ratio_to_default:.3f}x",
                    f"{f.ratio_per_round.q1:.3f}x .. {f.ratio_per_round.q3:.3f}x",
                    f"{f.max_rss_mib:.0f}",
                    f"{f.rss_ratio_to_default:.2f}x",
                    f"{f.rss_growth_in_training_mib:.0f}",
                    f"{f.minor_faults_per_image:.1f}",
                    f"{f.system_cpu_share:.1%}" if f.system_cpu_share is not None else "?",
                    f"{f.token_fraction:.2f}",
                ]
            )
    header = [
        "allocator",
        "model",
        "steady img/s",
        "min-max",
        "vs glibc",
        "per-round IQR",
        "peak RSS MiB",
        "RSS vs glibc",
        "of it in training",
        "minor faults/img",
        "kernel CPU",
        "tokens",
    ]
    lines += ["  " + line for line in text_table(header, rows)]
    if result.targets:
        lines += ["  " + line for line in target_table(result.targets)]
    return lines


def _child_main(argv: list[str]) -> int:
    """``python -m splitvit.bench.allocators SPEC.json OUT.json``: one child's run."""
    spec_path, out_path = argv
    result = train_in_this_process(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
