"""Issue 23, items 2 and 4 and its small items: what the backends say is what they do.

* the parts of a process run come in the one order (``base.name_order``): ``group-2`` before ``group-10``;
* the swarm backend's labels come from :mod:`launcher.engine.labels`.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from launcher.backends import swarm
from launcher.backends.process import ProcessRun
from launcher.runs import RunDir


def test_process_run_parts_are_in_part_order(tmp_path: Path) -> None:
    run_dir = tmp_path / "r1"
    run_dir.mkdir(mode=0o755)
    pid = os.getpid()  # any pid: the order is what is tested, not whether it belongs to the run
    record = {"pids": {"group-10": pid, "group-2": pid, "master": pid, "group-1": pid}}
    names = [p.name for p in ProcessRun("r1", RunDir("r1", run_dir), record).parts()]
    assert names == ["master", "group-1", "group-2", "group-10"]


def test_swarm_writes_no_label_literal() -> None:
    assert '"launcher.' not in inspect.getsource(swarm)
