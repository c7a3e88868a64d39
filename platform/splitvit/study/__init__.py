"""The evidence study: SPLIT against full resolution, all-coarse, entropy and random
splitting, trained alike and compared at matched token budgets, over several seeds.

One code path runs every study (:func:`~splitvit.study.execute.execute_study`): it
plans the runs (the backbones, one per seed, then the methods, one per seed and
method), reuses the runs an earlier invocation finished, evaluates every method at the
matched token ratios, aggregates over seeds, checks the goals, times the speed
comparison and records MLflow (a parent run with the table, the plot, the goals and the
speed figures; a child run per method and seed). Only where runs execute and how one
run is trained differ:

* on the platform (:func:`~splitvit.study.ray_executor.run_study`, ``splitvit study``),
  like a sweep: Ray Tune trials, each training a Ray Train ``TorchTrainer``; only the
  driver writes MLflow;
* on one machine without Ray (:func:`~splitvit.study.local.run_study_local`,
  ``infra/gpu-check/single_gpu_study.py``): in this process or a pool of processes
  sharing one device, each run trained by the plain single-process loop with the
  config's schedule; MLflow optional.

Re-running a study under the same name reuses every run that finished and resumes
unfinished training (from its checkpoints on Ray; a local run whose training finished
keeps it).

The modules, by what they do:

* :mod:`.spec` — the study file: :func:`~.spec.load_study`, :class:`~.spec.StudySpec`,
  :class:`~.spec.Goals`;
* :mod:`.runs` — running and reusing one run (:func:`~.runs.study_run`), the trainers,
  what a run stores (:class:`~.runs.BackboneRun`, :class:`~.runs.MethodRun`);
* :mod:`.goals` — where the figures and goal lines are computed: rows over seeds,
  goal verdicts, reference convergence, study time, the lever table;
* :mod:`.speed` — the speed step: the matched point and every method's points timed
  against full resolution;
* :mod:`.report` — the printed lines and the figures;
* :mod:`.records` — the study in MLflow;
* :mod:`.execute` — :func:`~.execute.execute_study` and its result;
* :mod:`.ray_executor`, :mod:`.local` — the two executors.

The study and the sweep (:mod:`splitvit.tune`) never import each other: what they
share lies below both, in :mod:`splitvit.bench.speed` (the timing of operating
points), :mod:`splitvit.train.trial` and :mod:`splitvit.train.console` (a run fitted
inside a Tune trial, and what a person sees meanwhile), :mod:`splitvit.tracking.runs`
(the MLflow tags both write) and :func:`splitvit.config.resolve_base_config`.
"""
