"""Collection overlaps learning (issue 17): the policy lag is bounded, visible, corrected and, when too old, dropped.

Real parts throughout: gymnasium's own vector envs, the numpy policy, TensorFlow's PPO learner, a real master
process on loopback with this test as its group, and the real CLI for whole runs (``trained_cartpole`` is the
session's default CartPole run, tests/run_fixtures.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

from tests.helpers import ROOT, SECRET, child_env, free_port, launcher_cmd, only_run, status_of, wait_for
from tests.policy_fixtures import builtin, numpy_context, policy_of
from worker.algorithms import hparams

from worker.algorithms.rollout import Collector
from worker.api import Payload, Schedule
from worker.contract import GroupAssignment, RunSpec
from worker.keras_convert import get_weights
from worker.protocol import Connection, MsgType, client_handshake
from worker.schedules import Scheduler, policy_lag
from worker.segments import EpisodeCounter


def progress_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "progress"]


# ------------------------------------------------------------------------------------------- pure parts
def test_a_round_drops_segments_older_than_the_bound_and_reports_the_lag_of_the_rest() -> None:
    rounds = Scheduler(Schedule.overlapped(max_lag=2, max_wait_s=60.0, round_size=8))
    seg = {"logp": np.zeros(3, np.float32)}
    for group, version in ((0, 9), (1, 8), (2, 7), (3, 3)):
        assert rounds.offer(f"link{group}", Payload(seg, group=group, version=version)) is False  # answered later
    taken = rounds.take(version=9)
    assert taken.links == ["link0", "link1", "link2", "link3"]  # every sender gets weights, the dropped one too
    assert taken.stale == 1 and len(taken.payloads) == 3  # version 3 is 6 behind: counted, not learned from
    assert taken.lags == [0, 1, 2] and len(rounds) == 0
    assert policy_lag(5, 7) == 0  # weights from before a resume are not "negative lag"


def test_the_synchronous_round_is_an_option_and_overlap_the_default() -> None:
    assert hparams.resolve("ppo", "CartPole-v1")["sync"] is False
    assert hparams.resolve("a3c", "CartPole-v1")["sync"] is False
    assert hparams.resolve("ppo", "CartPole-v1", {"sync": True})["sync"] is True
    # Snake keeps its documented synchronous round (docs/benchmarks.md has the measurements why).
    assert hparams.resolve("ppo", "launcher/Snake-v0")["sync"] is True
    assert hparams.resolve("ppo", "launcher/Snake-v0", {"sync": False})["sync"] is False
    with pytest.raises(ValueError, match="sync must be true or false, got 'yes'"):
        hparams.resolve("ppo", "CartPole-v1", {"sync": "yes"})


def test_next_step_autoreset_rows_are_masked_out_and_truncation_bootstraps() -> None:
    """CartPole's own vector env resets a finished copy on the *next* step (reward 0, action ignored)."""
    vec = gymnasium.make_vec("CartPole-v1", num_envs=2, vectorization_mode="vector_entry_point", max_episode_steps=5)
    algorithm, model = builtin(vec)
    ctx = numpy_context(algorithm, model)
    ctx._runtime.swap_in({k: np.full(v.shape, 0.01, np.float32) for k, v in get_weights(model).items()}, 3)
    pol = policy_of(ctx, "float32")
    col = Collector(vec, pol, gamma=0.99, lam=0.95, seed=0)
    seg = col.collect(12)
    # Per copy: steps 0-4 an episode (truncated), 5 a reset, 6-10 an episode, 11 a reset.
    assert seg.valid is not None and seg.valid.sum(axis=0).tolist() == [10, 10]
    assert seg.steps == 20 == col.total_steps and len(seg.flat()["obs"]) == 20
    assert seg.episode_lengths == [5, 5, 5, 5] and seg.episode_returns == [5.0] * 4
    # The truncated last step bootstraps from V(final obs) (positive here), a terminal one would not.
    v_final = pol.forward(seg.obs[5])[1]
    np.testing.assert_allclose(seg.returns[4], 1.0 + 0.99 * v_final, rtol=1e-5)


class _Through:
    """The group's counter seen through a plain proxy: the collector steps it as any env (the count per step)."""

    def __init__(self, counter: EpisodeCounter) -> None:
        self.counter = counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.counter, name)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_the_collector_counts_for_the_groups_counter_exactly_as_the_counter_would(mode: str) -> None:
    """Handed the group's EpisodeCounter, the collector steps the env inside and reports its own count once per
    segment: the same steps, episode returns and lengths, in the same order, as the counter counting each step of
    a twin env played the same way; the counter refuses to be stepped after that (two counts would mix)."""
    def twin() -> Any:
        return gymnasium.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync", max_episode_steps=9,
                                  vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode(mode)})

    folded, reference = EpisodeCounter(twin()), EpisodeCounter(twin())
    algorithm, model = builtin(folded)
    ctx = numpy_context(algorithm, model)
    ctx._runtime.swap_in({k: np.full(v.shape, 0.01, np.float32) for k, v in get_weights(model).items()}, 3)
    pol = policy_of(ctx, "float32")
    a = Collector(folded, pol, gamma=0.99, lam=0.95, seed=4)
    b = Collector(_Through(reference), pol, gamma=0.99, lam=0.95, seed=4)
    ended = 0
    for _ in range(5):
        sa, sb = a.collect(7), b.collect(7)
        np.testing.assert_array_equal(sa.actions, sb.actions)
        got, want = folded.take(), reference.take()
        assert got == want and got[0] == sa.steps
        assert got[1] == sa.episode_returns
        ended += len(got[1])
    assert ended >= 5, f"only {ended} episodes ended: the comparison saw too few"
    with pytest.raises(RuntimeError, match="counted by its collector"):
        folded.step(np.zeros(3, np.int64))


def test_the_learner_corrects_lagged_segments_with_truncated_importance_weights() -> None:
    """Lag 0: the weights are 1 (classic PPO). Behaviour log-probs far below the learner's: weights cut at rho_bar."""
    from worker.algorithms.ppo_update import PPOLearner

    algorithm, model = builtin(gymnasium.make("CartPole-v1"))
    hp = {**hparams.resolve("ppo", "CartPole-v1"), "epochs": 1, "minibatches": 1}
    learner = PPOLearner(model, hp, 0, continuous=False, n_outputs=2, obs_shape=(4,), obs_dtype="float32")
    pol = policy_of(numpy_context(algorithm, model), "float32")
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((64, 4)).astype(np.float32)
    actions, logp, _ = pol.act(obs, rng)
    batch = {"obs": obs, "actions": actions, "logp": logp, "advantages": rng.standard_normal(64).astype(np.float32),
             "returns": np.zeros(64, np.float32)}
    assert learner.update(batch)["is_weight"] == pytest.approx(1.0, abs=1e-4)
    lagged = learner.update({**batch, "logp": logp - 5.0})  # the behaviour policy made these actions rarer
    assert lagged["is_weight"] == pytest.approx(1.0, abs=1e-6)  # truncated at rho_bar = 1
    assert learner.update({**batch, "logp": logp + 1.0})["is_weight"] < 0.5  # over-represented: down-weighted


# ------------------------------------------------------------------------------------- a real master
def test_a_stale_segment_is_counted_and_not_applied(tmp_path: Path) -> None:
    """This test is group 0 of a real master process: a segment 10 versions old is dropped, a fresh one learned."""
    master, conn = _master_and_group_0(tmp_path, tmp_path, "ppo", checkpoint_every=1000)
    try:
        n, arrays = _cartpole_segment()
        conn.send(MsgType.TRAJ, {"version": -10, "env_steps": n}, arrays)
        assert _next_weights(conn) == 0  # answered ("unchanged"), so the group goes on, but nothing was learned
        st = wait_for(lambda: (lambda d: d if d.get("policy_lag", {}).get("dropped") else None)(status_of(tmp_path)),
                      10, "status.json to count the drop")
        assert st["updates"] == 0 and st["network"].get("dropped.stale") == 1
        assert st["policy_lag"] == {"mean": None, "max": 0, "dropped": 1}
        conn.send(MsgType.TRAJ, {"version": 0, "env_steps": n}, arrays)
        assert _next_weights(conn) == 1  # a fresh segment is learned from
        st = wait_for(lambda: (lambda d: d if d.get("updates") else None)(status_of(tmp_path)), 10, "the update")
        assert st["policy_lag"] == {"mean": 0.0, "max": 0, "dropped": 1}
        conn.close()
    finally:
        master.terminate()
        master.wait(timeout=60)


SLOW_CHECKPOINT = """
import time

from worker.algorithms.ppo import PPO, PPOLearnerRole


class SlowSave(PPOLearnerRole):
    def checkpoint(self):
        time.sleep(3.0)  # a learner whose save is slow (a large model, a slow disk)
        return super().checkpoint()


class SlowCheckpointPPO(PPO):
    learner = SlowSave
"""


def test_the_groups_get_new_weights_before_the_checkpoint_is_written(tmp_path: Path) -> None:
    """A checkpoint is written after the round's replies, so the groups play on with the new weights while it
    is written instead of waiting for it (issue 28: it was ~half of a group's waiting at 8 workers)."""
    (tmp_path / "slow_ckpt.py").write_text(SLOW_CHECKPOINT)
    master, conn = _master_and_group_0(tmp_path, tmp_path / "run", f"{tmp_path / 'slow_ckpt.py'}:SlowCheckpointPPO",
                                       checkpoint_every=1)
    saved = tmp_path / "run" / "checkpoints" / "ckpt-1.index"
    try:
        n, arrays = _cartpole_segment()
        conn.send(MsgType.TRAJ, {"version": 0, "env_steps": n}, arrays)
        assert _next_weights(conn) == 1
        assert not saved.exists(), "the reply waited for the checkpoint of its update"
        wait_for(lambda: saved.exists() or None, 30, "the checkpoint of update 1, written after the reply")
        conn.close()
    finally:
        master.terminate()
        master.wait(timeout=60)
    assert (tmp_path / "master.log").read_text().count("Traceback") == 0, (tmp_path / "master.log").read_text()


def _master_and_group_0(tmp_path: Path, results: Path, algo: str, *,
                        checkpoint_every: int) -> tuple[subprocess.Popen[bytes], Connection]:
    """A real master process for one group of one worker on CartPole (its log: ``tmp_path/master.log``), and this
    test joined as that group, holding the first weights (version 0). The caller terminates the master."""
    port = free_port()
    spec = RunSpec(run_id="master-test", env_id="CartPole-v1", algo=algo, seed=0, master_port=port,
                   results_dir=str(results), checkpoint_every=checkpoint_every, groups=(GroupAssignment(0, 1),),
                   hparams={"update_wait_s": 0.1})
    (tmp_path / "spec.json").write_text(spec.to_json())
    master = subprocess.Popen([sys.executable, "-m", "worker", "master", "--spec", str(tmp_path / "spec.json")],
                              cwd=ROOT, env=child_env(LAUNCHER_SECRET=SECRET, LAUNCHER_LOG_LEVEL="WARNING"),
                              stdout=open(tmp_path / "master.log", "wb"), stderr=subprocess.STDOUT)
    try:
        conn = wait_for(lambda: _join(port, spec), 120, "the master to accept group 0")
        assert _next_weights(conn) == 0
    except BaseException:
        master.terminate()
        master.wait(timeout=60)
        raise
    return master, conn


def _cartpole_segment(n: int = 8) -> tuple[int, dict[str, np.ndarray]]:
    """A PPO segment of ``n`` CartPole rows (zeros: what it teaches does not matter here)."""
    return n, {"obs": np.zeros((n, 4), np.float32), "actions": np.zeros(n, np.int64),
               "logp": np.full(n, -0.69, np.float32), "advantages": np.ones(n, np.float32),
               "returns": np.ones(n, np.float32), "ep_returns": np.zeros(0), "ep_lengths": np.zeros(0, np.int32)}


def _join(port: int, spec: RunSpec) -> Connection | None:
    import socket

    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None
    conn = Connection(s, max_frame_bytes=spec.max_frame_bytes, timeout_s=30)
    client_handshake(conn, SECRET.encode(), run_id=spec.run_id, group=0, workers=1, deadline=time.monotonic() + 60)
    return conn


def _next_weights(conn: Connection) -> int:
    while True:
        msg = conn.recv()
        if msg.type == MsgType.WEIGHTS:
            return int(msg.fields["version"])
        assert msg.type in (MsgType.HEARTBEAT, MsgType.SETUP), msg.type


# ------------------------------------------------------------------------------------------ whole runs
def test_the_default_run_overlaps_collection_and_its_lag_stays_within_the_bound(trained_cartpole: Any) -> None:
    run = trained_cartpole.run_dir
    bound = hparams.resolve("ppo", "CartPole-v1")["max_staleness"]
    lags = [r["policy_lag"] for r in progress_records(run)]
    last = lags[-1]
    assert 0 < last["mean"] <= bound and last["max"] <= bound, last  # lag > 0: groups did not wait for weights
    assert all(lag["max"] <= bound for lag in lags)
    final = json.loads((run / "status.json").read_text())["policy_lag"]
    assert final["max"] <= bound and final["dropped"] == last["dropped"]
    logs = "".join(p.read_text() for p in (run / "logs").glob("group-*.log"))
    assert "overlapped collection" in logs and "synchronous rounds" not in logs


def test_sync_true_gives_the_synchronous_round_with_lag_zero(tmp_path: Path) -> None:
    proc = subprocess.run(launcher_cmd("up", "--backend", "process", "--gpus", "none", "--workers", "2",
                                       "--env", "CartPole-v1", "--algo", "ppo", "--max-steps", "6000",
                                       "--set", "sync=true", "--results", str(tmp_path), "--json"),
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = only_run(tmp_path)
    status = json.loads((run / "status.json").read_text())
    assert status["updates"] >= 5
    assert status["policy_lag"] == {"mean": 0.0, "max": 0, "dropped": 0}
    assert all(r["policy_lag"]["max"] == 0 for r in progress_records(run))
    logs = "".join(p.read_text() for p in (run / "logs").glob("group-*.log"))
    assert "synchronous rounds" in logs
