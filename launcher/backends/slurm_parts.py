"""How a Slurm run's steps read back, as pure functions: a step's number in its job, the GPUs Slurm gave it (the
line :data:`launcher.backends.slurm_specs.PROLOGUE` prints first in its log) and the part it is in ``launcher
status``. :mod:`launcher.backends.slurm` (the running run) and :mod:`launcher.backends.slurm_run` (a run found
again) read Slurm and the logs; these turn what they read into parts.
"""

from __future__ import annotations

import re

from launcher.backends.base import Part, PartState

STEP_LINE = re.compile(r"launcher: step (\S+) on (\S+): SLURM_STEP_GPUS=(\S+)")  # PROLOGUE's first line


def step_gpus_printed(head: str) -> str | None:
    """The GPUs Slurm gave a step (``SLURM_STEP_GPUS``, ``""`` for none), from the line
    :data:`~launcher.backends.slurm_specs.PROLOGUE` printed at the head of its log; None while that line is not
    there."""
    m = STEP_LINE.search(head)
    if m is None:
        return None
    return "" if m.group(3) == "none" else m.group(3)


def step_part(name: str, *, started: bool, code: int | None, restarts: int, ident: str, node: str, lost: str,
              lost_now: bool, gpus: str) -> Part:
    """Part ``name`` of ``launcher status`` from its step: FAILED while its node is lost (``lost_now``: srun never
    notices), else what its srun says (``started``, exit ``code``). ``lost`` is the last lost-node text. Pure."""
    if lost_now and code is None:
        return Part(name, PartState.FAILED, None, restarts, ident, "lost", node=node, lost=lost)
    if not started:
        state, word = PartState.STARTING, "starting"
    elif code is None:
        state, word = PartState.RUNNING, "running"
    else:
        state, word = (PartState.EXITED if code == 0 else PartState.FAILED), f"exited {code}"
    return Part(name, state, code, restarts, ident, word, node=node, lost=lost, gpus=gpus)


def step_number(step_id: str) -> int:
    """The step's number in ``12.3`` (-1 for the batch step or none)."""
    tail = step_id.rpartition(".")[2]
    return int(tail) if tail.isdigit() else -1
