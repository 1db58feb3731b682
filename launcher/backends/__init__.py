"""Backends turn a prepared run (spec + plan + secret) into running things: local processes
(:mod:`launcher.backends.process`), Docker containers (:mod:`launcher.backends.docker`), Swarm services
(:mod:`launcher.backends.swarm`), or the steps of a Slurm job (:mod:`launcher.backends.slurm`). They share one
interface, :class:`launcher.backends.base.Backend`: the supervisor (:mod:`launcher.supervisor`) drives any of
them the same way, and ``status``/``logs``/``down`` (:mod:`launcher.lifecycle`) reach a run through the
:class:`~launcher.backends.base.FoundRun` its backend gives.

This module is the one table of backends by name (``run.json`` records the name); ``--backend``'s choices
(:data:`launcher.config.BACKENDS`) are derived from it, and so are the ``launcher up`` options only one backend
reads: each backend declares its own in a light options module the table names (``docker_options``,
``swarm_options``, ``slurm_options``; :func:`backend_options`), and :mod:`launcher.config.options` adds them
to the options every run has. It imports nothing of the backends at load (the config package reads the table,
and the backends' base reads the config); the options modules import only :class:`launcher.option.Option`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from launcher.errors import BadInput

if TYPE_CHECKING:
    from launcher.backends.base import Backend, FoundRun
    from launcher.option import Option
    from launcher.runs import RunDir


class Entry(NamedTuple):
    """One backend: its class (imported on first use: the Docker SDK stays out of `launcher --help`) and the
    light module whose ``OPTIONS`` are the ``launcher up`` options only it reads (None: it has none)."""

    module: str
    cls: str
    options: str | None = None


BACKENDS: dict[str, Entry] = {
    "process": Entry("launcher.backends.process", "ProcessBackend"),
    "docker": Entry("launcher.backends.docker", "DockerBackend", "launcher.backends.docker_options"),
    "swarm": Entry("launcher.backends.swarm", "SwarmBackend", "launcher.backends.swarm_options"),
    "slurm": Entry("launcher.backends.slurm", "SlurmBackend", "launcher.backends.slurm_options"),
}
# What `--backend auto` can pick (launcher.up.choose_backend): Docker when an engine answers, else processes.
# An option only other backends declare cannot apply to an auto run (launcher.config.checks.backend_mismatch).
AUTO_PICKS = ("docker", "process")
# Who to ask about a run known only by its labels: services first (a swarm run's task containers carry the
# same labels as a Docker run's containers).
_BY_LABEL = ("swarm", "docker")
LABEL_BACKENDS = frozenset(_BY_LABEL)


def backend_class(name: str) -> type[Backend]:
    """The backend class called ``name``.

    Raises:
        BadInput: no such backend.
    """
    if name not in BACKENDS:
        raise BadInput(f"unknown backend {name!r}", hint=f"choose auto, {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name][:2]
    found: type[Backend] = getattr(importlib.import_module(module), cls)
    return found


def backend_options() -> dict[str, tuple[Option, ...]]:
    """Each backend's own ``launcher up`` options, by backend name in the table's order (an option two backends
    read, such as ``--image``, is in both). Imports only the light options modules."""
    out: dict[str, tuple[Option, ...]] = {}
    for name, entry in BACKENDS.items():
        module = entry[2] if len(entry) > 2 else None  # a bare (module, class) pair declares none
        out[name] = tuple(importlib.import_module(module).OPTIONS) if module else ()
    return out


def find(run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> FoundRun:
    """The run as the backend its record names left it; with no results directory, whichever backend's
    labels name it (None of them: a FoundRun with no parts)."""
    from launcher.backends.base import NoParts

    name = record.get("backend")
    if isinstance(name, str) and name in BACKENDS:
        return backend_class(name).find(run_id, run_dir, record)
    if run_dir is None:
        return find_by_label(run_id) or NoParts(run_id, None, record)
    return NoParts(run_id, run_dir, record)


def find_by_label(run_id: str) -> FoundRun | None:
    """A run whose containers, networks or services carry its label, with its results directory when the
    labels name one on this host; None when no backend knows it."""
    for name in _BY_LABEL:
        found = backend_class(name).find(run_id, None, {})
        if found.exists():
            found.run_dir = found.results_from_labels()
            if found.run_dir is not None:
                found.record = found.run_dir.read_record()
            return found
        found.close()
    return None


def labelled(run_id: str, run_dir: RunDir | None) -> FoundRun | None:
    """The run's containers or services as the engine's labels give them, whatever any record says (``down``
    of a run whose record names another backend); None when the engine has nothing of it or is not reachable."""
    for name in _BY_LABEL:
        try:
            found = backend_class(name).find(run_id, run_dir, {})
        except ImportError:  # no Docker SDK here: no engine's labels to ask
            return None
        if found.exists():
            return found
        found.close()
    return None


def live_run_ids(root: Path, *, user: str | None) -> set[str]:
    """Runs that may still have live parts: under ``root`` (processes) and on the engine (labels)."""
    out: set[str] = set()
    for name in BACKENDS:
        out |= backend_class(name).live_run_ids(root, user=user)
    return out
