"""Ray for tests: one local Ray instance shared by the whole session.

``ray_session`` (session scope) starts it on first use and shuts it down at the
end; ``ray_local`` (function scope) hands it to a test, starting it again if a
test that needed a cluster of its own (``ray.cluster_utils.Cluster``) shut it
down. ``mlflow_uri`` is one embedded SQLite tracking store the training tests
share (creating one runs MLflow's migrations, which takes seconds).
"""

from __future__ import annotations

import os

import pytest

RAY_CPUS = 4  # two 2-worker fits' worth; logical CPUs, the machine may have fewer


class RaySession:
    """Starts the shared local Ray instance and restarts it when needed."""

    def __init__(self) -> None:
        self.starts = 0

    def ensure(self) -> None:
        import ray

        if not ray.is_initialized():
            # "local": a fresh instance of the tests' own, never a `ray start` cluster
            # that happens to run on the machine (ray.init()'s default joins that)
            # log_to_driver=False: Ray streams its processes' output (a raylet's
            # disk-space warning, say) into whichever test's captured stderr is open,
            # which broke a check of an error's first line in CI; it stays in the
            # session's log files under /tmp/ray
            # local_ray_start: loopback only, as the platform's own local Ray
            from splitvit.train.ray_trainer import local_ray_start

            with local_ray_start():
                ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
            self.starts += 1

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def ray_session(request):
    """The session's local Ray instance (started once, shut down at the end)."""
    # Ray's processes keep the environment they start with; the Train controller and
    # workers must see the session's S3 endpoint, so it comes up first when present.
    try:
        request.getfixturevalue("s3_endpoint")
    except pytest.FixtureLookupError:
        pass
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Ray Train's controller commits a report at its next poll of the workers (2 s by
    # default); tiny test epochs wait on that, so poll more often (the driver's value
    # is passed on to the controller)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Ray Train starts a PreemptionWatcher actor (a Python process of its own) per fit to
    # watch for cloud nodes being taken away; one machine's tests have none to lose, and
    # the suite's ~30 fits each save that process's start on the 2-core CI machine
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    session = RaySession()
    session.ensure()
    yield session
    session.shutdown()


@pytest.fixture
def ray_local(ray_session):
    """The shared Ray instance, (re)started if a previous test shut it down."""
    ray_session.ensure()
    return ray_session


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    """An embedded MLflow store (SQLite, local artifacts) shared by the session's tests."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from splitvit.tracking import ensure_experiment

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/mlflow.db"
    ensure_experiment(uri, "tests")  # runs the schema migrations once
    return uri
