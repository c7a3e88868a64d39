"""Training: one SPLIT run, on Ray Train or in one process, and what reads it back.

* :mod:`.experiment`: :func:`~.experiment.load_experiment`, the one way to a runnable
  config (the checks that need timm, the model or the datasets), and ``build_model``;
* :mod:`.steps` and :mod:`.losses`: the SPLIT step (warm-up, policy phase),
  evaluation, threshold calibration; the task loss, budget penalty and teachers;
* :mod:`.ray_trainer`: ``run_training`` and the Ray Train (DDP) worker loop;
  :mod:`.local`: ``fit_local``, the same step in one process;
* :mod:`.trial`: ``fit_trial``, one experiment fitted inside a Ray Tune trial (a sweep's
  or a study's), and ``run_evaluation`` where it trained; :mod:`.console`: what a
  person sees while Tune runs trials (Ray's console quiet unless ``-v``, a bar);
* :mod:`.checkpoints` and :mod:`.evaluation`: a checkpoint folder and a model
  evaluated from it; :mod:`.demo`: the demo recipe.

Nothing is imported here: ``splitvit.train.<module>`` names what a caller needs.
"""
