"""Issue 28 item 2: the built-in networks made in numpy before TensorFlow loads (worker/early.py) are what the
Keras model converts to, and the learner built afterwards agrees with what the groups were given."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.algorithms import build_model, load_algorithm, resolve_hparams
from worker.api import LearnerContext, Spaces
from worker.early import EarlyStart, early_start, initial_extras, numpy_network, orthogonal, verify
from worker.envs import make_env
from worker.keras_convert import set_weights, to_program, weight_names
from worker.models import Architecture

ENVS = ["CartPole-v1", "Pendulum-v1", "launcher/Snake-v0", "ALE/Pong-v5"]  # mlp discrete/Box, cnn, nature (C,H,W) uint8


def _built(env_id: str, algo_name: str = "ppo", seed: int = 3) -> tuple[object, object, object, Spaces]:
    env = make_env(env_id, seed=0)
    spaces = Spaces(env.observation_space, env.action_space)
    env.close()
    cls = load_algorithm(algo_name)
    algo = cls(spaces, resolve_hparams(cls, algo_name, env_id, spaces, {}), num_workers=2)
    model = build_model(algo, None, seed)
    names = weight_names(model)
    variables = dict(zip(names, model.weights))
    ctx = LearnerContext(spaces=spaces, hparams=algo.hp, model=model, variables=variables,
                         trainable=tuple(n for n, v in variables.items() if v.trainable), seed=seed, num_workers=2,
                         algorithm=algo, _progress=lambda: 0.0)
    return algo, model, algo.learner(ctx), spaces


@pytest.mark.parametrize("env_id", ENVS)
@pytest.mark.parametrize("algo_name", ["ppo", "a3c"])
def test_the_numpy_made_start_is_the_keras_model_and_the_learner_agrees(env_id: str, algo_name: str,
                                                                         tmp_path: Path) -> None:
    if env_id.startswith("ALE/"):
        pytest.importorskip("ale_py")
    algo, model, learner, spaces = _built(env_id, algo_name)
    early = early_start(algo, None, "auto", 3, tmp_path / "checkpoints", False, environ={})
    assert early is not None
    assert early.program.weights == to_program(model).weights  # names, shapes and order
    set_weights(model, early.weights)
    error = verify(early, model, learner.extras(), spaces.observation, seed=3)
    assert 0 <= error <= 1.0
    assert set(early.extras) == set(learner.extras())


def test_a_disagreement_is_named(tmp_path: Path) -> None:
    """What verify exists for: a program that does not compute what Keras does, a weight out of place, an extra
    the learner does not start with. Each is refused with what differs."""
    algo, model, learner, spaces = _built("CartPole-v1")
    early = early_start(algo, None, "auto", 3, tmp_path / "none", False, environ={})
    assert early is not None
    set_weights(model, early.weights)
    wrong_act = tuple(n if n.name != "pi_h0" else type(n)(n.op, n.name, {"activation": "relu"}, n.weights, n.inputs)
                      for n in early.program.nodes)
    bad = EarlyStart(type(early.program)(early.program.input_shape, early.program.input_dtype, wrong_act,
                                         early.program.outputs, early.program.weights), early.weights, early.extras, "")
    with pytest.raises(RuntimeError, match="disagrees with Keras"):
        verify(bad, model, learner.extras(), spaces.observation)
    swapped = list(early.program.weights)
    swapped[0], swapped[2] = swapped[2], swapped[0]
    moved = EarlyStart(type(early.program)(early.program.input_shape, early.program.input_dtype, early.program.nodes,
                                           early.program.outputs, tuple(swapped)), early.weights, early.extras, "")
    with pytest.raises(RuntimeError, match="weights differ .*v_h0/kernel"):
        verify(moved, model, learner.extras(), spaces.observation)
    extra = EarlyStart(early.program, early.weights, {**early.extras, "log_std": np.zeros(2, np.float32)}, "")
    with pytest.raises(RuntimeError, match="extras"):
        verify(extra, model, learner.extras(), spaces.observation)


def test_no_early_start_where_tensorflow_must_come_first(tmp_path: Path) -> None:
    algo, _, _, _ = _built("CartPole-v1")
    ck = tmp_path / "checkpoints"
    assert early_start(algo, None, "auto", 0, ck, False, environ={}) is not None
    assert early_start(algo, "mine.py:net", "auto", 0, ck, False, environ={}) is None  # --model
    assert early_start(algo, None, "tensorflow", 0, ck, False, environ={}) is None  # --acting tensorflow
    assert early_start(algo, None, "auto", 0, ck, True, environ={}) is None  # a recovering master
    assert early_start(algo, None, "auto", 0, ck, False, environ={"WORKER_EARLY_START": "0"}) is None
    ck.mkdir()
    (ck / "checkpoint").write_text("x")
    assert early_start(algo, None, "auto", 0, ck, False, environ={}) is None  # --resume: the checkpoint's weights


def test_orthogonal_kernels_are_orthogonal_with_their_gain() -> None:
    rng = np.random.default_rng(0)
    for shape in [(4, 64), (64, 2), (4, 4, 3, 16)]:
        k = orthogonal(shape, 2.0, rng).reshape(-1, shape[-1]).astype(np.float64)
        small = min(k.shape)
        gram = k.T @ k if k.shape[0] >= k.shape[1] else k @ k.T
        assert np.allclose(gram, 4.0 * np.eye(small), atol=1e-4), shape


def test_initial_extras_are_the_learners_before_any_update() -> None:
    algo, _, learner, _ = _built("Pendulum-v1")
    want, got = learner.extras(), initial_extras(algo)
    assert set(want) == set(got) and "log_std" in got
    for k in want:
        assert np.array_equal(np.asarray(want[k], np.float64), np.asarray(got[k], np.float64)), k


def test_the_same_seed_gives_the_same_start_and_another_seed_another() -> None:
    arch = Architecture("mlp", (4,), False, 2)
    a, b, c = numpy_network(arch, 1)[1], numpy_network(arch, 1)[1], numpy_network(arch, 2)[1]
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["pi_h0/kernel"], c["pi_h0/kernel"])


@pytest.mark.parametrize("early", [True, False])
def test_a_run_serves_its_groups_before_tensorflow_loads(tmp_path: Path, early: bool) -> None:
    """A real run (process backend): the master listens and serves the groups before it imports TensorFlow,
    their version-0 payloads are learned from, and the run says how its groups' first policy was made. With
    WORKER_EARLY_START=0 it starts the old way (TensorFlow first), as a benchmark's baseline does."""
    import json

    from tests.helpers import only_run, read_json, run_launcher

    extra = {} if early else {"WORKER_EARLY_START": "0"}
    out = run_launcher("up", "--backend", "process", "--gpus", "none", "--workers", "2", "--env", "CartPole-v1",
                       "--max-steps", "3000", "--results", str(tmp_path), "--json", timeout=300, **extra)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (started,) = [e for e in events if e.get("event") == "master_started"]
    assert started["tensorflow_loaded"] is (not early)
    assert read_json(run / "summary.json")["acting"] == "numpy"
    acting = read_json(run / "status.json")["acting"]
    assert acting["path"] == "numpy" and acting["max_error"] <= 1.0
    assert ("made in numpy before TensorFlow loaded" in acting["reason"]) is early, acting
    assert read_json(run / "summary.json")["updates"] >= 1
    master_log = (run / "logs" / "master.log").read_text()
    assert ("numpy-made first policy matches Keras" in master_log) is early
