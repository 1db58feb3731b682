"""``python -m bench [all|tts|actors|acting|learning|update|transport|memory|launch|extras|report] [--quick]``

Runs the benchmarks, prints a table for each, writes ``bench/results/<name>.json`` and plots, and
regenerates ``docs/benchmarks.md`` from every result present. Each figure is a ratio against a
baseline measured in the same run of this script (these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT
from bench.peers import PEER_TIMEOUT_S

RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def _meta() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")))
    return {"commit": commit, "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 1024**2, 1),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def save(name: str, data: dict[str, Any], command: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"meta": _meta(), "command": command, **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")


def _load_result(name: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((RESULTS / f"{name}.json").read_text())
        return data
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("which", nargs="*", default=["all"],
                        choices=["all", "tts", "actors", "acting", "learning", "update", "transport", "memory",
                                 "launch", "start", "peers", "extras", "report"])
    parser.add_argument("--quick", action="store_true", help="fewer seeds and repetitions")
    parser.add_argument("--env", default="CartPole-v1", help="actors: the env (e.g. launcher/Snake-v0, ALE/Pong-v5)")
    parser.add_argument("--workers", default="1,2,4,8,16,32", help="actors: worker counts, comma-separated")
    parser.add_argument("--steps", type=int, default=None, help="actors: env steps per system run")
    parser.add_argument("--groups", type=int, default=None,
                        help="actors: worker groups per system run (default: the plan's; learning off, the cores "
                             "give the actors the whole machine)")
    parser.add_argument("--tasks", default="cartpole,acrobot,pendulum,invpend",
                        help="peers: tasks (cartpole, acrobot, pendulum, invpend), comma-separated")
    parser.add_argument("--peers", default="sb3,rllib", help="peers: which (sb3, rllib, sf), comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="peers: seeds per task (at least 3 for the table)")
    parser.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                        help="peers: seconds one peer run may take before it counts as not solved")
    args = parser.parse_args(argv)
    which = set(args.which)
    if "all" in which:
        which = {"transport", "actors", "acting", "learning", "update", "memory", "launch", "start", "tts"}
    cmd = "python -m bench " + " ".join(args.which) + (" --quick" if args.quick else "")
    if "peers" in which:
        cmd += f" --tasks {args.tasks} --peers {args.peers} --seeds {args.seeds}"
        if args.peer_timeout != PEER_TIMEOUT_S:
            cmd += f" --peer-timeout {args.peer_timeout:g}"
    if args.env != "CartPole-v1" or args.workers != "1,2,4,8,16,32" or args.steps or args.groups:
        cmd += f" --env {args.env} --workers {args.workers}" + (f" --steps {args.steps}" if args.steps else "")
        cmd += f" --groups {args.groups}" if args.groups else ""
    from bench import suites, transport

    if "transport" in which:
        rows = transport.run(reps=8 if args.quick else 15)
        save("transport", {"table": rows, "hashes": transport.hash_costs(reps=8 if args.quick else 15)}, cmd)
        _print("transport", rows, ("size", "raw_ms", "protocol_ms", "pipe_ms", "protocol_vs_raw", "protocol_vs_pipe"))
    if "actors" in which:
        counts = [int(w) for w in args.workers.split(",")]
        steps = args.steps or (40_000 if args.quick else 120_000)
        data = suites.actor_efficiency(counts, steps=steps, reps=3, env_id=args.env, groups=args.groups)
        save("actors" if args.env == "CartPole-v1" else f"actors-{args.env.replace('/', '_').lower()}", data, cmd)
        _print("actor efficiency", data["table"], ("workers", "system_env_steps_per_s", "single_process_env_steps_per_s", "ratio"))
    if "acting" in which:
        data = suites.acting_paths(8, steps=40_000 if args.quick else 100_000, reps=2 if args.quick else 3)
        save("acting", data, cmd)
        _print("acting path, 8 workers, learning off", data["table"], ("acting", "env_steps_per_s", "ratio_vs_numpy"))
    if "learning" in which:
        data = suites.learning_on(8, steps=60_000 if args.quick else 150_000, reps=3)
        save("learning", data, cmd)
        _print("learning on vs off, 8 workers", data["table"], ("variant", "env_steps_per_s", "ratio_vs_learning_off"))
    if "update" in which:
        data = suites.update_cost(reps=1 if args.quick else 3)
        save("update", data, cmd)
        _print("PPO update cost", data["table"], ("threads", "xla", "first_call_ms", "update_ms"))
    if "memory" in which:
        data = suites.memory(32)
        save("memory", data, cmd)
        _print("memory", [data], ("workers", "launcher_pss_mib", "classic_pss_mib", "ratio_pss", "launcher_rss_mib",
                                  "classic_rss_mib", "ratio_rss"))
    if "launch" in which:
        data = suites.launch_latency(32, reps=2 if args.quick else 3)
        save("launch", data, cmd)
        _print("launch latency", [data], ("workers", "backend", "median_s"))
    if "start" in which:
        data = suites.first_step(reps=3 if args.quick else 5)
        save("start", data, cmd)
        _print("first env step, 8 workers", data["table"], ("variant", "median_first_step_s", "median_first_segment_s",
                                                            "ratio_vs_tf_first"))
    if "extras" in which:  # not in "all": it needs the worker image on the Docker engine
        from bench.extras import extras_build

        data = extras_build(reps=2 if args.quick else 3)
        save("extras", data, cmd)
        _print(f"launcher build --with, {data['storage_driver']}", data["table"], ("path", "median_s",
                                                                                   "ratio_vs_docker_build"))
    if "peers" in which:
        from bench import peers

        data = peers.peers(args.tasks.split(","), args.peers.split(","), list(range(args.seeds)), args.peer_timeout)
        data = peers.merged(_load_result("peers"), data, {"meta": _meta(), "command": cmd})
        save("peers", data, cmd)
        for t in data["tasks"].values():
            _print(f"{t['env_id']} to {t['target']:g}", t["table"], ("contender", "solved", "median_wall_s",
                                                                   "median_env_steps", "ratio_vs_ours"))
    if "tts" in which:
        data = suites.time_to_solve([0, 1] if args.quick else [0, 1, 2])
        save("tts", data, cmd)
        _print("time to solve", data["table"], ("contender", "median_wall_s", "median_env_steps", "solved", "ratio_vs_baseline"))
    from bench.report import write_report

    write_report(RESULTS, DOC)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


def _print(title: str, rows: list[dict[str, Any]], cols: tuple[str, ...]) -> None:
    print(f"\n{title}")
    print("  " + "  ".join(f"{c:>24}" for c in cols))
    for r in rows:
        print("  " + "  ".join(f"{(f'{r[c]:.3f}' if isinstance(r[c], float) else str(r[c])):>24}" for c in cols))


if __name__ == "__main__":
    sys.exit(main())
