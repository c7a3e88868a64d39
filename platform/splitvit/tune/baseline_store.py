"""Fine-tuned baselines kept for later sweeps: a sweep with a ``reference:`` fine-tunes
full resolution, entropy and random splitting from it (a third of a CPU sweep's
epochs), and every later sweep whose baseline would be trained and evaluated the same
way reuses that one instead of training it again.

A finished sweep writes each baseline it trained to
``<storage path>/baselines/<policy>-<digest>.json``: the trial's final report (its
figures and its points at ``baselines.ratios``) and where it came from. The digest
covers everything the baseline's figures depend on: the reference checkpoint, the
baseline's whole training config (its storage and tracking keys aside) and the stage-two
and baseline settings it was evaluated with. A later sweep reuses a stored baseline
whose digest matches and whose checkpoint is still there (``baselines.reuse: false``
trains them anyway). Which ones a sweep reuses is decided once, when it starts, and
kept in its folder, so a resumed sweep neither trains nor counts one twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass

from ..jsontypes import JsonObject
from ..storage import exists, join_uri, read_bytes, write_bytes
from .state import fine_tuned_baselines
from .trial import BASELINE_KEY, TRIAL_RESULT_FILE, SweepPlan, TrialFinal

log = logging.getLogger(__name__)

STORE_FOLDER = "baselines"  # under the storage path, beside references/
REUSED_FILE = "reused_baselines.json"  # in a sweep's folder: what it reuses, decided at its start


@dataclass(frozen=True)
class StoredBaseline:
    """A fine-tuned baseline a finished sweep trained, as a later sweep reuses it.

    Attributes:
        policy: ``full``, ``entropy`` or ``random``.
        digest: what it was trained and evaluated with (:func:`baseline_digest`).
        sweep: the sweep that trained it; ``trial_id`` its trial there.
        report: the trial's final report, as it reported it to Tune.
    """

    policy: str
    digest: str
    sweep: str
    trial_id: str
    report: JsonObject

    @property
    def checkpoint(self) -> str:
        """Its fine-tuned checkpoint (the held-out split is evaluated on it)."""
        return str(self.report["checkpoint"])

    def final(self, metric: str, companions: tuple[str, ...] = ()) -> TrialFinal:
        """Its figures, as the sweep's driver reads a finished trial's."""
        return TrialFinal.from_report(self.report, metric, companions)

    def to_dict(self) -> JsonObject:
        """Its file's JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> StoredBaseline:
        """The inverse of :meth:`to_dict`."""
        return cls(str(data["policy"]), str(data["digest"]), str(data["sweep"]), str(data["trial_id"]), data["report"])


def baseline_digest(plan: SweepPlan, policy: str) -> str:
    """What a fine-tuned baseline's figures depend on, as a short digest: the reference
    it starts from, its training config (storage and tracking keys aside: they name
    where it is kept, not what it learns) and the settings it is evaluated with."""
    config = plan.trial_config({BASELINE_KEY: policy}, "baseline")
    flat = {k: v for k, v in config.flat(redact=True).items() if not k.startswith(("storage.", "tracking."))}
    space = plan.space
    what = {
        "reference": plan.reference,
        "config": flat,
        "metric": space.quality_metric,
        "companions": list(space.companion_metrics),
        "stage_two": dataclasses.asdict(space.stage_two),
        "baselines": {k: v for k, v in dataclasses.asdict(space.baselines).items() if k != "reuse"},
    }
    text = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _entry_uri(storage: str, policy: str, digest: str) -> str:
    return join_uri(storage, STORE_FOLDER, f"{policy}-{digest}.json")


def _stored(uri: str) -> StoredBaseline | None:
    """The entry at ``uri`` while it can be reused: readable, its checkpoint still there."""
    if not exists(uri):
        return None
    try:
        stored = StoredBaseline.from_dict(json.loads(read_bytes(uri)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("stored baseline %s is unreadable (%s): it is trained again", uri, exc)
        return None
    if not exists(stored.checkpoint):
        log.warning("stored baseline %s: its checkpoint %s is gone; it is trained again", uri, stored.checkpoint)
        return None
    return stored


def reusable_baselines(plan: SweepPlan, storage: str) -> dict[str, StoredBaseline]:
    """The stored baselines this sweep can reuse, by policy: the same digest, trained by
    another sweep, their checkpoint still there. None with ``baselines.reuse: false``."""
    if not plan.space.baselines.reuse:
        return {}
    found: dict[str, StoredBaseline] = {}
    for policy in fine_tuned_baselines(plan.space):
        stored = _stored(_entry_uri(storage, policy, baseline_digest(plan, policy)))
        # never this sweep's own (a resumed sweep keeps what it decided at its start)
        if stored is not None and stored.sweep != plan.name:
            found[policy] = stored
    return found


def settle_reused(plan: SweepPlan, storage: str, sweep_dir: str, *, resume: bool) -> dict[str, StoredBaseline]:
    """The baselines this sweep reuses: looked up when it starts and kept in its folder;
    read back from there when it resumes (none for a sweep started before reuse)."""
    uri = join_uri(sweep_dir, REUSED_FILE)
    if resume:
        if not exists(uri):
            return {}
        return {p: StoredBaseline.from_dict(d) for p, d in json.loads(read_bytes(uri)).items()}
    reused = reusable_baselines(plan, storage)
    write_bytes(uri, json.dumps({p: s.to_dict() for p, s in reused.items()}, indent=2, sort_keys=True).encode())
    return reused


def store_baselines(plan: SweepPlan, storage: str, trial_ids: dict[str, str]) -> list[str]:
    """Keep the baselines this sweep trained (``trial_ids``: policy -> its completed
    trial) for later sweeps, from each trial's final report. A stored one that can
    still be reused is never replaced; one whose checkpoint is gone (or that cannot be
    read) is. Returns the files written."""
    written = []
    for policy, trial_id in sorted(trial_ids.items()):
        digest = baseline_digest(plan, policy)
        uri = _entry_uri(storage, policy, digest)
        report_uri = join_uri(plan.run_uri(trial_id), TRIAL_RESULT_FILE)
        if _stored(uri) is not None or not exists(report_uri):
            continue
        report = json.loads(read_bytes(report_uri))
        stored = StoredBaseline(policy, digest, plan.name, trial_id, report)
        write_bytes(uri, json.dumps(stored.to_dict(), indent=2, sort_keys=True).encode())
        written.append(uri)
    return written
