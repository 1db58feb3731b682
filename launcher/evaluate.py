"""Evaluate a trained run: load its policy, play episodes greedily, report the return, draw a GIF.

Where the weights come from (``--checkpoint``):

* ``final`` (default): ``model/policy.npz``, exported by the master at the end;
* ``best``: ``model/best_policy.npz``, kept by the master whenever the windowed mean return improved;
* ``latest``: the policy saved with the newest checkpoint (``checkpoints/policy-<updates>.npz``): a run that was
  stopped or crashed;
* a path: a checkpoint prefix (``checkpoints/ckpt-190``, relative to the run or absolute) or an ``.npz``.

How to act comes from ``model/policy.json``, which the master writes when the run starts: the model's numpy
program (:mod:`worker.numpy_model`; no TensorFlow, and nothing of the run's code is imported) or, for a model
that acts with TensorFlow, ``model/final_model.keras`` loaded with Keras (a layer of your own needs your code:
``--code FILE.py``, named on the command line, never read from the run). Acting is greedy on the algorithm's
policy output: the argmax for Discrete actions, the output clipped to the bounds for a Box. Observations are
normalised as the groups normalised them when the learner's extras carry ``norm/obs_mean`` and ``norm/obs_var``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from launcher.errors import BadInput, MissingDependency
from launcher.eval_env import check_env, drop_run_paths, import_env_dir, run_spec
from launcher.runs import RunDir
from worker.contract import EXTRA_PREFIX, POLICY_DOC_FILE
from worker.normalize import NormStats, check_stats
from worker.numpy_model import NumpyModel, Program
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
class PolicyDoc:
    """``model/policy.json``, checked (the run's master wrote it: every field is typed before use)."""

    names: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    program: Program | None
    policy_output: int
    discrete: bool
    low: np.ndarray
    high: np.ndarray
    acting: str


@dataclass(frozen=True)
class LoadedPolicy:
    """Weights ready to act with, and where they came from."""

    doc: PolicyDoc
    weights: dict[str, np.ndarray]
    checkpoint: str  # final, best, latest, path
    source: str  # the file or checkpoint prefix read
    norm: NormStats = NormStats()  # the observation statistics the run acted with (none: not normalised)
    keras_model: Any = field(default=None, repr=False)  # TensorFlow-acting runs

    def policy(self) -> "GreedyPolicy":
        if self.doc.program is not None:
            model = NumpyModel(self.doc.program)
            model.set_weights(self.weights, 0)
            return GreedyPolicy(self.doc, model, self.norm)
        from worker.keras_convert import set_weights

        set_weights(self.keras_model, self.weights, list(self.doc.names))
        keras_model = self.keras_model
        return GreedyPolicy(self.doc, lambda obs: keras_model(obs, training=False), self.norm)


class GreedyPolicy:
    """The most probable action (Discrete) or the policy output clipped to the bounds (Box)."""

    def __init__(self, doc: PolicyDoc, model: Callable[[np.ndarray], Any], norm: NormStats) -> None:
        self.doc, self.model, self.norm = doc, model, norm

    def __call__(self, obs: Any) -> Any:
        x = self.norm.obs(np.asarray(obs, np.float32)[None]) if self.norm.obs_mean is not None else np.asarray(obs)[None]
        out = self.model(x)
        out = out if isinstance(out, (list, tuple)) else (out,)
        head = np.asarray(out[self.doc.policy_output])[0]
        if self.doc.discrete:
            return int(np.argmax(head))
        return np.clip(head, self.doc.low, self.doc.high)


def policy_doc(run_dir: RunDir) -> PolicyDoc:
    """How to act with the run's weights, from ``model/policy.json``. Raises BadInput when it is missing or not
    what the master writes (the message says which field)."""
    path = run_dir.files.model_dir / POLICY_DOC_FILE
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise BadInput(f"run {run_dir.run_id} has no readable {path.relative_to(run_dir.path)}",
                       hint="the master writes it when the run starts; a run made by a launcher before 0.2 "
                            "cannot be evaluated by this one")
    try:
        names = tuple(str(n) for n in doc["weights"])
        program = Program.from_dict(doc["program"]) if doc.get("program") is not None else None
        action = doc["action"]
        discrete = bool(action["discrete"])
        low = np.asarray(action.get("low") or [], np.float64)
        high = np.asarray(action.get("high") or [], np.float64)
        output = doc["policy_output"]
        if not isinstance(output, int) or isinstance(output, bool) or output < 0:
            raise ValueError(f"policy_output {output!r}")
        shapes = program.weight_shapes if program is not None else {}
        acting = str((doc.get("acting") or {}).get("path"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadInput(f"{path} is not a policy description this launcher can use: {exc}",
                       hint="is this a launcher results directory?") from None
    return PolicyDoc(names, shapes, program, output, discrete, low, high, acting)


def _npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The weights (float32) and the learner's extras (``x/*``) in an exported ``.npz``."""
    # model/ and checkpoints/ are written by the master container: opened without following a link, a regular
    # file only.
    try:
        with safefs.open_read(path.parent.parent, f"{path.parent.name}/{path.name}") as fh, np.load(fh) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise BadInput(f"cannot read the weights in {path}: {exc}",
                       hint="pick another --checkpoint (final, best, latest or a path)") from None
    weights = {k: v.astype(np.float32) for k, v in arrays.items() if not k.startswith(EXTRA_PREFIX)}
    extras = {k[len(EXTRA_PREFIX):]: v for k, v in arrays.items() if k.startswith(EXTRA_PREFIX)}
    return weights, extras


def checkpoint_policy(run_dir: RunDir, prefix: Path | None) -> Path:
    """The policy saved with the newest checkpoint (``prefix`` None) or with ``checkpoints/ckpt-N``."""
    ckpt_dir = run_dir.files.checkpoints
    saved = sorted(((int(p.stem.split("-")[1]), p) for p in ckpt_dir.glob("policy-*.npz")
                    if p.stem.split("-")[1].isdigit()), reverse=True)
    if prefix is None:
        if not saved:
            raise BadInput(f"run {run_dir.run_id} has no checkpoint in {ckpt_dir}",
                           hint="the master writes one every --checkpoint-every updates and when it stops")
        return saved[0][1]
    number = prefix.name.rpartition("-")[2]
    path = ckpt_dir / f"policy-{number}.npz"
    if not number.isdigit() or not path.exists():
        raise BadInput(f"--checkpoint {prefix}: no policy saved with that checkpoint ({path.name})",
                       hint=f"checkpoints of this run: {', '.join(f'ckpt-{n}' for n, _ in saved) or 'none'} "
                            f"(in {ckpt_dir})")
    return path


def load_weights(run_dir: RunDir, checkpoint: str = "final", *, code: str | None = None) -> LoadedPolicy:
    """The policy weights ``checkpoint`` names (see the module docstring); ``code``: a file or module of the
    user's to import before loading a TensorFlow-acting model (its custom layers).

    Raises:
        BadInput: the file or checkpoint is not there (the message says which and what exists), or its
            weights do not fit the run's model.
    """
    doc = policy_doc(run_dir)
    model_dir = run_dir.files.model_dir
    if checkpoint in ("final", "best"):
        path = model_dir / ("policy.npz" if checkpoint == "final" else "best_policy.npz")
        if not path.exists():
            hint = ("the master exports it when the run ends; for a stopped or crashed run use --checkpoint latest"
                    if checkpoint == "final" else
                    "the master keeps it once the mean return of a window exists; try --checkpoint final or latest")
            raise BadInput(f"run {run_dir.run_id} has no {path.relative_to(run_dir.path)}", hint=hint)
        kind = checkpoint
    elif checkpoint == "latest":
        path, kind = checkpoint_policy(run_dir, None), "latest"
    else:
        given = _resolve_path(run_dir, Path(checkpoint).expanduser())
        if given.suffix == ".npz":
            if not given.exists():
                raise BadInput(f"--checkpoint {checkpoint}: no such file {given}")
            path = given
        else:
            path = checkpoint_policy(run_dir, given)
        kind = "path"
    weights, extras = _npz(path)
    source = str(path)
    want = set(doc.names)
    if set(weights) != want:
        missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
        raise BadInput(f"the weights in {source} do not fit run {run_dir.run_id}'s model: missing {missing[:4]}, "
                       f"unexpected {extra[:4]}", hint="pick a checkpoint of this run")
    if doc.program is not None:
        try:
            NumpyModel(doc.program).check_weights(weights)
        except ValueError as exc:
            raise BadInput(f"the weights in {source} do not fit run {run_dir.run_id}'s model: {exc}",
                           hint="pick a checkpoint of this run") from None
    norm = NormStats.from_arrays(extras)
    if norm.obs_mean is not None:
        shape = doc.program.input_shape if doc.program is not None else np.shape(norm.obs_mean)
        problem = check_stats(norm.arrays(), tuple(shape), obs=True, ret=False)
        if problem is not None:
            raise BadInput(f"the normalisation statistics in {source} are unusable: {problem}",
                           hint="pick another --checkpoint (final, best, latest or a path)")
    keras_model = None if doc.program is not None else _keras_model(run_dir, code)
    return LoadedPolicy(doc, weights, kind, source, NormStats(norm.obs_mean, norm.obs_var), keras_model)


def _keras_model(run_dir: RunDir, code: str | None) -> Any:
    """A TensorFlow-acting run's model, from ``model/final_model.keras`` (the architecture; weights are set from
    the chosen checkpoint). ``code`` is imported first: the user's custom layers register themselves."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's start-up banner off the user's stderr
    path = run_dir.files.model_dir / "final_model.keras"
    if not path.exists():
        raise BadInput(f"run {run_dir.run_id} acted with TensorFlow and has no {path.relative_to(run_dir.path)} to "
                       "rebuild its model from", hint="the master exports it when the run ends")
    if code is not None:
        from worker.algorithms import UserCodeError, _import

        try:
            _import(code, code)
        except UserCodeError as exc:
            raise BadInput(f"--code {code}: {exc.detail}") from None
    import keras

    try:
        with safefs.open_read(path.parent.parent, f"{path.parent.name}/{path.name}") as fh:
            tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"launcher-eval-{os.getpid()}.keras"
            tmp.write_bytes(fh.read())
        try:
            model = keras.saving.load_model(tmp, compile=False, safe_mode=True)
        finally:
            tmp.unlink(missing_ok=True)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"cannot rebuild the model of run {run_dir.run_id} from final_model.keras: {exc}",
                       hint="a layer of your own needs your code: `launcher eval RUN --code path/to/file.py` "
                            "(the file that defines and registers it)") from None
    return model


def _resolve_path(run_dir: RunDir, given: Path) -> Path:
    """``given`` as is if absolute, else relative to the run, its checkpoints/ or the working directory."""
    if given.is_absolute():
        return given
    candidates = [run_dir.path / given, run_dir.files.checkpoints / given, Path.cwd() / given]
    for p in candidates:
        if p.exists() or Path(f"{p}.index").exists():
            return p
    return candidates[0]


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
