"""The benchmarks of issues 6 and 17, each a ratio against a baseline measured in the same script."""

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
    contenders = {"launcher ppo, 8 workers": ("--algo", "ppo"),
                  "launcher ppo, 8 workers, TensorFlow first": ("--algo", "ppo"),
                  "launcher ppo, 8 workers, XLA (jit_compile=true)": ("--algo", "ppo", "--set", "jit_compile=true"),
                  "launcher ppo, 8 workers, sync=true": ("--algo", "ppo", "--set", "sync=true"),
                  "launcher a3c, 8 workers": ("--algo", "a3c")}
    rows: dict[str, list[dict[str, Any]]] = {"a2c baseline (1 process)": [], **{name: [] for name in contenders}}
    for seed in seeds:  # interleaved, so drifting machine load hits every contender alike
        wall, steps, ok = _baseline_solve(seed)
        rows["a2c baseline (1 process)"].append({"seed": seed, "wall_s": wall, "env_steps": steps, "solved": ok})
        for name, args in contenders.items():
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                wall, code, doc = run_up(Path(tmp), "--backend", "process", "--workers", "8", "--env", "CartPole-v1",
                                         *args, "--until-return", "475", "--seed", str(seed), "--max-steps", "2000000",
                                         extra_env=TF_FIRST if name.endswith("TensorFlow first") else None)
                first = _first_segment_at(Path(tmp) / str(doc.get("run_id")))
            s = doc.get("summary", {})
            rows[name].append({"seed": seed, "wall_s": wall, "env_steps": s.get("env_steps"), "solved": code == 0,
                               "start_s": None if first is None else first - t0})
    base = median([r["wall_s"] for r in rows["a2c baseline (1 process)"]])
    table = []
    for name, rs in rows.items():
        med = median([r["wall_s"] for r in rs])
        starts = [r["start_s"] for r in rs if r.get("start_s") is not None]
        table.append({"contender": name, "median_wall_s": med, "median_env_steps": median([r["env_steps"] or 0 for r in rs]),
                      "median_start_s": median(starts) if starts else None,
                      "solved": f"{sum(r['solved'] for r in rs)}/{len(rs)}", "ratio_vs_baseline": med / base,
                      "runs": rs})
    return {"table": table, "seeds": seeds}


TF_FIRST = {"WORKER_EARLY_START": "0"}  # the master builds TensorFlow before serving the groups (as before issue 28)


def _first_step_at(run: Path) -> float | None:
    """When the run's first group started playing (epoch seconds), from the groups' logs: its ``playing`` line
    comes right after it got the SETUP and the first weights, before its first env step."""
    import re

    found = []
    for log in (run / "logs").glob("group-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ INFO group \d+ playing", line)
            if m:
                found.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000)
                break
    return min(found) if found else None


def first_step(reps: int = 5, workers: int = 8) -> dict[str, Any]:
    """Seconds from starting ``launcher up`` (process backend, CartPole, ``workers`` workers) to the first group
    playing and to the first segment with a finished episode at the master: the master serving a numpy-made
    first policy while TensorFlow loads (the default) against TensorFlow first, ``reps`` interleaved pairs."""
    variants = {"numpy-made first policy (default)": {}, "TensorFlow first (WORKER_EARLY_START=0)": TF_FIRST}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, extra in variants.items():
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                wall, code, doc = run_up(Path(tmp), "--backend", "process", "--workers", str(workers), "--env",
                                         "CartPole-v1", "--max-steps", "20000", extra_env=extra)
                run = Path(tmp) / str(doc.get("run_id"))
                step, seg = _first_step_at(run), _first_segment_at(run)
            rows[name].append({"first_step_s": None if step is None else step - t0,
                               "first_segment_s": None if seg is None else seg - t0, "exit": code})
    def med(rs: list[dict[str, Any]], key: str) -> float:
        return median([r[key] for r in rs if r[key] is not None])

    base = med(rows["TensorFlow first (WORKER_EARLY_START=0)"], "first_step_s")
    table = [{"variant": name, "median_first_step_s": med(rs, "first_step_s"),
              "median_first_segment_s": med(rs, "first_segment_s"),
              "ratio_vs_tf_first": med(rs, "first_step_s") / base, "runs": rs} for name, rs in rows.items()]
    return {"table": table, "workers": workers, "reps": reps}


def _first_segment_at(run: Path) -> float | None:
    """When the master received the run's first segment with a finished episode (epoch seconds), from
    metrics.jsonl: everything before it is start-up (CLI, TensorFlow import, model, first collection)."""
    try:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("type") == "episodes":
                return float(rec["t"])
    except (OSError, ValueError):
        return None
    return None


def _single_process_rate(workers: int, steps: int, env_id: str = "CartPole-v1", n_steps: int = 64) -> float:
    """Env steps/s of one process stepping ``workers`` envs of ``env_id`` with the numpy policy; no transport, no
    learning. The envs are one vector env built exactly as a worker group builds its own, and each collect plays
    ``n_steps`` per env, as the run's segments do."""
    code = f"""
import json, sys, time, numpy as np
from worker.envs import make_vector_env
from worker.algorithms.actor_critic import ActorCriticPolicy
from worker.algorithms.rollout import Collector
from worker.api import Spaces
from worker.numpy_model import NumpyModel, Program
envs = make_vector_env({env_id!r}, {workers})
model = NumpyModel(Program.from_dict(json.loads(sys.stdin.read())))  # the built-in network's program, no TF here
rng = np.random.default_rng(0)
model.set_weights({{k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in model.shapes.items()}}, 0)
space = envs.single_observation_space
pol = ActorCriticPolicy(model, Spaces(space, envs.single_action_space), str(space.dtype))
col = Collector(envs, pol, gamma=0.99, lam=0.95, seed=0)
n = max(1, {steps} // ({n_steps} * {workers}))
col.collect({n_steps})
t, done = time.perf_counter(), 0
for _ in range(n):
    done += col.collect({n_steps}).steps
print(done / (time.perf_counter() - t))
"""
    # The same thread settings a group gets from the launcher (one BLAS thread): a like-for-like process.
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env(), "OMP_NUM_THREADS": "1",
                       "OPENBLAS_NUM_THREADS": "1"}, input=json.dumps(builtin_program(env_id)), capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"the single-process baseline on {env_id} failed: {p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def cartpole_program() -> dict[str, Any]:
    """The numpy program of the built-in CartPole network."""
    return builtin_program("CartPole-v1")


def builtin_program(env_id: str) -> dict[str, Any]:
    """The numpy program of the built-in network for ``env_id`` (made here, in the bench's own process, so the
    single-process baseline imports no TensorFlow, as a group does not)."""
    import keras

    from worker.envs import make_env
    from worker.keras_convert import to_program
    from worker.models import Architecture, build_keras_model

    keras.utils.set_random_seed(0)
    e = make_env(env_id, seed=0)
    try:
        return to_program(build_keras_model(Architecture.for_spaces(e.observation_space, e.action_space))).to_dict()
    finally:
        e.close()


def _system_rate(results: Path, workers: int, steps: int, *extra: str, env_id: str = "CartPole-v1") -> float:
    """Env steps/s of a whole ``launcher up`` run, from its own metrics after the first steps."""
    wall, code, doc = run_up(results, "--backend", "process", "--workers", str(workers), "--env", env_id,
                             "--algo", "ppo", "--max-steps", str(steps), *extra)
    run = results / doc["run_id"]
    prog = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    prog = [r for r in prog if r.get("type") == "progress" and r["env_steps"] > 0]
    first, last = prog[0], prog[-1]
    return (last["env_steps"] - first["env_steps"]) / max(last["wall_s"] - first["wall_s"], 1e-6)


# epochs=0: the master re-broadcasts the weights without training, so this measures acting, transport and
# the rounds alone (learning-bound speed is what time-to-solve and learning_on measure).
LEARNING_OFF = ("--set", "epochs=0")


def acting_paths(workers: int = 8, steps: int = 100_000, reps: int = 3) -> dict[str, Any]:
    """The same MLP (the built-in CartPole network) acted with the numpy program and with TensorFlow in the
    groups (``--acting``), learning off: env steps/s of a ``launcher up`` run, ``reps`` interleaved pairs."""
    rates: dict[str, list[float]] = {"numpy": [], "tensorflow": []}
    for _ in range(reps):
        for path in rates:
            with tempfile.TemporaryDirectory() as tmp:
                rates[path].append(_system_rate(Path(tmp), workers, steps, *LEARNING_OFF, "--acting", path))
    base = median(rates["numpy"])
    table = [{"acting": path, "env_steps_per_s": median(r), "ratio_vs_numpy": median(r) / base, "runs": r}
             for path, r in rates.items()]
    return {"table": table, "workers": workers, "steps": steps, "reps": reps}


def actor_efficiency(worker_counts: list[int], steps: int, reps: int = 3, env_id: str = "CartPole-v1",
                     n_steps: int | None = None, groups: int | None = None) -> dict[str, Any]:
    """System vs one process, learning off, ``reps`` interleaved repetitions per worker count (medians), on
    ``env_id`` with PPO's segment length for it (``n_steps``: passed to both sides; default PPO's for the env).

    ``groups``: the system runs' ``--groups`` (at most one per worker); None leaves it to the plan, which keeps
    a core for the learner of an overlapped run. With learning off the learner needs none, so ``groups`` = the
    cores measures what the actor side can do with the whole machine."""
    if n_steps is None:
        n_steps = ppo_n_steps(env_id)
    table = []
    for w in worker_counts:
        runs = []
        plan = ("--groups", str(min(groups, w))) if groups else ()
        for _ in range(reps):
            # The baseline just before and just after the system run, averaged: this machine's speed drifts by
            # 10-20 % over a minute, and a baseline on one side only reads that drift as the system's.
            before = _single_process_rate(w, steps // 4, env_id, n_steps)
            with tempfile.TemporaryDirectory() as tmp:
                system = _system_rate(Path(tmp), w, steps, *LEARNING_OFF, "--set", f"n_steps={n_steps}", *plan,
                                      env_id=env_id)
            after = _single_process_rate(w, steps // 4, env_id, n_steps)
            single = (before + after) / 2
            runs.append({"system": system, "single": single, "ratio": system / single,
                         "single_before_after": [before, after]})
        table.append({"workers": w, "system_env_steps_per_s": median([r["system"] for r in runs]),
                      "single_process_env_steps_per_s": median([r["single"] for r in runs]),
                      "ratio": median([r["ratio"] for r in runs]), "runs": runs})
    return {"table": table, "steps": steps, "reps": reps, "env": env_id, "n_steps": n_steps, "groups": groups}


def ppo_n_steps(env_id: str) -> int:
    """PPO's segment length for ``env_id`` as a run resolves it (its per-env and per-kind defaults)."""
    from worker.algorithms import load_algorithm, resolve_hparams
    from worker.api import Spaces
    from worker.envs import make_env

    e = make_env(env_id, seed=0)
    try:
        cls = load_algorithm("ppo")
        return int(resolve_hparams(cls, "ppo", env_id, Spaces(e.observation_space, e.action_space), {})["n_steps"])
    finally:
        e.close()


def learning_on(workers: int = 8, steps: int = 150_000, reps: int = 3) -> dict[str, Any]:
    """Env steps/s while PPO learns CartPole against the same run with learning off (interleaved; medians),
    overlapped (the default) and with the synchronous round (``sync=true``)."""
    variants = {"learning off": LEARNING_OFF, "learning on (overlapped)": (),
                "learning on (overlapped, XLA)": ("--set", "jit_compile=true"),
                "learning on (sync=true)": ("--set", "sync=true")}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, extra in variants.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(_system_rate(Path(tmp), workers, steps, *extra))
    off = median(runs["learning off"])
    table = [{"variant": name, "env_steps_per_s": median(rs), "ratio_vs_learning_off": median(rs) / off, "runs": rs}
             for name, rs in runs.items()]
    return {"table": table, "workers": workers, "steps": steps, "reps": reps}


_UPDATE_CODE = """
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
threads, jit = int(sys.argv[1]), sys.argv[2] == "1"
tf.config.threading.set_intra_op_parallelism_threads(threads)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from worker.algorithms import hparams
from worker.algorithms.ppo_update import PPOLearner
from worker.models import Architecture, build_keras_model
keras.utils.set_random_seed(0)
model = build_keras_model(Architecture(kind="mlp", obs_shape=(4,), continuous=False, n_outputs=2))
learner = PPOLearner(model, hparams.resolve("ppo", "CartPole-v1", {"jit_compile": jit}), 0, continuous=False,
                     n_outputs=2, obs_shape=(4,), obs_dtype="float32")
rng = np.random.default_rng(0)
def batch(n):
    return {"obs": rng.standard_normal((n, 4)).astype(np.float32), "actions": rng.integers(0, 2, n),
            "logp": np.full(n, -0.69, np.float32), "advantages": rng.standard_normal(n).astype(np.float32),
            "returns": rng.standard_normal(n).astype(np.float32)}
t = time.perf_counter(); learner.update(batch(512)); first = time.perf_counter() - t
times = []
for _ in range(60):  # 8 workers x 64 steps, less the masked reset rows: 480-512 samples a round
    b = batch(int(rng.integers(480, 513)))
    t = time.perf_counter(); learner.update(b); times.append(time.perf_counter() - t)
print(first * 1e3, float(np.median(times)) * 1e3)
"""


def update_cost(reps: int = 3) -> dict[str, Any]:
    """The PPO learner's update (4 epochs x 4 minibatches of a ~512-sample round) with and without XLA, with 1
    and 2 TensorFlow threads: first call (trace or compile) and the median of 60 updates; medians of ``reps``."""
    table = []
    for threads in (1, 2):
        for jit in (False, True):
            firsts, meds = [], []
            for _ in range(reps):
                p = subprocess.run([sys.executable, "-c", _UPDATE_CODE, str(threads), "1" if jit else "0"], cwd=ROOT,
                                   env=env(), capture_output=True, text=True, timeout=600)
                first, med = map(float, p.stdout.strip().splitlines()[-1].split())
                firsts.append(first)
                meds.append(med)
            table.append({"threads": threads, "xla": jit, "first_call_ms": median(firsts), "update_ms": median(meds)})
    return {"table": table, "reps": reps}


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

