"""The Slurm backend's own ``launcher up`` options (read by :mod:`launcher.backends.slurm`): the job's partition,
nodes and extra sbatch options, where each step runs, and the image a docker step runs. Light (see
:mod:`launcher.backends.docker_options`)."""

from __future__ import annotations

from launcher.backends.docker_options import IMAGE
from launcher.option import Option

SLURM_RUNTIMES = ("auto", "docker", "process")  # --slurm-runtime (launcher.backends.slurm_specs.task_command)

OPTIONS: tuple[Option, ...] = (
    IMAGE,
    Option("slurm-partition", "slurm_partition", "str", "slurm backend: the partition to submit to (default: the "
           "cluster's default partition)", nullable=True, metavar="NAME"),
    Option("slurm-nodes", "slurm_nodes", "int", "slurm backend: nodes of the run's job ('none': one per group, as "
           "many as the partition has usable)", nullable=True, metavar="N"),
    Option("slurm-runtime", "slurm_runtime", "choice", "slurm backend: where each step runs on its node; docker: "
           "the run's image on the node's Docker engine; process: python -m worker from the shared venv; auto: "
           "docker where the node's engine answers, else process", choices=SLURM_RUNTIMES),
    Option("slurm-arg", "slurm_args", "list", "slurm backend: one more sbatch option for the run's job, e.g. "
           "--slurm-arg=--account=lab --slurm-arg=--qos=normal (repeatable)", metavar="OPTION"),
)
