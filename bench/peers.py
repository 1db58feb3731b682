"""``python -m bench peers``: the same targets side by side with what users would pick instead (issue 28 item 4).

Each contender trains from a fresh process to a task's target (the mean return of the last 100 episodes), and
the wall time from the process's start to the target is what counts (imports and start-up included, as a user
waits for them). Runs are interleaved (per seed: ours, then each peer), medians over the seeds.

Peers run in their own throw-away virtual environments, made here under ``~/.cache/launcher-bench/peers/<peer>``
(``LAUNCHER_BENCH_PEERS`` moves it) with pinned versions. They pull PyTorch: from PyPI that is the CUDA build, a
venv of 5-6 GB each, so this suite is optional, never part of ``bench all`` or CI.

* **Stable-Baselines3 PPO** with the rl-baselines3-zoo settings for each task (``hyperparams/ppo.yml``, given
  below as they are there, ``lin_X`` as a linear schedule from X to 0 over the zoo's ``n_timesteps``, which is
  also the run's budget), ``DummyVecEnv`` as the zoo does, ``VecNormalize`` where the zoo normalises, on CPU.
* **RLlib PPO** (new API stack) with its tuned examples' settings for CartPole and Pendulum and its defaults
  elsewhere, local env runners on the machine's cores.
* **Sample Factory APPO** (2.1.1, the last release; it needs gymnasium < 1.0 and numpy < 2, so InvertedPendulum is
  its -v4 there) with the settings of its own CartPole example (``sf_examples/train_gym_env.py``: 20 envs per
  rollout worker, one worker per core, two policy workers, batch 512, reward scale 0.1, no V-trace) for every task,
  on CPU; stopped from an ``AlgoObserver`` when the mean of its last 100 episode returns (its ``stats_avg``) reaches
  the target.
* Ours: ``launcher up --backend process --workers 8 --algo ppo --until-return TARGET`` with the defaults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import median, run_up

PEERS_DIR = Path(os.environ.get("LAUNCHER_BENCH_PEERS", Path.home() / ".cache" / "launcher-bench" / "peers"))


@dataclass(frozen=True)
class Task:
    env_id: str
    target: float
    our_max_steps: int  # our run's budget; a peer's is its own config's


TASKS = {
    "cartpole": Task("CartPole-v1", 475.0, 2_000_000),
    "acrobot": Task("Acrobot-v1", -100.0, 2_000_000),
    "pendulum": Task("Pendulum-v1", -250.0, 2_000_000),
    "invpend": Task("InvertedPendulum-v5", 950.0, 2_000_000),
}

# rl-baselines3-zoo hyperparams/ppo.yml (commit 00128b5), per task; InvertedPendulum-v5 takes the zoo's -v3 entry.
ZOO_PPO: dict[str, dict[str, Any]] = {
    "CartPole-v1": {"n_envs": 8, "n_timesteps": 100_000, "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8,
                    "gamma": 0.98, "n_epochs": 20, "ent_coef": 0.0, "learning_rate": "lin_0.001",
                    "clip_range": "lin_0.2"},
    "Acrobot-v1": {"normalize": True, "n_envs": 16, "n_timesteps": 1_000_000, "n_steps": 256, "gae_lambda": 0.94,
                   "gamma": 0.99, "n_epochs": 4, "ent_coef": 0.0},
    "Pendulum-v1": {"n_envs": 4, "n_timesteps": 100_000, "n_steps": 1024, "gae_lambda": 0.95, "gamma": 0.9,
                    "n_epochs": 10, "ent_coef": 0.0, "learning_rate": 1e-3, "clip_range": 0.2, "use_sde": True,
                    "sde_sample_freq": 4},
    "InvertedPendulum-v5": {"normalize": True, "n_envs": 1, "n_timesteps": 1_000_000, "batch_size": 64,
                            "n_steps": 32, "gamma": 0.999, "learning_rate": 0.000222425, "ent_coef": 1.37976e-07,
                            "clip_range": 0.4, "n_epochs": 5, "gae_lambda": 0.9, "max_grad_norm": 0.3,
                            "vf_coef": 0.19816},
}

SB3_DRIVER = r'''
import json, sys
import numpy as np
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize

job = json.loads(sys.argv[1])
hp = dict(job["hp"])
n_envs, budget, normalize = hp.pop("n_envs"), hp.pop("n_timesteps"), hp.pop("normalize", False)
for key in ("learning_rate", "clip_range"):
    if isinstance(hp.get(key), str) and hp[key].startswith("lin_"):
        start = float(hp[key][4:])
        hp[key] = lambda progress_remaining, start=start: progress_remaining * start
env = make_vec_env(job["env_id"], n_envs=n_envs, seed=job["seed"])
if normalize:
    env = VecNormalize(env, gamma=hp.get("gamma", 0.99))

class Target(BaseCallback):
    solved = False
    def _on_step(self):
        buf = self.model.ep_info_buffer
        if len(buf) >= 100 and np.mean([e["r"] for e in buf]) >= job["target"]:
            Target.solved = True
            return False
        return True

model = PPO("MlpPolicy", env, seed=job["seed"], device="cpu", verbose=0, **hp)
model.learn(total_timesteps=budget, callback=Target())
buf = model.ep_info_buffer
print(json.dumps({"env_steps": int(model.num_timesteps), "solved": Target.solved,
                  "mean_return": float(np.mean([e["r"] for e in buf])) if buf else None}))
'''

RLLIB_DRIVER = r'''
import json, sys
import ray
from ray.rllib.algorithms.ppo import PPOConfig

job = json.loads(sys.argv[1])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
config = (PPOConfig().environment(job["env_id"]).env_runners(num_env_runners=1, num_envs_per_env_runner=8)
          .debugging(seed=job["seed"]))
if job["env_id"] == "CartPole-v1":  # rllib/tuned_examples/ppo/cartpole_ppo.py
    config = config.training(lr=0.0003, num_epochs=6, vf_loss_coeff=0.01)
elif job["env_id"] == "Pendulum-v1":  # rllib/tuned_examples/ppo/pendulum_ppo.py (its runners: 2 x 10 envs)
    config = (config.env_runners(num_env_runners=2, num_envs_per_env_runner=10)
              .training(lr=0.0003, lambda_=0.1, vf_clip_param=10.0, num_epochs=6)
              .rl_module(model_config={"fcnet_activation": "relu"}))
algo = config.build()
steps, mean, solved = 0, None, False
while steps < job["budget"]:
    result = algo.train()
    runners = result.get("env_runners", {})
    steps = int(result.get("num_env_steps_sampled_lifetime") or runners.get("num_env_steps_sampled_lifetime") or 0)
    mean = runners.get("episode_return_mean")
    if mean is not None and mean >= job["target"]:
        solved = True
        break
print(json.dumps({"env_steps": steps, "solved": solved, "mean_return": mean}))
'''

SF_DRIVER = r'''
import json, sys, tempfile
import numpy as np
from sample_factory.algo.runners.runner import AlgoObserver
from sample_factory.algo.utils.misc import ExperimentStatus
from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
from sample_factory.envs.env_utils import register_env
from sample_factory.train import make_runner
from sf_examples.train_gym_env import make_gym_env_func

job = json.loads(sys.argv[1])
env_id = job["env_id"].replace("InvertedPendulum-v5", "InvertedPendulum-v4")  # gymnasium < 1.0 has no v5
register_env(env_id, make_gym_env_func)  # its example's factory: importable, so its spawned processes can use it
# sf_examples/train_gym_env.py's CartPole command line, on CPU, with the run's seed, budget and a scratch dir.
argv = ["--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
        "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1", "--save_every_sec=600",
        "--experiment_summaries_interval=10", f"--env={env_id}", "--device=cpu", f"--seed={job['seed']}",
        f"--train_for_env_steps={job['budget']}", f"--train_dir={tempfile.mkdtemp()}", "--experiment=bench"]
parser, _ = parse_sf_args(argv=argv)
cfg = parse_full_cfg(parser, argv)
result = {"solved": False, "mean_return": None, "env_steps": 0}

class Target(AlgoObserver):
    def on_training_step(self, runner, training_iteration_since_resume):
        rewards = runner.policy_avg_stats.get("reward", [[]])[0]
        result["env_steps"] = int(runner.env_steps.get(0, 0))
        if len(rewards) >= 100:
            result["mean_return"] = float(np.mean(rewards))
            if result["mean_return"] >= job["target"] and not result["solved"]:
                result["solved"] = True
                runner._stop_training()

cfg, runner = make_runner(cfg)
runner.register_observer(Target())
if runner.init() == ExperimentStatus.SUCCESS:
    runner.run()
print(json.dumps(result))
'''


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    driver: str

    @property
    def python(self) -> Path:
        return PEERS_DIR / self.name / "bin" / "python"

    def ensure(self) -> None:
        """Make the peer's venv once (minutes; several GB). A venv whose install did not finish (no stamp) is
        installed into again, so an interrupted first run does not leave a peer without its packages."""
        stamp = PEERS_DIR / self.name / ".bench-installed"
        if stamp.exists() and stamp.read_text() == "\n".join(self.packages):
            return
        print(f"making the {self.name} venv under {PEERS_DIR} (PyTorch from PyPI: several GB)", file=sys.stderr)
        if not self.python.exists():
            subprocess.run(["/usr/bin/python3.11" if Path("/usr/bin/python3.11").exists() else sys.executable, "-m",
                            "venv", str(PEERS_DIR / self.name)], check=True)
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", *self.packages], check=True)
        stamp.write_text("\n".join(self.packages))

    def job(self, task: Task, seed: int) -> dict[str, Any]:
        """What the driver runs: SB3 has the zoo's settings and budget; RLlib and Sample Factory their own settings
        and our budget."""
        hp = ZOO_PPO[task.env_id]
        budget = hp["n_timesteps"] if self.name == "sb3" else task.our_max_steps
        return {"env_id": task.env_id, "target": task.target, "seed": seed, "hp": hp, "budget": budget}


PEERS = {
    "sb3": Peer("sb3", ("torch==2.5.1", "stable-baselines3==2.4.1", "gymnasium==1.0.0", "mujoco>=3.1,<3.3",
                        "imageio"), SB3_DRIVER),
    "rllib": Peer("rllib", ("torch==2.5.1", "ray[rllib]==2.40.0", "gymnasium==1.0.0", "mujoco>=3.1,<3.3",
                            "imageio"), RLLIB_DRIVER),
    "sf": Peer("sf", ("torch==2.5.1", "sample-factory==2.1.1", "gymnasium==0.29.1", "numpy<2", "mujoco>=3.1,<3.3",
                     "imageio"), SF_DRIVER),
}
PEER_PACKAGES = {name: list(p.packages) for name, p in PEERS.items()}
PEER_LABELS = {"sb3": "Stable-Baselines3 PPO (rl-zoo settings)", "rllib": "RLlib PPO",
               "sf": "Sample Factory APPO (its CartPole example's settings)"}


# One peer run's wall-clock limit (``--peer-timeout``): a peer that has not reached the target by then counts as
# not solved, with the time it had.
PEER_TIMEOUT_S = 1800.0


def _run_peer(peer: Peer, task: Task, seed: int, timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    t0 = time.perf_counter()
    # Its own session, so a timeout ends the peer's worker processes (Ray's, Sample Factory's) with it.
    p = subprocess.Popen([str(peer.python), "-c", peer.driver, json.dumps(peer.job(task, seed))],
                         cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={"PATH": os.environ.get("PATH", ""), "HOME": str(Path.home()), "OMP_NUM_THREADS": "2"},
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {"seed": seed, "wall_s": time.perf_counter() - t0, "solved": False,
                "error": f"not at the target after the {timeout_s:.0f} s limit"}
    wall = time.perf_counter() - t0
    try:
        doc = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        # A peer that crashed is a broken setup, not a result: stop rather than record it as "not solved".
        raise SystemExit(f"bench peers: {peer.name} on {task.env_id} (seed {seed}) exited {p.returncode} without a "
                         f"result; its last output:\n{err[-1500:]}") from None
    return {"seed": seed, "wall_s": wall, **doc}


def _run_ours(task: Task, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        wall, code, doc = run_up(Path(tmp), "--backend", "process", "--workers", "8", "--env", task.env_id, "--algo",
                                 "ppo", "--until-return", str(task.target), "--seed", str(seed), "--max-steps",
                                 str(task.our_max_steps), timeout=3600)
    s = doc.get("summary", {})
    return {"seed": seed, "wall_s": wall, "env_steps": s.get("env_steps"), "solved": code == 0,
            "mean_return": s.get("mean_return")}


def ours_can_make(env_id: str) -> None:
    """Our runs use this interpreter's packages (the project's .venv): a task whose env needs more (MuJoCo for
    InvertedPendulum) is refused before any peer venv is made or any run starts, saying what to install. The env is
    made as our groups make it (:func:`worker.envs.make_env`)."""
    from worker.envs import EnvError, make_env

    try:
        make_env(env_id, seed=0).close()
    except (ImportError, EnvError) as exc:
        raise SystemExit(f"bench peers: {env_id} cannot be made with {sys.executable} ({type(exc).__name__}: {exc}); "
                         f"install its packages there first, e.g. `{sys.executable} -m pip install mujoco imageio` "
                         "for the MuJoCo tasks (the peers' venvs get mujoco themselves)") from exc


def peers(tasks: list[str], peer_names: list[str], seeds: list[int], timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    """Each task: per seed, ours then each peer (interleaved); medians over the seeds that solved."""
    for name in tasks:
        ours_can_make(TASKS[name].env_id)
    chosen = [PEERS[n] for n in peer_names]
    for p in chosen:
        p.ensure()
    out: dict[str, Any] = {"tasks": {}, "seeds": seeds, "peers": {p.name: list(p.packages) for p in chosen},
                           "zoo_ppo": {TASKS[t].env_id: ZOO_PPO[TASKS[t].env_id] for t in tasks}}
    for name in tasks:
        task = TASKS[name]
        rows: dict[str, list[dict[str, Any]]] = {"launcher ppo, 8 workers": []}
        rows.update({PEER_LABELS[p.name]: [] for p in chosen})
        for seed in seeds:
            rows["launcher ppo, 8 workers"].append(_run_ours(task, seed))
            for p in chosen:
                rows[PEER_LABELS[p.name]].append(_run_peer(p, task, seed, timeout_s))
        table: list[dict[str, Any]] = []
        for label, rs in rows.items():
            solved = [r for r in rs if r.get("solved")]
            table.append({"contender": label, "solved": f"{len(solved)}/{len(rs)}",
                          "median_wall_s": median([r["wall_s"] for r in solved]) if solved else None,
                          "median_env_steps": median([r["env_steps"] for r in solved]) if solved else None,
                          "runs": rs})
        ours = table[0]["median_wall_s"]
        for row in table:
            row["ratio_vs_ours"] = (row["median_wall_s"] / ours) if ours and row["median_wall_s"] else None
        out["tasks"][name] = {"env_id": task.env_id, "target": task.target, "table": table}
    return out


def merged(before: dict[str, Any] | None, now: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``now``'s tasks over those of an earlier run (``before``), so a run of some tasks keeps the others' results;
    every task keeps the record of when, where and how it was measured (``measured``: meta and command)."""
    b = before or {}
    earlier = {"meta": b.get("meta", {}), "command": b.get("command"), "seeds": b.get("seeds"), "peers": b.get("peers")}
    tasks: dict[str, Any] = {name: {**t, "measured": t.get("measured") or earlier}
                             for name, t in (b.get("tasks") or {}).items()}
    record = {**measured, "seeds": now["seeds"], "peers": now["peers"]}
    for name, t in now["tasks"].items():
        old = tasks.get(name)
        new_peers = {r["contender"] for r in t["table"][1:]}
        if old is None or new_peers >= {r["contender"] for r in old["table"]} - {r["contender"] for r in t["table"][:1]}:
            tasks[name] = {**t, "measured": record}  # this run measured everything the earlier one had
            continue
        # Other peers than before: keep the earlier rows and add this run's, ours named as a second run beside them
        # (each peer's ratio is against the run of ours it was interleaved with).
        ours = {**t["table"][0], "contender": f"{t['table'][0]['contender']} (second run, beside "
                f"{', '.join(sorted(new_peers))})"}
        kept = [r for r in old["table"] if r["contender"] not in new_peers | {ours["contender"]}]
        first = old["measured"]
        tasks[name] = {**t, "table": kept + [ours] + t["table"][1:],
                       "measured": {**record, "command": f"{first.get('command')}; then {measured.get('command')}",
                                    "peers": {**(first.get("peers") or {}), **now["peers"]}}}
    zoo = {**(b.get("zoo_ppo") or {}), **now["zoo_ppo"]}
    return {**now, "tasks": tasks, "zoo_ppo": zoo}


def report(d: dict[str, Any] | None) -> list[str]:
    """Section 10 of docs/benchmarks.md."""
    out = ["## 10. Side by side with the peers users would pick instead", ""]
    if not d:
        return out + ["Not measured yet: `python -m bench peers` (optional; makes venvs of several GB).", ""]
    out += ["Command: `python -m bench peers --tasks T --peers P` (section `peers`; each task below names its own run: "
            "the command, date, commit, machine and seeds; interleaved: per seed ours, then each peer). "
            "Wall seconds from the process's start to the mean return of the last 100 episodes reaching the target, "
            "imports and start-up included, medians over the seeds that solved; *ratio* is the contender's median over "
            "ours (above 1: ours is faster). Peers' venvs: " +
            "; ".join(f"{k}: {', '.join(v)}" for k, v in PEER_PACKAGES.items()) + ". Stable-Baselines3 runs the "
            "rl-baselines3-zoo PPO settings of each task (listed in `bench/peers.py` and the results file), with the "
            "zoo's step budget; RLlib its tuned examples' settings for CartPole and Pendulum and its defaults elsewhere; Sample "
            "Factory the settings of its own CartPole example for every task (it has no tuned example for the "
            "others).", ""]
    for t in d["tasks"].values():
        m = t.get("measured") or {"meta": d.get("meta", {}), "command": d.get("command"), "seeds": d.get("seeds")}
        meta = m.get("meta") or {}
        out += [f"**{t['env_id']}**, target {t['target']:g} (`{m.get('command')}`; {meta.get('date', '?')}, commit "
                f"`{meta.get('commit', '?')}`, {meta.get('cpu', '?')}; seeds {m.get('seeds')}):", "",
                "| contender | solved | median wall s | median env steps | ratio vs ours | runs (s) |",
                "|---|---|---|---|---|---|"]
        for r in t["table"]:
            runs = ", ".join(f"{x['wall_s']:.1f}{'' if x.get('solved') else ' (not solved)'}" for x in r["runs"])
            med = "-" if r["median_wall_s"] is None else f"{r['median_wall_s']:.1f}"
            steps = "-" if r["median_env_steps"] is None else f"{int(r['median_env_steps']):,}"
            ratio = "-" if r["ratio_vs_ours"] is None else f"{r['ratio_vs_ours']:.2f}"
            out.append(f"| {r['contender']} | {r['solved']} | {med} | {steps} | {ratio} | {runs} |")
        out += [""]
    return out

