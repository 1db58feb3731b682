"""Learning algorithms. ``ppo`` (clipped PPO, the DPPO of the classic examples) and ``a3c``.

Each algorithm has a master side (a learner holding the Keras model and optimiser) and a group side
(what a worker group sends: trajectories for PPO, gradients for A3C). Hyper-parameters live in
:mod:`worker.algorithms.hparams` with per-env defaults that the run spec can override.
"""
