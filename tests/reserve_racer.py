"""Test helper: one "launcher" racing another for GPU reservations (see test_reservations.py).

Usage: python tests/reserve_racer.py LOCK_DIR RUN_ID COUNT UUID,UUID,...
Prints "ready"; then for each "go" line on stdin (the start signal, sent to both racers at once) reserves
COUNT of the UUIDs with launcher.gpu.reservations.reserve and prints the result as JSON, holding the GPUs
until a "release" line (answered "released"), so the test decides when both reservations have been held
at the same time. One process races many rounds: the race is the reserve calls, not interpreter starts.
"""

from __future__ import annotations

import json
import sys

from launcher.errors import NoResources
from launcher.gpu.reservations import reserve


def main(argv: list[str]) -> int:
    lock_dir, run_id, count, uuids = argv[0], argv[1], int(argv[2]), argv[3].split(",")
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "go":
            break
        try:
            reservation = reserve(uuids, f"{run_id}-{n}", lock_dir, count=count)
        except NoResources as exc:
            print(json.dumps({"run_id": run_id, "uuids": [], "error": exc.message}), flush=True)
            reservation = None
        else:
            print(json.dumps({"run_id": run_id, "uuids": list(reservation.uuids)}), flush=True)
        if sys.stdin.readline().strip() != "release":
            break
        if reservation is not None:
            reservation.release()
        print("released", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
