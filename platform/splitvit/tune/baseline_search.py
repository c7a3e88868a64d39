"""A Tune searcher that hands out the search's own points first, then the sweep's
fine-tuned baselines.

With a ``reference:``, the baselines (full resolution, entropy, random) fine-tune from
the reference like every searched trial, so they are trials of the same Tune run: they
share its concurrency slots, its resume and its records. They are not points of the
search, though: Optuna never hears of them, so its model of the objectives holds only
the settings it chose. They come last because the search is what a sweep is run for:
its trials finish as early as in a sweep that reuses its baselines from an earlier one,
and the baselines (a third of a CPU sweep's epochs) do not hold them back.
"""

from __future__ import annotations

from typing import Any

from ray.tune.search import Searcher

from .trial import BASELINE_KEY


class BaselinesLast(Searcher):
    """``searcher`` (e.g. ``OptunaSearch``) for ``searched`` trials, then one trial per
    name in ``baselines`` (config ``{BASELINE_KEY: name}``), whose results the search
    never sees."""

    def __init__(self, searcher: Searcher, baselines: list[str], searched: int) -> None:
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher = searcher
        # None: a sweep started before the baselines moved last, resumed (its baselines
        # came first and its search runs until Tune's trial count)
        self.searched_left: int | None = searched
        self.pending = list(baselines)
        self.baseline_trials: set[str] = set()

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        """Passed to the search's own searcher."""
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        """Passed on (Tune's ``ConcurrencyLimiter`` asks)."""
        return self.searcher.set_max_concurrency(max_concurrent)

    def suggest(self, trial_id: str) -> dict | None:
        """The search's next point while it has trials left, then the next baseline."""
        if self.searched_left is None:  # the order before, kept for a sweep resumed
            if self.pending:
                self.baseline_trials.add(trial_id)
                return {BASELINE_KEY: self.pending.pop(0)}
            return self.searcher.suggest(trial_id)
        if self.searched_left > 0:
            suggestion = self.searcher.suggest(trial_id)
            if isinstance(suggestion, dict):  # not None (no point yet) nor Searcher.FINISHED
                self.searched_left -= 1
            return suggestion
        if self.pending:
            self.baseline_trials.add(trial_id)
            return {BASELINE_KEY: self.pending.pop(0)}
        return Searcher.FINISHED

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Intermediate results of searched trials only."""
        if trial_id not in self.baseline_trials:
            self.searcher.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Finished searched trials only: a baseline is never a point of the search."""
        if trial_id not in self.baseline_trials:
            self.searcher.on_trial_complete(trial_id, result=result, error=error)

    def get_state(self) -> dict:
        """How many searched trials and which baselines are still to hand out, and which
        trials were baselines. Tune saves a wrapper's state (this) apart from the
        search's own (``searcher``)."""
        return {
            "searched_left": self.searched_left,
            "pending": list(self.pending),
            "baseline_trials": sorted(self.baseline_trials),
        }

    def set_state(self, state: dict) -> None:
        """Back to a saved state: a resumed sweep hands out no trial twice. A state
        without ``searched_left`` was saved by ``BaselinesFirst``, before the baselines
        moved last: its order is kept."""
        self.searched_left = None if state.get("searched_left") is None else int(state["searched_left"])
        self.pending = list(state["pending"])
        self.baseline_trials = set(state["baseline_trials"])


# the class's name before the baselines moved last: Tune unpickles a sweep started then
# by this name when it resumes, and ``set_state`` keeps that sweep's order
BaselinesFirst = BaselinesLast
