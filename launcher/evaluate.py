"""Evaluate a trained run: load its policy, play episodes greedily, report the return, draw a GIF.

Where the weights come from (``--checkpoint``):

* ``final`` (default): ``model/policy.npz`` + ``model/architecture.json``, exported by the master at the end;
  run with :class:`worker.models.NumpyPolicy`, no TensorFlow.
* ``best``: ``model/best_policy.npz``, kept by the master whenever the windowed mean return improved.
* ``latest``: the newest TF checkpoint in ``checkpoints/`` (a run that was stopped or crashed), restored with
  :class:`worker.checkpoint.Checkpointer` into a built Keras model whose weights then go to NumpyPolicy.
* a path: a checkpoint prefix (``checkpoints/ckpt-190``, relative to the run or absolute) or an ``.npz``.

Acting is greedy: the most probable action (discrete) or the mean (continuous), no exploration noise.
Observations are normalised as the run's groups normalised them (running statistics saved with the weights
in ``policy.npz``/``best_policy.npz`` and in every checkpoint; :mod:`worker.normalize`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from launcher.errors import BadInput, MissingDependency
from launcher.runs import RunDir
from worker.models import Architecture, NumpyPolicy, check_weights
from worker.normalize import NormStats, check_stats
from launcher import safefs
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


@dataclass(frozen=True)
class LoadedPolicy:
    """Weights ready to act with, and where they came from."""

    arch: Architecture
    weights: dict[str, np.ndarray]
    checkpoint: str  # final, best, latest, path
    source: str  # the file or checkpoint prefix read
    norm: NormStats = NormStats()  # the observation statistics the run acted with (none: not normalised)

    def policy(self) -> NumpyPolicy:
        p = NumpyPolicy(self.arch)
        p.set_weights(self.weights, version=0)
        return p


def run_spec(run_dir: RunDir) -> dict[str, Any]:
    spec = read_json(run_dir.files.spec)
    if not spec:
        raise BadInput(f"run {run_dir.run_id} has no readable spec.json in {run_dir.path}",
                       hint="is this a launcher results directory?")
    return dict(spec)


def architecture_of(run_dir: RunDir) -> Architecture:
    """The run's network: from ``model/architecture.json`` if the master exported it, else rebuilt from the
    spec (env spaces + hyper-parameters) exactly as the master built it."""
    doc = read_json(run_dir.files.model_dir / "architecture.json")
    if doc and "architecture" in doc:
        a = dict(doc["architecture"])
        for key in ("obs_shape", "hidden", "conv_filters", "action_low", "action_high"):
            if key in a and a[key] is not None:
                a[key] = tuple(a[key])
        return Architecture(**a)
    from worker.envs import make_env

    spec = run_spec(run_dir)
    env = make_env(spec["env_id"], seed=0, **(spec.get("env_args") or {}))
    try:
        return Architecture.for_spaces(env.observation_space, env.action_space, _hparams(spec, env))
    finally:
        env.close()


def _hparams(spec: dict[str, Any], env: Any = None) -> dict[str, Any]:
    """The hyper-parameters the run's master resolved (its env's kind included)."""
    from worker.algorithms import hparams
    from worker.envs import make_env
    from worker.models import env_kind

    made = env is None
    if made:
        env = make_env(spec["env_id"], seed=0, **(spec.get("env_args") or {}))
    try:
        kind = env_kind(env.observation_space, env.action_space)
        return hparams.resolve(spec["algo"], spec["env_id"], spec.get("hparams") or {}, kind=kind)
    finally:
        if made:
            env.close()


def _npz(path: Path) -> tuple[dict[str, np.ndarray], NormStats]:
    """The weights (float32) and the normalisation statistics (``norm/*``, float64) in an exported ``.npz``."""
    # model/ is written by the master container: opened without following a link, a regular file only.
    try:
        with safefs.open_read(path.parent.parent, f"{path.parent.name}/{path.name}") as fh, np.load(fh) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
            weights = {k: v.astype(np.float32) for k, v in arrays.items() if not k.startswith("norm/")}
            return weights, NormStats.from_arrays(arrays)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise BadInput(f"cannot read the weights in {path}: {exc}",
                       hint="pick another --checkpoint (final, best, latest or a path)") from None


def load_weights(run_dir: RunDir, checkpoint: str = "final") -> LoadedPolicy:
    """The policy weights ``checkpoint`` names (see the module docstring).

    Raises:
        BadInput: the file or checkpoint is not there (the message says which and what exists), or its
            weights do not fit the run's architecture.
    """
    arch = architecture_of(run_dir)
    model_dir = run_dir.files.model_dir
    if checkpoint in ("final", "best"):
        path = model_dir / ("policy.npz" if checkpoint == "final" else "best_policy.npz")
        if not path.exists():
            hint = ("the master exports it when the run ends; for a stopped or crashed run use --checkpoint latest"
                    if checkpoint == "final" else
                    "the master keeps it once the mean return of a window exists; try --checkpoint final or latest")
            raise BadInput(f"run {run_dir.run_id} has no {path.relative_to(run_dir.path)}", hint=hint)
        (weights, norm), kind, source = _npz(path), checkpoint, str(path)
    elif checkpoint == "latest":
        weights, norm, source = _restore_tf(run_dir, arch, None)
        kind = "latest"
    else:
        path = _resolve_path(run_dir, Path(checkpoint).expanduser())
        if path.suffix == ".npz":
            if not path.exists():
                raise BadInput(f"--checkpoint {checkpoint}: no such file {path}")
            (weights, norm), source = _npz(path), str(path)
        else:
            weights, norm, source = _restore_tf(run_dir, arch, path)
        kind = "path"
    try:
        check_weights(arch, weights)
    except ValueError as exc:
        raise BadInput(f"the weights in {source} do not fit run {run_dir.run_id}'s network: {exc}",
                       hint="pick a checkpoint of this run") from None
    problem = check_stats(norm.arrays(), arch.obs_shape, obs=norm.obs_mean is not None, ret=False)
    if problem is not None:
        raise BadInput(f"the normalisation statistics in {source} are unusable: {problem}",
                       hint="pick another --checkpoint (final, best, latest or a path)")
    return LoadedPolicy(arch, weights, kind, source, norm)


def _resolve_path(run_dir: RunDir, given: Path) -> Path:
    """``given`` as is if absolute, else relative to the run, its checkpoints/ or the working directory."""
    if given.is_absolute():
        return given
    candidates = [run_dir.path / given, run_dir.files.checkpoints / given, Path.cwd() / given]
    for p in candidates:
        if p.exists() or Path(f"{p}.index").exists():
            return p
    return candidates[0]


def _restore_tf(run_dir: RunDir, arch: Architecture, prefix: Path | None
                ) -> tuple[dict[str, np.ndarray], NormStats, str]:
    """Restore a TF checkpoint (the newest, or ``prefix``) into a fresh Keras model; return its weights and
    the normalisation statistics saved with it (for the normalisation the run's hyper-parameters turn on)."""
    ckpt_dir = run_dir.files.checkpoints
    if prefix is None and not (ckpt_dir / "checkpoint").exists():
        raise BadInput(f"run {run_dir.run_id} has no checkpoint in {ckpt_dir}",
                       hint="the master writes one every --checkpoint-every updates and when it stops")
    if prefix is not None and not Path(f"{prefix}.index").exists():
        existing = sorted(p.name.removesuffix(".index") for p in ckpt_dir.glob("*.index"))
        raise BadInput(f"--checkpoint {prefix}: no TF checkpoint there (no {prefix}.index)",
                       hint=f"checkpoints of this run: {', '.join(existing) or 'none'} (in {ckpt_dir})")
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's start-up banner off the user's stderr
    import tensorflow as tf

    from worker.checkpoint import Checkpointer
    from worker.models import build_keras_model, get_named_weights
    from worker.normalize import RunningNorm, normalization

    spec = run_spec(run_dir)
    model = build_keras_model(arch, seed=0)
    norm_obs, norm_ret = normalization(arch, _hparams(spec))
    running = RunningNorm(arch.obs_shape if norm_obs else None, norm_ret)
    ckpt = Checkpointer(ckpt_dir, model, tf.keras.optimizers.Adam(), window=int(spec.get("return_window", 100)),
                        norm=running)
    if prefix is None:
        restored = ckpt.restore_latest()
        if restored is None:
            raise BadInput(f"no readable checkpoint in {ckpt_dir}", hint="try --checkpoint final")
        source = restored[2]
    else:
        try:
            ckpt.checkpoint.restore(str(prefix)).expect_partial()
        except (tf.errors.OpError, ValueError, AssertionError) as exc:
            raise BadInput(f"--checkpoint {prefix}: cannot restore it: {exc}") from None
        source = str(prefix)
        ckpt.load_norm()
    return get_named_weights(model), running.stats(), source


# ------------------------------------------------------------------------------------------------ playing
def play(policy: NumpyPolicy, env: Any, *, seed: int, record: bool = False,
         max_frames: int = DEFAULT_GIF_MAX_FRAMES, norm: NormStats = NormStats(),
         max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS) -> Episode:
    """One greedy episode on ``env`` (reset with ``seed``), observations normalised with ``norm``, cut at
    ``max_episode_steps`` (an env without a time limit, Flappy Bird say, can otherwise play forever)."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    frames: list[np.ndarray] = []
    total, length, done, cut = 0.0, 0, False, False
    if record:
        frames.append(np.asarray(env.render()))
    while not done:
        action, _, _ = policy.act(norm.obs(np.asarray(obs, np.float32)[None]), rng, greedy=True)
        obs, reward, terminated, truncated, info = env.step(policy.env_action(action[0]))
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


def _import_env_dir(run_dir: RunDir) -> None:
    """Put the run's ``--env-dir`` (from config.json) first on ``sys.path``, as ``up`` put it on the groups'
    PYTHONPATH, so a ``module:EnvId`` from the user's own modules can be made here too."""
    import sys

    cfg = read_json(run_dir.files.config) or {}
    env_dir = cfg.get("env_dir")
    if isinstance(env_dir, str) and Path(env_dir).is_dir() and env_dir not in sys.path:
        sys.path.insert(0, env_dir)


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
             max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS) -> dict[str, Any]:
    """Play ``episodes`` greedy episodes with the run's policy; the ``launcher.eval/v1`` document.

    Episode ``i`` is reset with ``seed + i``. With ``gif``, episode 0 is played on a rendering env and its
    frames written there (at most ``gif_max_frames``, evenly thinned; the frame time keeps real speed).

    Raises:
        BadInput: bad arguments or missing weights; MissingDependency: no renderer for ``gif``.
    """
    from launcher.schemas import EVAL_SCHEMA
    from worker.envs import make_env

    if episodes < 1:
        raise BadInput(f"--episodes must be >= 1, got {episodes}")
    started = time.monotonic()
    spec = run_spec(run_dir)
    env_id = str(spec["env_id"])
    env_args = dict(spec.get("env_args") or {})
    _import_env_dir(run_dir)
    loaded = load_weights(run_dir, checkpoint)
    policy = loaded.policy()
    if max_episode_steps < 1:
        raise BadInput(f"--max-episode-steps must be >= 1, got {max_episode_steps}")
    played: list[Episode] = []
    gif_doc: dict[str, Any] | None = None
    if gif is not None:
        renv = make_render_env(env_id, seed, env_args)
        try:
            ep = play(policy, renv, seed=seed, record=True, max_frames=gif_max_frames, norm=loaded.norm,
                      max_episode_steps=max_episode_steps)
            fps = float(renv.metadata.get("render_fps") or 30) * len(ep.frames) / max(ep.length + 1, 1)
        finally:
            renv.close()
        played.append(ep)
        count = write_gif(ep.frames, gif, fps=fps)
        gif_doc = {"path": str(gif.resolve()), "frames": count, "episode": 0}
    env = make_env(env_id, seed=seed, **env_args)
    try:
        for i in range(len(played), episodes):
            played.append(play(policy, env, seed=seed + i, norm=loaded.norm, max_episode_steps=max_episode_steps))
    finally:
        env.close()
    returns = [ep.ret for ep in played]
    scores = [ep.score for ep in played]
    have_scores = all(sc is not None for sc in scores)
    summary = read_json(run_dir.files.summary) or read_json(run_dir.files.status) or {}
    return {
        "schema": EVAL_SCHEMA, "run_id": run_dir.run_id, "env_id": env_id, "algo": spec.get("algo"),
        "checkpoint": loaded.checkpoint, "weights_from": loaded.source, "episodes": episodes, "seed": seed,
        "greedy": True, "returns": returns, "lengths": [ep.length for ep in played],
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


__all__ = ["LoadedPolicy", "architecture_of", "evaluate", "format_report", "load_weights", "play", "write_gif"]
