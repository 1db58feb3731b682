"""The benchmarks of issue 6, each a ratio against a baseline measured in the same script."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, env, launcher, median, pss_rss_kib, read_json, run_up


def _baseline_solve(seed: int) -> tuple[float, int, bool]:
    """The single-process A2C, in its own interpreter (TF import counted, as for the launcher)."""
    code = ("import json,sys; from bench.a2c_baseline import solve_cartpole; r=solve_cartpole(int(sys.argv[1])); "
            "print(json.dumps(r.__dict__))")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, str(seed)], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=900)
    wall = time.perf_counter() - t0
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return wall, int(r["env_steps"]), bool(r["solved"])


def time_to_solve(seeds: list[int]) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {"a2c baseline (1 process)": [], "launcher ppo, 8 workers": [],
                                             "launcher a3c, 8 workers": []}
    for seed in seeds:  # interleaved, so drifting machine load hits every contender alike
        wall, steps, ok = _baseline_solve(seed)
        rows["a2c baseline (1 process)"].append({"seed": seed, "wall_s": wall, "env_steps": steps, "solved": ok})
        for algo in ("ppo", "a3c"):
            with tempfile.TemporaryDirectory() as tmp:
                wall, code, doc = run_up(Path(tmp), "--backend", "process", "--workers", "8", "--env", "CartPole-v1",
                                         "--algo", algo, "--until-return", "475", "--seed", str(seed),
                                         "--max-steps", "2000000")
            s = doc.get("summary", {})
            rows[f"launcher {algo}, 8 workers"].append({"seed": seed, "wall_s": wall, "env_steps": s.get("env_steps"),
                                                        "solved": code == 0})
    base = median([r["wall_s"] for r in rows["a2c baseline (1 process)"]])
    table = []
    for name, rs in rows.items():
        med = median([r["wall_s"] for r in rs])
        table.append({"contender": name, "median_wall_s": med, "median_env_steps": median([r["env_steps"] or 0 for r in rs]),
                      "solved": f"{sum(r['solved'] for r in rs)}/{len(rs)}", "ratio_vs_baseline": med / base,
                      "runs": rs})
    return {"table": table, "seeds": seeds}


def _single_process_rate(workers: int, steps: int) -> float:
    """Env steps/s of one process stepping ``workers`` CartPole envs with the numpy policy; no transport, no learning."""
    code = f"""
import time, numpy as np
from worker.envs import make_env
from worker.models import Architecture, NumpyPolicy, expected_shapes
from worker.algorithms.rollout import Collector
envs = [make_env("CartPole-v1", seed=i) for i in range({workers})]
arch = Architecture.for_spaces(envs[0].observation_space, envs[0].action_space)
pol = NumpyPolicy(arch)
rng = np.random.default_rng(0)
pol.set_weights({{k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in expected_shapes(arch).items()}}, 0)
col = Collector(envs, pol, gamma=0.99, lam=0.95, seed=0)
n = max(1, {steps} // (64 * {workers}))
col.collect(64)
t = time.perf_counter()
for _ in range(n):
    col.collect(64)
print(n * 64 * {workers} / (time.perf_counter() - t))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    return float(p.stdout.strip().splitlines()[-1])


def _system_rate(results: Path, workers: int, steps: int) -> float:
    # epochs=0: the master re-broadcasts the weights without training, so this measures acting, transport
    # and the round barrier alone (learning-bound speed is what time-to-solve measures).
    wall, code, doc = run_up(results, "--backend", "process", "--workers", str(workers), "--env", "CartPole-v1",
                             "--algo", "ppo", "--max-steps", str(steps), "--set", "epochs=0")
    run = results / doc["run_id"]
    prog = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    prog = [r for r in prog if r.get("type") == "progress" and r["env_steps"] > 0]
    first, last = prog[0], prog[-1]
    return (last["env_steps"] - first["env_steps"]) / max(last["wall_s"] - first["wall_s"], 1e-6)


def actor_efficiency(worker_counts: list[int], steps: int) -> dict[str, Any]:
    table = []
    for w in worker_counts:
        with tempfile.TemporaryDirectory() as tmp:
            system = _system_rate(Path(tmp), w, steps)
        single = _single_process_rate(w, steps // 2)
        table.append({"workers": w, "system_env_steps_per_s": system, "single_process_env_steps_per_s": single,
                      "ratio": system / single})
    return {"table": table, "steps": steps}


def memory(workers: int = 32) -> dict[str, Any]:
    """PSS/RSS of a launcher run with ``workers`` workers vs ``workers`` processes each importing TF
    and building the model (the classic layout)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(launcher("up", "--backend", "process", "--workers", str(workers), "--results", tmp,
                                         "--max-steps", "100000000"), cwd=ROOT, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 180
            run = None
            while time.time() < deadline:
                runs = [p for p in Path(tmp).iterdir() if (p / "status.json").exists()]
                if runs:
                    run = runs[0]
                    st = read_json(run / "status.json") or {}
                    if st.get("updates", 0) >= 5:
                        break
                time.sleep(0.5)
            time.sleep(3)
            pids = list((read_json(run / "run.json") or {}).get("pids", {}).values())
            ours = [pss_rss_kib(p) for p in pids]
            groups = len(pids) - 1
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    classic_code = ("import os, time, sys; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; import tensorflow as tf; "
                    "from worker.models import Architecture, build_keras_model; "
                    "m = build_keras_model(Architecture('mlp', (4,), False, 2)); m(tf.zeros((1, 4))); "
                    "print('ready', flush=True); time.sleep(600)")
    procs = []
    try:
        for _ in range(workers):
            procs.append(subprocess.Popen([sys.executable, "-c", classic_code], cwd=ROOT, env=env(),
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for p in procs:
            p.stdout.readline()
        time.sleep(2)
        classic = [pss_rss_kib(p.pid) for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    ours_pss, ours_rss = sum(x[0] for x in ours), sum(x[1] for x in ours)
    cl_pss, cl_rss = sum(x[0] for x in classic), sum(x[1] for x in classic)
    return {"workers": workers, "launcher_processes": len(ours), "launcher_groups": groups,
            "launcher_pss_mib": ours_pss / 1024, "launcher_rss_mib": ours_rss / 1024,
            "classic_processes": len(classic), "classic_pss_mib": cl_pss / 1024, "classic_rss_mib": cl_rss / 1024,
            "ratio_pss": ours_pss / cl_pss, "ratio_rss": ours_rss / cl_rss}


def launch_latency(workers: int = 32, reps: int = 3) -> dict[str, Any]:
    """Seconds from starting ``launcher up`` to all ``workers`` workers connected (process backend)."""
    times = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            proc = subprocess.Popen(launcher("up", "--backend", "process", "--workers", str(workers), "--results", tmp,
                                             "--max-steps", "100000000"), cwd=ROOT, env=env(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                latency = None
                while time.perf_counter() - t0 < 180:
                    runs = list(Path(tmp).iterdir())
                    st = read_json(runs[0] / "status.json") if runs else None
                    if st:
                        connected = sum(g["workers"] for g in st["groups"].values() if g["connected"])
                        if connected >= workers:
                            latency = time.perf_counter() - t0
                            break
                    time.sleep(0.05)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            times.append(latency)
    return {"workers": workers, "backend": "process", "seconds": times,
            "median_s": median([t for t in times if t is not None]) if any(times) else None}

