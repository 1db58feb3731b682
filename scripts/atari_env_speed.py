"""Env steps per second of the preprocessed Atari env (worker.envs: ALE frameskip 1 + AtariPreprocessing with
frame_skip 4 + 4-frame stack, 84x84x4 uint8), one env and a vector of N, random actions, no policy.

    .venv/bin/python scripts/atari_env_speed.py [--env ALE/Pong-v5] [--steps 3000] [--vector 8] [--repeats 3]

One env step is 4 emulator frames. Prints one line per setting with the median of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def per_env(env_id: str, steps: int) -> float:
    from worker.envs import make_env

    env = make_env(env_id, seed=0)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    rate = steps / (time.perf_counter() - t0)
    env.close()
    return rate


def vector(env_id: str, n: int, steps: int) -> float:
    from worker.envs import make_vector_env

    envs = make_vector_env(env_id, n)
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(steps // n):
        envs.step(rng.integers(0, envs.single_action_space.n, n))
    rate = (steps // n) * n / (time.perf_counter() - t0)
    envs.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="ALE/Pong-v5")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--vector", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    one = [per_env(a.env, a.steps) for _ in range(a.repeats)]
    vec = [vector(a.env, a.vector, a.steps) for _ in range(a.repeats)]
    print(f"{a.env} preprocessed, 1 env: {statistics.median(one):.0f} env steps/s "
          f"(runs: {', '.join(f'{r:.0f}' for r in one)})")
    print(f"{a.env} preprocessed, SyncVectorEnv of {a.vector}: {statistics.median(vec):.0f} env steps/s in all "
          f"(runs: {', '.join(f'{r:.0f}' for r in vec)})")


if __name__ == "__main__":
    main()
