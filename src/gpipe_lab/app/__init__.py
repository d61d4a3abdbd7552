"""The ``gpipe-train`` app: the Hydra run (``train``) and what surrounds it (its config checks in
``config``, its console, continuation, sweeps, evaluation, export and the run's provenance).

The app is the only part of ``gpipe_lab`` that imports Hydra; it builds on ``gpipe_lab.lightning``,
which builds on the engine (``gpipe_lab.pipeline``).
"""
