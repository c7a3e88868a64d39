"""Ray Train's failure policy with one rule more: a deterministic error is not retried.

Ray Train restarts the worker group after any worker error, up to
``train.max_failures`` times. An error marked deterministic
(:func:`splitvit.errors.is_deterministic`: a corrupt image read with ``strict=true``,
say) would fail every attempt the same way, each after the start-up and the epochs
before it (115 s for three attempts on the 2-core machine), so this policy raises it
on the first attempt; every other error keeps Ray's default decision.

The policy object is made in the driver and runs in Ray Train's controller actor,
which imports this module (as Train workers import the package).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

from ..errors import error_line, is_deterministic

log = logging.getLogger(__name__)


class NoRetryOnDeterministic(DefaultFailurePolicy):
    """:class:`DefaultFailurePolicy`, except that a worker group error whose root cause
    on any rank is deterministic is raised at once (the other ranks' errors are then
    mostly collateral: a collective that lost its peer)."""

    def make_decision(self, training_failed_error: Any) -> FailureDecision:
        failures = getattr(training_failed_error, "worker_failures", None)
        if isinstance(failures, dict):
            for rank in sorted(failures):
                if is_deterministic(failures[rank]):
                    log.info(
                        "[FailurePolicy] RAISE without retrying: rank %d's error would repeat: %s",
                        rank,
                        error_line(failures[rank]),
                    )
                    return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def use_policy(trainer: Any, failure_config: Any) -> None:
    """Make ``trainer`` (a Ray Train V2 ``DataParallelTrainer``) run its controller with
    :class:`NoRetryOnDeterministic` in place of the default policy. A trainer without
    the hook (another Ray version, a test's stand-in) keeps its own."""
    start = getattr(trainer, "_initialize_and_run_controller", None)
    if start is None:
        return

    def with_policy(**controller_init_kwargs: Any) -> Any:
        controller_init_kwargs["failure_policy"] = NoRetryOnDeterministic(failure_config)
        return start(**controller_init_kwargs)

    trainer._initialize_and_run_controller = with_policy
