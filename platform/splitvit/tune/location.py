"""Where a sweep lives, checked before Ray starts: its MLflow store and experiment, its
folder under the storage path (named, or the latest to resume), and its plan: the
space a sweep starts with is saved there (``sweep_space.json``), and a resumed sweep
must bring the same one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from ..config import ExperimentConfig, upgrade_flat, upgrade_sections
from ..jsontypes import JsonObject
from ..storage import exists, is_s3, join_uri, read_bytes, write_bytes
from .space import BaselineSettings, SearchSpace, StageTwoSettings, load_space
from .state import SweepError

log = logging.getLogger(__name__)


PLAN_FILE = "sweep_space.json"


def build_tracking(space: SearchSpace) -> tuple[ExperimentConfig, str, str]:
    base = space.config()
    experiment = space.mlflow.experiment or base.tracking.experiment
    return base, base.tracking_uri(), experiment


def sweep_location(space: SearchSpace, base: ExperimentConfig, name: str | None, resume: bool) -> tuple[str, str]:
    from ray import tune

    storage = base.storage.resolved_path()
    stem = Path(space.source).stem
    if name is None and resume:
        if is_s3(storage):
            raise SweepError(f"--resume on {storage}: name the sweep to resume (--name)")
        candidates = sorted(
            (p for p in Path(storage).glob(f"{stem}-*") if (p / "tuner.pkl").is_file()), key=lambda p: p.stat().st_mtime
        )
        if not candidates:
            raise SweepError(f"--resume: no sweep of {space.source} under {storage} to resume")
        name = candidates[-1].name
    name = name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "/" in name or name in (".", ".."):
        raise SweepError(f"sweep name must be a plain folder name, got {name!r}")
    sweep_dir = join_uri(storage, name)
    restorable = tune.Tuner.can_restore(sweep_dir)
    if resume and not restorable:
        raise SweepError(f"--resume: {sweep_dir} holds no sweep to resume")
    if not resume and restorable:
        raise SweepError(f"sweep {sweep_dir} already exists: pass --resume to continue it, or another --name")
    return name, sweep_dir


def _upgrade_plan(stored: JsonObject) -> JsonObject:
    """A saved plan's space with its settings' old key names (:data:`~splitvit.config.LEGACY_KEYS`)
    under the new ones: its parameters, fixed values and initial points."""
    stored = dict(stored)
    for section in ("parameters", "fixed"):
        if isinstance(stored.get(section), dict):
            stored[section] = upgrade_flat(stored[section])
    search = stored.get("search")
    if isinstance(search, dict) and isinstance(search.get("initial_points"), list):
        points = [upgrade_flat(p) if isinstance(p, dict) else p for p in search["initial_points"]]
        stored["search"] = {**search, "initial_points": points}
    return stored


def check_plan(space: SearchSpace, sweep_dir: str, overrides: list[str] | None, resume: bool) -> SearchSpace:
    """Save the space a sweep starts with; on resume, insist on the same one."""
    plan_uri = join_uri(sweep_dir, PLAN_FILE)
    current = {k: v for k, v in space.to_dict().items() if k != "source"}
    if not resume:
        write_bytes(
            plan_uri,
            json.dumps(
                {
                    "space": current,
                    "overrides": overrides or [],
                    "source": space.source,
                    "base_config": space.base_raw,
                },
                indent=2,
                sort_keys=True,
                default=str,
            ).encode(),
        )
        return space
    if not exists(plan_uri):
        return space
    saved = json.loads(read_bytes(plan_uri))
    if not overrides and saved.get("overrides"):
        # resume with the overrides the sweep started with
        space = load_space(space.source, saved["overrides"])
        current = {k: v for k, v in space.to_dict().items() if k != "source"}
    stored = saved["space"]
    normal = json.loads(json.dumps(current, sort_keys=True, default=str))
    if "speed" not in stored:
        normal.pop("speed", None)  # a sweep started before frontier timing: timed with the defaults
    # a stage-two or baselines key added after the sweep started (stage_two.ratios,
    # calibration_samples, baselines.reuse) left at its default means what the sweep did without it
    for section, settings in (("stage_two", StageTwoSettings()), ("baselines", BaselineSettings())):
        defaults = json.loads(json.dumps(dataclasses.asdict(settings), default=str))
        for key, default in defaults.items():
            if key not in stored.get(section, {}) and normal[section].get(key) == default:
                normal[section].pop(key, None)
    stored = _upgrade_plan(stored)  # a plan saved before the keys were grouped: the new names
    if "base_config" in saved:
        # the base config by what it says, not by where the checkout lies: a sweep resumes
        # from a moved or fresh clone of the same files
        stored = {**stored, "base": upgrade_sections(saved["base_config"], warn=False)}
        base = upgrade_sections(space.base_raw, warn=False)
        normal["base"] = json.loads(json.dumps(base, sort_keys=True, default=str))
    if normal != stored:
        changed = sorted(k for k in set(normal) | set(stored) if normal.get(k) != stored.get(k))
        raise SweepError(
            f"--resume: the space differs from the one {sweep_dir} started with (in {', '.join(changed)}); "
            f"resume with the same file and --set values ({saved.get('overrides') or 'none'})"
        )
    return space


def warn_if_temporary(storage: str) -> None:
    """A Ray job runs in a temporary copy of its working_dir; a relative storage path lands there."""
    if is_s3(storage) or not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return
    if Path(os.getcwd()) in Path(storage).parents or Path(storage) == Path(os.getcwd()):
        log.warning(
            "sweep storage %s lies in this Ray job's temporary working directory, which Ray may delete; "
            "pass --set storage.path=s3://... or an absolute shared folder",
            storage,
        )
