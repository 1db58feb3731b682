"""What a group that holds the secret (a compromised one) can still make the master do (issue 14 item 3):
per-message caps tied to the run spec, and an inbox bounded in bytes.

Real objects throughout: the CartPole architecture, decoded protocol messages, the inbox with threads.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import pytest

from worker.algorithms import load_algorithm, resolve_hparams
from worker.api import Field, Spaces
from worker.envs import make_env
from worker.inbox import ByteBoundedInbox
from worker.protocol import Message, MsgType
from worker.validate import CLOSING_REASONS, check_payload

N_STEPS, WORKERS = 8, 2
CAP = N_STEPS * WORKERS  # 16: Algorithm.max_rows for a group of WORKERS envs


def schema_of(algo: str) -> dict[str, Field]:
    """The built-in's payload schema on CartPole (the model's weight shapes from the model it builds)."""
    env = make_env("CartPole-v1", seed=0)
    spaces = Spaces(env.observation_space, env.action_space)
    env.close()
    cls = load_algorithm(algo)
    a = cls(spaces, resolve_hparams(cls, algo, "CartPole-v1", spaces, {"n_steps": N_STEPS}))
    assert a.max_rows(WORKERS) == CAP
    shapes = {"pi_h0/kernel": (4, 64), "pi_h0/bias": (64,)}  # enough for A3C's gradient fields
    return dict(a.payload(shapes, tuple(shapes)))


@pytest.fixture(scope="module")
def ppo() -> dict[str, Field]:
    return schema_of("ppo")


@pytest.fixture(scope="module")
def a3c() -> dict[str, Field]:
    return schema_of("a3c")


def traj(rows: int, *, env_steps: int | None = None, episodes: int = 0) -> Message:
    arrays = {"obs": np.zeros((rows, 4), np.float32), "actions": np.zeros(rows, np.int64),
              "logp": np.full(rows, -0.69, np.float32), "advantages": np.zeros(rows, np.float32),
              "returns": np.zeros(rows, np.float32), "ep_returns": np.ones(episodes), "ep_lengths": np.ones(episodes, np.int32)}
    return Message(MsgType.TRAJ, {"version": 0, "env_steps": rows if env_steps is None else env_steps}, arrays)


def grads(losses: Any, *, env_steps: int = CAP) -> Message:
    arrays = {"g/pi_h0/kernel": np.zeros((4, 64), np.float32), "g/pi_h0/bias": np.zeros(64, np.float32),
              "ep_returns": np.zeros(0), "ep_lengths": np.zeros(0, np.int32)}
    if losses is not ...:
        arrays["losses"] = losses
    return Message(MsgType.TRAJ, {"version": 0, "env_steps": env_steps}, arrays)


def test_an_honest_segment_passes(ppo: dict[str, Field]) -> None:
    assert check_payload(traj(CAP, episodes=3), schema=ppo, max_steps=CAP) is None


@pytest.mark.parametrize("msg_args,reason", [
    ({"rows": CAP + 1}, "over_limit"),  # more rows than n_steps x workers
    ({"rows": CAP, "env_steps": 10_000_000}, "over_limit"),  # one frame adding 10 M env steps
    ({"rows": 4, "env_steps": 4, "episodes": 5}, "over_limit"),  # more episodes ended than steps taken
    ({"rows": 4, "env_steps": -1}, "malformed"),
])
def test_segments_bigger_than_the_spec_allows_are_refused(ppo: dict[str, Field], msg_args: dict, reason: str) -> None:
    got = check_payload(traj(**msg_args), schema=ppo, max_steps=CAP)
    assert got is not None and got.reason == reason
    assert got.reason in CLOSING_REASONS and got.closes  # a group that does this is broken or hostile: closed


def test_the_cap_follows_the_groups_workers() -> None:
    env = make_env("CartPole-v1", seed=0)
    spaces = Spaces(env.observation_space, env.action_space)
    cls = load_algorithm("ppo")
    a = cls(spaces, resolve_hparams(cls, "ppo", "CartPole-v1", spaces, {}))
    assert a.max_rows(1) == 64
    assert a.max_rows(16) == 1024


def test_a3c_gradients_with_their_losses_pass(a3c: dict[str, Field]) -> None:
    assert check_payload(grads(np.array([0.1, 2.0, 0.5], np.float32)), schema=a3c, max_steps=CAP) is None


@pytest.mark.parametrize("losses,detail", [
    (..., "'losses' is missing"),
    (np.array([1.0, 2.0], np.float32), "'losses' has shape (2,), the schema says (3,)"),
    (np.array([1.0, np.nan, 0.0], np.float32), "'losses' holds NaN or infinity"),
    (np.array([1.0, np.inf, 0.0], np.float32), "'losses' holds NaN or infinity"),
    (np.array([1, 2, 3]), "'losses' has dtype int64, the schema says float32"),
])
def test_a3c_losses_off_their_schema_are_refused_naming_the_field(a3c: dict[str, Field], losses: Any,
                                                                   detail: str) -> None:
    got = check_payload(grads(losses), schema=a3c, max_steps=CAP)
    assert got is not None and got.reason == "schema:losses" and detail in got.detail
    assert not got.closes  # a buggy actor keeps its connection; the payload is dropped and counted


def test_a3c_env_steps_are_capped_too(a3c: dict[str, Field]) -> None:
    got = check_payload(grads(np.zeros(3, np.float32), env_steps=CAP + 1), schema=a3c, max_steps=CAP)
    assert got is not None and got.reason == "over_limit"


# ------------------------------------------------------------------------------------------------ inbox


def test_the_inbox_is_bounded_in_bytes_not_messages() -> None:
    inbox: ByteBoundedInbox[str] = ByteBoundedInbox(max_bytes=100, max_items=1000)
    assert inbox.put("a", 60, timeout=0.1)
    assert not inbox.put("b", 60, timeout=0.1)  # 120 bytes would exceed the budget: the reader waits
    assert inbox.put("c", 40, timeout=0.1)
    assert inbox.nbytes == 100 and inbox.qsize() == 2
    assert inbox.get() == "a"
    assert inbox.put("b", 60, timeout=0.1)


def test_a_waiting_reader_resumes_when_the_learner_takes_a_message() -> None:
    inbox: ByteBoundedInbox[int] = ByteBoundedInbox(max_bytes=10)
    inbox.put(1, 10)
    done = threading.Event()
    threading.Thread(target=lambda: (inbox.put(2, 10), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # backpressure: the reader thread waits
    assert inbox.get(timeout=1) == 1
    assert done.wait(2) and inbox.get(timeout=1) == 2
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.05)


def test_one_message_larger_than_the_budget_still_gets_through_alone() -> None:
    inbox: ByteBoundedInbox[str] = ByteBoundedInbox(max_bytes=10)
    assert inbox.put("big", 50, timeout=0.1)
    assert not inbox.put("next", 1, timeout=0.1)
    assert inbox.get_nowait() == "big"


def test_the_masters_inbox_budget_follows_the_spec() -> None:
    from worker.contract import RunSpec
    from worker.master import inbox_budget

    assert inbox_budget(RunSpec(run_id="r", env_id="CartPole-v1", algo="ppo")) == 1 << 30  # 256 MiB frames: 1 GiB
    assert inbox_budget(RunSpec(run_id="r", env_id="CartPole-v1", algo="ppo", max_frame_bytes=1 << 20)) == 4 << 20
