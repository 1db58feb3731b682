"""Slurm, as the launcher reads and drives it.

* :mod:`~launcher.slurm.model`: the cluster, jobs and steps as typed data parsed from ``scontrol -o`` (pure);
* :mod:`~launcher.slurm.commands`: the only module that runs Slurm's commands (with deadlines, errors that
  say what to do).

The backend that turns a plan into a job and its steps is :mod:`launcher.backends.slurm`.
"""
