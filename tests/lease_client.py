"""Test helper: a launcher's GPU step, run as another user, driven line by line (tests/unit/gpu/test_gpu_users.py).

``python -m tests.lease_client RUN_PREFIX`` reads commands on stdin and answers one JSON line each:

* ``plan workers=N gpus=CHOICE [wait=SECONDS] [lock_dir=DIR]``: ``launcher.gpu.plan_and_reserve`` exactly as
  ``launcher up`` calls it (a GpuRequest built by ``launcher.config.gpu_request``), and keep the lease.
  Answers the GPUs the plan uses and its reasons, or the error and its exit code.
* ``release``: drop the lease. ``quit`` (or end of input): exit.

One process plays one launcher for many trials, so 200 trials do not pay 1,600 interpreter starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from launcher import gpu
from launcher.config import RunConfig, gpu_request
from launcher.errors import LauncherError


def main(argv: list[str]) -> int:
    prefix = argv[0] if argv else "client"
    held = None
    trial = 0
    print(json.dumps({"ready": True, "pid": os.getpid(), "uid": os.getuid()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "release":
            if held is not None:
                held.release()
                held = None
            print(json.dumps({"released": True}), flush=True)
            continue
        trial += 1
        opts = dict(w.split("=", 1) for w in words[1:])
        run_id = f"{prefix}-{trial}"
        try:
            cfg = RunConfig(workers=int(opts.get("workers", "1")), gpus=opts.get("gpus", "auto"), samples=1,
                            sample_interval_s=0.0, wait_s=float(opts["wait"]) if "wait" in opts else None,
                            lock_dir=Path(opts["lock_dir"]) if "lock_dir" in opts else None)
            outcome = gpu.plan_and_reserve(gpu_request(cfg), run_id=run_id, cpu_count=2)
        except LauncherError as exc:
            print(json.dumps({"run_id": run_id, "uuids": [], "error": exc.message, "code": int(exc.exit_code)}),
                  flush=True)
            continue
        held = outcome.reservation
        print(json.dumps({"run_id": run_id, "uuids": list(held.uuids) if held else [],
                          "plan": list(outcome.plan.gpu_uuids), "kind": outcome.plan.kind,
                          "reasons": list(outcome.plan.reasons)}), flush=True)
    if held is not None:
        held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
