"""Benchmarks that print ratios measured side by side in one run.

* :mod:`.forward`: ``splitvit bench forward``: SPLIT against the full-resolution ViT
  (speed, where the time goes, memory);
* :mod:`.training`: ``splitvit bench train``: SPLIT's training step and Ray Train's
  overhead;
* :mod:`.timing`: the timer both use (interleaved rounds, medians, the load of other
  processes, the machine), also the sweeps' and studies' (:mod:`splitvit.bench.speed`);
* :mod:`.records`: records that need no torch (the machine a benchmark ran on);
* :mod:`.memory`: peak forward memory per model (RSS in a fresh subprocess, the torch
  profiler, CUDA);
* :mod:`.report`: targets judged on measured ratios, and the reports' tables.
"""
