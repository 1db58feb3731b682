"""Test helper: one "launcher" process racing another for GPU reservations (see test_reservations.py).

Usage: python tests/reserve_racer.py LOCK_DIR RUN_ID COUNT UUID,UUID,...
Prints "ready", waits for a line on stdin (the start signal, sent to both racers at once), reserves COUNT
of the UUIDs with launcher.reservations.reserve, prints the result as JSON, and holds the GPUs until
stdin closes, so the test decides when both reservations have been held at the same time.
"""

from __future__ import annotations

import json
import sys

from launcher.errors import NoResources
from launcher.reservations import reserve


def main(argv: list[str]) -> int:
    lock_dir, run_id, count, uuids = argv[0], argv[1], int(argv[2]), argv[3].split(",")
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        reservation = reserve(uuids, run_id, lock_dir, count=count)
    except NoResources as exc:
        print(json.dumps({"run_id": run_id, "uuids": [], "error": exc.message}), flush=True)
        sys.stdin.read()
        return 5
    with reservation:
        print(json.dumps({"run_id": run_id, "uuids": list(reservation.uuids)}), flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
