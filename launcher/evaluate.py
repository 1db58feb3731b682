"""Evaluate a trained run: load its policy, play episodes greedily, report the return, draw a GIF.

This module plays and reports: greedy episodes (cut at ``--max-episode-steps``), the ``launcher.eval/v1``
document and its human-readable form, the GIF of episode 0. Which weights are loaded (``--checkpoint``: final,
best, latest or a path) and how the policy acts with them is :mod:`launcher.eval_policy`; which env is made and
from where its code may come is :mod:`launcher.eval_env`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from launcher.errors import BadInput, MissingDependency
from launcher.eval_env import check_env, drop_run_paths, import_env_dir, run_spec
# Loading the weights lives in launcher.eval_policy; its names stay importable from here (the CLI and tests do).
from launcher.eval_policy import GreedyPolicy, LoadedPolicy, load_weights, policy_doc
from launcher.runs import RunDir
from launcher.safefs import read_json_at as read_json  # never through a link a container planted (issue 14)

log = logging.getLogger(__name__)

DEFAULT_SEED = 1_000_003  # away from the training seeds (seed + 1000 * group + worker)
DEFAULT_GIF_MAX_FRAMES = 300
# Envs with no time limit of their own (Flappy Bird) can play for ever under a good policy: an episode is cut
# here and counted in ``cut_at_max_steps``. 100k steps is ~30 min of Flappy Bird game time.
DEFAULT_MAX_EPISODE_STEPS = 100_000


@dataclass(frozen=True)
class Episode:
    """One played episode: its return, length, frames (when recorded), the game's score at the end where
    the env reports one in ``info["score"]``, and whether it was cut at the step limit."""

    ret: float
    length: int
    frames: list[np.ndarray]
    score: float | None
    cut: bool


# ------------------------------------------------------------------------------------------------ playing
def play(policy: Callable[[Any], Any], env: Any, *, seed: int, record: bool = False,
         max_frames: int = DEFAULT_GIF_MAX_FRAMES, max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS) -> Episode:
    """One greedy episode on ``env`` (reset with ``seed``) with ``policy`` (observation -> action), cut at
    ``max_episode_steps`` (an env without a time limit, Flappy Bird say, can otherwise play forever)."""
    obs, info = env.reset(seed=seed)
    frames: list[np.ndarray] = []
    total, length, done, cut = 0.0, 0, False, False
    if record:
        frames.append(np.asarray(env.render()))
    while not done:
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        total += float(reward)
        length += 1
        cut = length >= max_episode_steps and not (terminated or truncated)
        done = bool(terminated or truncated or cut)
        if record:
            frames.append(np.asarray(env.render()))
    if record and len(frames) > max_frames:
        step = math.ceil(len(frames) / max_frames)
        frames = frames[::step] + ([frames[-1]] if (len(frames) - 1) % step else [])
    return Episode(total, length, frames, _score(info), cut)


def _score(info: Any) -> float | None:
    """The game's own score at the episode's end where the env reports one (``info["score"]``: Flappy Bird's
    pipes passed, Snake's fruit), else None."""
    value = info.get("score") if isinstance(info, dict) else None
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return float(value)
    return None


def make_render_env(env_id: str, seed: int, env_args: dict[str, Any] | None = None) -> Any:
    """The env with ``render_mode="rgb_array"``; a missing renderer (pygame) becomes MissingDependency."""
    import os

    import gymnasium

    from worker.envs import make_env

    # pygame draws off-screen; without a display SDL would complain on stderr about one.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    try:
        env = make_env(env_id, seed=seed, render_mode="rgb_array", **(env_args or {}))
        env.render()
    except gymnasium.error.DependencyNotInstalled as exc:
        raise MissingDependency(f"--gif: {env_id} draws its frames with pygame, which is not installed ({exc})",
                                hint="pip install 'launcher[render]' (pygame), or leave out --gif") from None
    except ModuleNotFoundError as exc:
        raise MissingDependency(f"--gif: {env_id} needs {exc.name} to draw frames, which is not installed",
                                hint="pip install 'launcher[render]', or leave out --gif") from None
    return env


def write_gif(frames: Sequence[np.ndarray], path: Path, *, fps: float) -> int:
    """Write ``frames`` (H, W, 3 uint8) as a looping animated GIF. Returns the number of frames."""
    from PIL import Image

    if not frames:
        raise ValueError("no frames to write")
    # One palette for the whole animation, from the first, middle and last frames stacked: quantizing each
    # frame on its own (median cut) costs ~45 ms a frame for CartPole's 600x400, this ~1.5 ms.
    sample = np.concatenate([np.asarray(frames[i], np.uint8) for i in sorted({0, len(frames) // 2, len(frames) - 1})])
    palette = Image.fromarray(sample).quantize(colors=128, method=Image.Quantize.FASTOCTREE)
    images = [Image.fromarray(np.asarray(f, np.uint8)).quantize(palette=palette, dither=Image.Dither.NONE)
              for f in frames]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], loop=0,
                   duration=max(20, int(round(1000 / fps))), disposal=1)
    tmp.replace(path)
    return len(images)


def evaluate(run_dir: RunDir, *, episodes: int = 10, checkpoint: str = "final", seed: int = DEFAULT_SEED,
             gif: Path | None = None, gif_max_frames: int = DEFAULT_GIF_MAX_FRAMES,
             max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS, code: str | None = None,
             env_dir: Path | None = None, env: str | None = None) -> dict[str, Any]:
    """Play ``episodes`` greedy episodes with the run's policy; the ``launcher.eval/v1`` document.

    Episode ``i`` is reset with ``seed + i``. With ``gif``, episode 0 is played on a rendering env and its
    frames written there (at most ``gif_max_frames``, evenly thinned; the frame time keeps real speed).
    ``env``: the env to make instead of the one the run's record names (``--env``); ``env_dir``: the user's env
    modules (``--env-dir``). Nothing is imported from the run's results.

    Raises:
        BadInput: bad arguments or missing weights; MissingDependency: no renderer for ``gif``.
    """
    from launcher.schemas import EVAL_SCHEMA
    from worker.envs import make_env

    if episodes < 1:
        raise BadInput(f"--episodes must be >= 1, got {episodes}")
    started = time.monotonic()
    spec, env_id = run_spec(run_dir, env)  # launcher.eval_env: the record's env, or --env
    saved_args = spec.get("env_args")
    env_args: dict[str, Any] = dict(saved_args) if isinstance(saved_args, dict) else {}
    drop_run_paths(run_dir)
    import_env_dir(run_dir, env_dir)
    check_env(env_id, env_args)
    loaded = load_weights(run_dir, checkpoint, code=code)
    policy = loaded.policy()
    if max_episode_steps < 1:
        raise BadInput(f"--max-episode-steps must be >= 1, got {max_episode_steps}")
    played: list[Episode] = []
    gif_doc: dict[str, Any] | None = None
    if gif is not None:
        renv = make_render_env(env_id, seed, env_args)
        try:
            ep = play(policy, renv, seed=seed, record=True, max_frames=gif_max_frames,
                      max_episode_steps=max_episode_steps)
            fps = float(renv.metadata.get("render_fps") or 30) * len(ep.frames) / max(ep.length + 1, 1)
        finally:
            renv.close()
        played.append(ep)
        count = write_gif(ep.frames, gif, fps=fps)
        gif_doc = {"path": str(gif.resolve()), "frames": count, "episode": 0}
    play_env = make_env(env_id, seed=seed, **env_args)
    try:
        for i in range(len(played), episodes):
            played.append(play(policy, play_env, seed=seed + i, max_episode_steps=max_episode_steps))
    finally:
        play_env.close()
    returns = [ep.ret for ep in played]
    scores = [ep.score for ep in played]
    have_scores = all(sc is not None for sc in scores)
    summary = read_json(run_dir.files.summary) or read_json(run_dir.files.status) or {}
    return {
        "schema": EVAL_SCHEMA, "run_id": run_dir.run_id, "env_id": env_id, "algo": spec.get("algo"),
        "checkpoint": loaded.checkpoint, "weights_from": loaded.source, "episodes": episodes, "seed": seed,
        "greedy": True, "acting": "numpy" if loaded.doc.program is not None else "tensorflow", "returns": returns, "lengths": [ep.length for ep in played],
        "scores": scores if have_scores else None,
        "mean_score": statistics.fmean(sc for sc in scores if sc is not None) if have_scores else None,
        "cut_at_max_steps": sum(ep.cut for ep in played), "max_episode_steps": max_episode_steps,
        "mean_return": statistics.fmean(returns), "std_return": statistics.pstdev(returns),
        "min_return": min(returns), "max_return": max(returns), "median_return": statistics.median(returns),
        "training_mean_return": summary.get("mean_return"), "gif": gif_doc,
        "wall_s": round(time.monotonic() - started, 2),
    }


def format_report(doc: dict[str, Any]) -> str:
    """The evaluation as lines people read."""
    train = doc["training_mean_return"]
    lines = [f"run {doc['run_id']} · {doc['algo']} on {doc['env_id']} · {doc['checkpoint']} weights "
             f"({doc['weights_from']})",
             f"  episodes    {doc['episodes']} greedy, seeds {doc['seed']}..{doc['seed'] + doc['episodes'] - 1}",
             f"  return      mean {doc['mean_return']:.2f} ± {doc['std_return']:.2f} (std), median "
             f"{doc['median_return']:.2f}, min {doc['min_return']:.2f}, max {doc['max_return']:.2f}",
             f"  training    mean return at the end {'-' if train is None else f'{train:.2f}'}",
             *([f"  score       mean {doc['mean_score']:.2f} (the env's info['score'] at each episode's end), max "
                f"{max(doc['scores']):g}"] if doc.get("mean_score") is not None else []),
             *([f"  cut         {doc['cut_at_max_steps']} episodes reached --max-episode-steps "
                f"{doc['max_episode_steps']} and were cut"] if doc.get("cut_at_max_steps") else []),
             f"  lengths     {', '.join(str(n) for n in doc['lengths'][:20])}"
             + (" ..." if len(doc["lengths"]) > 20 else "")]
    if doc["gif"]:
        lines.append(f"  gif         {doc['gif']['path']} ({doc['gif']['frames']} frames of episode 0)")
    return "\n".join(lines)


__all__ = ["GreedyPolicy", "LoadedPolicy", "evaluate", "format_report", "load_weights", "play", "policy_doc",
           "write_gif"]
