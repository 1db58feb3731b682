"""A helper container's output is capped by the engine and read from its end (issue 25, finding 7).

The env check runs the user's env code in a throw-away container (``Engine.run_capture``); code that prints
without end used to be kept whole by the engine and read whole into the launcher's memory. A real engine,
the small base image (``launcher-base:bookworm``, made by ``launcher build``); skipped without them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from launcher.engine import Engine
from launcher.engine.client import HELPER_LOG_TAIL_LINES

BASE = "launcher-base:bookworm"
WRITTEN = 40 * 2**20  # bytes the helper prints on stdout (and again on stderr)


def test_a_helper_that_prints_without_end_costs_at_most_its_log_cap(docker_client: Any, engine: Engine) -> None:
    try:
        docker_client.images.get(BASE)
    except Exception:  # noqa: BLE001 - docker.errors.ImageNotFound; the SDK's errors are not imported here
        pytest.skip(f"no {BASE} image on this engine (`launcher build` makes it)")
    # The noise first on both streams, then the last words (the env check's answer comes last, too).
    script = (f"head -c {WRITTEN} /dev/zero | tr '\\0' 'x' | fold -w 1000; "
              f"head -c {WRITTEN} /dev/zero | tr '\\0' 'y' | fold -w 1000 >&2; "
              "echo; echo the-answer; echo >&2; echo the-error >&2; exit 3")
    start = time.monotonic()
    code, out, err = engine.run_capture(BASE, ["/bin/sh", "-c", script], user="65534:65534",
                                        labels={"launcher.run": f"test-{uuid.uuid4().hex[:8]}"}, timeout_s=120)
    took = time.monotonic() - start
    assert code == 3
    assert out.rstrip().endswith("the-answer") and err.rstrip().endswith("the-error")  # the end is what is read
    assert len(out) <= 2 * 2**20 and len(err) <= 2 * 2**20, (len(out), len(err))  # not the 40 MiB printed
    assert out.count("\n") <= HELPER_LOG_TAIL_LINES + 1
    print("figures:", {"printed_bytes": WRITTEN, "read_stdout_bytes": len(out), "read_stderr_bytes": len(err),
                       "seconds": round(took, 1)})
