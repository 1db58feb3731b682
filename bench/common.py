"""Shared helpers for the benchmarks: run the real CLI, read results, measure memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LAUNCHER_")}
    e.update({"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0", "PYTHONPATH": str(ROOT)})
    return e


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def run_up(results: Path, *args: str, timeout: float = 600,
           extra_env: dict[str, str] | None = None) -> tuple[float, int, dict[str, Any]]:
    """Run ``launcher up --json`` to the end. Returns (wall seconds, exit code, result document)."""
    t0 = time.perf_counter()
    p = subprocess.run(launcher("up", "--results", str(results), "--json", *args), cwd=ROOT,
                       env={**env(), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        doc = {"stderr": p.stderr[-2000:]}
    return wall, p.returncode, doc


def pss_rss_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of a process in KiB from /proc/<pid>/smaps_rollup."""
    pss = rss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            pss = int(line.split()[1])
        elif line.startswith("Rss:"):
            rss = int(line.split()[1])
    return pss, rss


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
