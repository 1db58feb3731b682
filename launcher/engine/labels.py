"""The ``launcher.*`` labels every container, service, network, secret and volume of a run carries.

Defined once: the backends write them, ``status``/``logs``/``down`` and the GPU reservations read them
(similar to ``docker ps --filter label=launcher.run=RUN``).
"""

from __future__ import annotations

from collections.abc import Mapping

RUN_LABEL = "launcher.run"  # the run id
ROLE_LABEL = "launcher.role"  # master, group, network, secret, results, copy
GROUP_LABEL = "launcher.group"  # the worker group's index ("" for anything else)
GPUS_LABEL = "launcher.gpus"  # comma-separated GPU UUIDs the part was given ("" on a swarm: the engine picks)
RESULTS_LABEL = "launcher.results"  # the run's results directory on the launcher's host
USER_LABEL = "launcher.user"  # uid of the user the run belongs to (``down --all`` takes only one's own)


def label_filters(labels: Mapping[str, str | None]) -> list[str]:
    """``labels`` as the engine's ``label`` filter: ``key=value``, or ``key`` alone for a None value (any)."""
    return [k if v is None else f"{k}={v}" for k, v in labels.items()]


def part_name(labels: Mapping[str, str]) -> str:
    """``master`` or ``group-N``: the part of a run a labelled container or service is."""
    if labels.get(ROLE_LABEL) == "master":
        return "master"
    return f"group-{labels.get(GROUP_LABEL) or '?'}"
