"""Stage one's proposals: the Optuna sampler ``search.sampler`` names (``auto``
resolved), seeded, behind Ray Tune's ``OptunaSearch`` with the two objectives (quality
up, tokens per image down), the config's own point evaluated first.
"""

from __future__ import annotations

import logging
from collections import Counter

from .space import NSGA2_DEFAULT_POPULATION, SearchSpace, first_points, resolve_sampler

log = logging.getLogger(__name__)


def startup_trials(num_samples: int) -> int:
    """Trials the GP (or TPE) sampler draws at random before it models the objectives.

    Optuna's default, 10, would leave a sweep of up to 10 trials pure random search;
    a third of the budget (at least 2, for a first model to fit; at most Optuna's 10)
    leaves most trials to the model. The points evaluated first (the config's own)
    are finished trials, so they count toward it."""
    return max(2, min(10, num_samples // 3))


def build_sampler(space: SearchSpace):
    """The Optuna sampler of stage one: :func:`~splitvit.tune.space.resolve_sampler`'s
    choice (``auto`` resolved), seeded by ``search.seed``."""
    import warnings

    import optuna

    s = space.search
    name = resolve_sampler(space)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=s.population_size or NSGA2_DEFAULT_POPULATION, seed=s.seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=s.seed, n_startup_trials=startup_trials(s.num_samples))
    with warnings.catch_warnings():  # multivariate TPE is "experimental" in Optuna, and Optuna's recommendation
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            multivariate=True, seed=s.seed, n_startup_trials=startup_trials(s.num_samples)
        )


def build_searcher(space: SearchSpace):
    from ray.tune.search.optuna import OptunaSearch

    name = resolve_sampler(space)
    if space.search.sampler == "auto":
        log.info("sampler auto: %s for %d trials over %s", name, space.search.num_samples, _parameter_kinds(space))
    points = [{k: space.parameters[k].encode(v) for k, v in p.items()} for p in first_points(space)]
    complete = [p for p in points if len(p) == len(space.parameters)]
    searcher = OptunaSearch(
        space=space.optuna_space(),
        metric=[space.quality_metric, "tokens_per_image"],
        mode=["max", "min"],
        sampler=build_sampler(space),
        points_to_evaluate=complete or None,
    )
    if len(complete) < len(points):
        # the config's own point without the values outside their range: Ray refuses a
        # partial point, Optuna takes one (the sampler fills in the rest), so it goes to
        # the study directly, as Ray does with its points_to_evaluate
        for point in points:
            if len(point) < len(space.parameters):
                searcher._ot_study.enqueue_trial(point)
    return searcher


def _parameter_kinds(space: SearchSpace) -> str:
    """``4 numeric parameters``, ``7 numeric and 1 categorical parameters``."""
    kinds = Counter("categorical" if p.distribution == "categorical" else "numeric" for p in space.parameters.values())
    return " and ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), reverse=True)) + " parameters"
