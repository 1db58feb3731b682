"""The policy ``launcher eval`` plays: which weights (``--checkpoint``), how to act with them, read safely.

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

Split from :mod:`launcher.evaluate`, which plays the episodes and reports (and re-exports the names here that
callers import from it).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from launcher.errors import BadInput
from launcher.runs import RunDir
from worker.contract import EXTRA_PREFIX, POLICY_DOC_FILE
from worker.normalize import NormStats, check_stats
from worker.numpy_model import NumpyModel, Program
from launcher import safefs
from launcher.safefs import read_json_at as read_json  # never through a link a container planted (issue 14)


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


__all__ = ["GreedyPolicy", "LoadedPolicy", "PolicyDoc", "checkpoint_policy", "load_weights", "policy_doc"]
