"""How a Slurm run's steps read back, as pure functions: a step's number in its job, the GPUs Slurm gave it (the
line :data:`launcher.backends.slurm_specs.PROLOGUE` prints first in its log) and the part it is in ``launcher
status``. :mod:`launcher.backends.slurm` (the running run) and :mod:`launcher.backends.slurm_run` (a run found
again) read Slurm and the logs; these turn what they read into parts.
"""

from __future__ import annotations

import re

from launcher.backends.base import Part, PartState
from worker.contract import parse_addr

STEP_LINE = re.compile(r"launcher: step (\S+) on (\S+): SLURM_STEP_GPUS=(\S+)")  # PROLOGUE's first line
ADDR_LINE = re.compile(rb"[0-9A-Za-z.:_-]{1,253}:[0-9]{1,5}\n?")  # what a master writes to master.addr
MAX_ADDR_BYTES = 512  # master.addr is one short line; the host reads no more of it


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


def master_port_written(data: bytes, host: str) -> int:
    """The port a master wrote to ``master.addr`` (``HOST:PORT``, one line, as
    :func:`worker.contract.format_addr` writes it), which must be on ``host``: the address the launcher told it
    to bind. The file is the run's, so untrusted: anything but one such line is refused. Pure.

    Raises:
        ValueError: saying what the file held instead.
    """
    if ADDR_LINE.fullmatch(data) is None:
        raise ValueError(f"it holds {data[:80]!r}, not one line HOST:PORT")
    addr = parse_addr(data.decode("ascii").strip())
    if not isinstance(addr, tuple) or addr[0] != host or not 0 < addr[1] < 65536:
        raise ValueError(f"it names {data.decode('ascii').strip()!r}, not a port on {host}, where the master was "
                         "told to listen")
    return addr[1]
