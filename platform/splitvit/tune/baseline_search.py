"""A Tune searcher that hands out the sweep's fine-tuned baselines first, then the
search's own points.

With a ``reference:``, the baselines (full resolution, entropy, random) fine-tune from
the reference like every searched trial, so they are trials of the same Tune run: they
share its concurrency slots, its resume and its records. They are not points of the
search, though: Optuna never hears of them, so its model of the objectives holds only
the settings it chose.
"""

from __future__ import annotations

from typing import Any

from ray.tune.search import Searcher

from .trial import BASELINE_KEY


class BaselinesFirst(Searcher):
    """``searcher`` (e.g. ``OptunaSearch``), after one trial per name in ``baselines``
    (config ``{BASELINE_KEY: name}``), whose results it never sees."""

    def __init__(self, searcher: Searcher, baselines: list[str]) -> None:
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher = searcher
        self.pending = list(baselines)
        self.baseline_trials: set[str] = set()

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        """Passed to the search's own searcher."""
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        """Passed on (Tune's ``ConcurrencyLimiter`` asks)."""
        return self.searcher.set_max_concurrency(max_concurrent)

    def suggest(self, trial_id: str) -> dict | None:
        """The next baseline, else the search's next point."""
        if self.pending:
            self.baseline_trials.add(trial_id)
            return {BASELINE_KEY: self.pending.pop(0)}
        return self.searcher.suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Intermediate results of searched trials only."""
        if trial_id not in self.baseline_trials:
            self.searcher.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Finished searched trials only: a baseline is never a point of the search."""
        if trial_id not in self.baseline_trials:
            self.searcher.on_trial_complete(trial_id, result=result, error=error)

    def get_state(self) -> dict:
        """Which baselines are still to hand out, and which trials were baselines. Tune
        saves a wrapper's state (this) apart from the search's own (``searcher``)."""
        return {"pending": list(self.pending), "baseline_trials": sorted(self.baseline_trials)}

    def set_state(self, state: dict) -> None:
        """Back to a saved state: a resumed sweep hands out no baseline twice."""
        self.pending = list(state["pending"])
        self.baseline_trials = set(state["baseline_trials"])
