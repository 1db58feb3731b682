"""The Slurm test bed: slurmctld and slurmd's in network namespaces of their own, with munge and fake GPUs as
GRES (:mod:`tests.slurmbed.bed`), its pytest fixture (:mod:`tests.slurmbed.fixtures`) and a command to bring one
up by hand (``scripts/slurmbed.sh``, :mod:`tests.slurmbed.__main__`)."""
