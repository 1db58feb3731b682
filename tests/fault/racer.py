"""One launcher of the fault suite's concurrency test (tests/fault/test_concurrency.py), in its own interpreter."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """One launcher of the concurrency test: ``python -m tests.fault.racer RESULTS_ROOT WORKERS``.

    Prints ``ready``; then for each ``go`` line on stdin runs ``launcher.up.prepare`` (what ``launcher up``
    does before it starts a backend: validate, select GPUs, plan, reserve, create the results directory),
    prints what it got as JSON, and holds its reservation until the next line (``release``). EOF ends it.
    """
    from contextlib import ExitStack

    from launcher.backends.docker import group_name, master_name, network_name
    from launcher.config import RunConfig
    from launcher.errors import LauncherError
    from launcher.up import prepare

    root, workers = Path(argv[0]), int(argv[1])
    cfg = RunConfig(workers=workers, backend="process", results=root, max_steps=1000, gpus="auto")
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            continue
        with ExitStack() as stack:
            try:
                run = prepare(cfg, stack).run
            except LauncherError as exc:
                print(json.dumps({"error": exc.message, "code": int(exc.exit_code)}), flush=True)
            else:
                print(json.dumps({
                    "run_id": run.run_id, "results": str(run.results_dir.resolve()), "gpus": list(run.plan.gpu_uuids),
                    "network": network_name(run.run_id),
                    "containers": [master_name(run.run_id)] + [group_name(run.run_id, g.index) for g in run.plan.groups],
                    "pid": os.getpid()}), flush=True)
            sys.stdin.readline()  # hold the reservation until told to release
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
