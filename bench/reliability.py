"""``python -m bench.reliability [--ci] [--seed N] [--out FILE]``: run the fault suite and print its figures.

Full counts by default (``FAULT_FULL=1``: 5 worker kills per backend, 8 master kills, 20 signal cycles,
6 docker signal cycles, 200 concurrency trials, 10,000 hostile frames), plus tests/unit/run/test_master_fuzz.py with
``FUZZ_FRAMES=10000``. ``--ci`` runs the CI counts instead. Every test appends what it measured to a JSON
lines file (``FAULT_REPORT``); this script prints that as the markdown table docs/reliability.md holds.
On 2 busy cores the full run takes about 25-35 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# section -> (what it is, the figures to show, in order)
ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "worker_kills_process": ("worker groups SIGKILLed during PPO to 475, process backend",
                             ("kills", "restarts", "group_left_events", "group_joined_events", "max_rejoin_s",
                              "env_steps_to_target", "mean_return", "checkpoints_restored", "wall_s")),
    "worker_kills_docker": ("worker containers SIGKILLed during PPO to 475, docker backend",
                            ("kills", "restarts", "group_left_events", "group_joined_events", "max_rejoin_s",
                             "env_steps_to_target", "mean_return", "checkpoints_restored", "wall_s")),
    "master_kills": ("master SIGKILLed (random moment / mid-checkpoint), torn checkpoint, --resume",
                     ("kills", "landed_mid_write", "torn_checkpoints", "resumes_ok", "max_updates_lost",
                      "checkpoint_every", "checkpoints_restored", "exit_detect_s_max")),
    "master_fuzz": ("hostile frames, tests/unit/run/test_master_fuzz.py", ("frames", "result")),
    "hostile_mix": ("hostile frames, extra kinds (nested JSON, dtypes, NaN/Inf, ...)",
                    ("frames", "pre_auth", "post_auth", "rejected", "seconds", "rss_growth_mib", "threads")),
    "slow_peers": ("slow peers at once (half a header / half a payload / silent)",
                   ("peers", "dropped", "worst_drop_s", "handshake_timeout_s", "real_handshake_meanwhile_s")),
    "stalled_authenticated_peer": ("authenticated peer stalling mid-frame", ("dropped_after_s", "heartbeat_timeout_s")),
    "connection_flood": ("connection flood past max_connections",
                         ("max_connections", "flood_s", "dialled", "refused_over_cap", "env_steps_during_flood",
                          "new_group_refused", "recovered_after_s")),
    "signals_process": ("SIGINT/SIGTERM to `up` at random moments, process backend",
                        ("cycles", "phases", "exits", "max_teardown_s", "leftovers")),
    "signals_docker": ("SIGINT/SIGTERM to two docker launchers at once",
                       ("cycles", "launchers", "phases", "exits", "max_teardown_s", "leftover_containers",
                        "leftover_networks")),
    "signal_during_build": ("SIGINT during an image build (throwaway tag)",
                            ("exit", "signal_to_exit_s", "build_finished_first", "containers_started_after_signal",
                             "leftovers")),
    "kill9_then_down_all": ("kill -9 of the launcher, then `down --all` (docker)",
                            ("containers_removed", "networks_removed", "down_s", "master_checkpointed", "leftovers")),
    "concurrency_prepare": ("simultaneous launchers (up.prepare) on a simulated 4-GPU machine",
                            ("trials", "launches", "overlaps", "shared_names", "two", "four", "trial_s_max")),
    "concurrency_real_up": ("real `launcher up` runs at once on the simulated 4-GPU machine",
                            ("launchers", "overlaps", "all_finished")),
    "bad_input_flag": ("every up option wrong, as a flag", ("cases", "exit_2", "results_untouched")),
    "bad_input_env": ("every up option wrong, as LAUNCHER_*", ("cases", "exit_2", "results_untouched")),
    "bad_input_file": ("every up option wrong, in launcher.toml", ("cases", "exit_2", "results_untouched")),
    "bad_input_other_flags": ("--detach, --set, --config, --resume, --results wrong", ("cases", "exit_2", "results_untouched")),
    "bad_input_filesystems": ("results on a full / read-only tmpfs", ("full_disk", "read_only", "results_untouched")),
    "bad_input_no_engine": ("DOCKER_HOST=unix:///nonexistent", ("exit", "results_untouched")),
    "bad_input_no_nvidia_runtime": ("GPU plan (stub) on an engine without the NVIDIA runtime", ("exit", "results_untouched")),
    "security_static": ("pickle/marshal/eval/exec in worker/, allow_pickle=True anywhere",
                        ("files_checked", "unsafe_calls", "allow_pickle_true")),
    "security_process": ("secret exposure, process backend",
                         ("secret_in_argv", "secret_in_results_or_logs", "master_listens", "secret_in_proc_environ")),
    "security_docker": ("containers and network, docker backend",
                        ("user", "cap_drop", "cap_add", "no_new_privileges", "privileged", "read_only_rootfs",
                         "published_ports", "network_internal", "secret_in_argv", "secret_in_results_or_logs",
                         "secret_in_docker_inspect_env", "host_to_published_127.0.0.1", "host_to_container_ip")),
}


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x}" for k, x in v.items())
    return str(v)


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table of docs/reliability.md from FAULT_REPORT records (the last record per section)."""
    last = {r["section"]: r for r in records}
    lines = ["| what | measured |", "|---|---|"]
    for section, (what, keys) in ROWS.items():
        r = last.get(section)
        if r is None:
            lines.append(f"| {what} | not run |")
            continue
        figures = "; ".join(f"{k} {_fmt(r[k])}" for k in keys if k in r)
        lines.append(f"| {what} | {figures.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="the CI counts instead of the full ones")
    ap.add_argument("--seed", type=int, default=None, help="FAULT_SEED: the random moments (default: random)")
    ap.add_argument("--out", default=None, help="keep the JSON lines here (default: a temporary file)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. -k signals")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkstemp(prefix="fault-report-", suffix=".jsonl")[1])
    out.write_text("")
    env = {**os.environ, "FAULT_REPORT": str(out)}
    if not args.ci:
        env["FAULT_FULL"] = "1"
    if args.seed is not None:
        env["FAULT_SEED"] = str(args.seed)
    t0 = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-m", "fault", "-q", "-s", "-p", "no:cacheprovider",
                            *args.pytest_args], cwd=ROOT, env=env)
    if not args.ci and not args.pytest_args:
        frames = 10_000
        fuzz = subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                "tests/unit/run/test_master_fuzz.py"], cwd=ROOT,
                               env={**env, "FUZZ_FRAMES": str(frames), "FUZZ_SECONDS": "1800"})
        with open(out, "a") as fh:
            fh.write(json.dumps({"section": "master_fuzz", "frames": frames,
                                 "result": "passed" if fuzz == 0 else f"failed ({fuzz})"}) + "\n")
        code = code or fuzz
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    print(f"\nfault suite ({'CI' if args.ci else 'full'} counts), {time.monotonic() - t0:.0f} s, exit {code}, "
          f"seed {records[0]['seed'] if records else '-'}; records in {out}\n")
    print(table(records))
    return code


if __name__ == "__main__":
    sys.exit(main())
