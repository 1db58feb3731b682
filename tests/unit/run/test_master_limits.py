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

from worker.algorithms import hparams
from worker.envs import make_env
from worker.inbox import ByteBoundedInbox
from worker.models import Architecture, expected_shapes
from worker.protocol import Message, MsgType
from worker.validate import CLOSING_REASONS, check_message, max_steps_per_message

N_STEPS, WORKERS = 8, 2
CAP = max_steps_per_message(N_STEPS, WORKERS)  # 16


@pytest.fixture(scope="module")
def arch() -> Architecture:
    env = make_env("CartPole-v1", seed=0)
    try:
        return Architecture.for_spaces(env.observation_space, env.action_space, hparams.resolve("ppo", "CartPole-v1"))
    finally:
        env.close()


def traj(rows: int, *, env_steps: int | None = None, episodes: int = 0) -> Message:
    arrays = {"obs": np.zeros((rows, 4), np.float32), "actions": np.zeros(rows, np.int64),
              "logp": np.full(rows, -0.69, np.float32), "advantages": np.zeros(rows, np.float32),
              "returns": np.zeros(rows, np.float32), "ep_returns": np.ones(episodes), "ep_lengths": np.ones(episodes, np.int32)}
    return Message(MsgType.TRAJ, {"version": 0, "env_steps": rows if env_steps is None else env_steps}, arrays)


def grads(arch: Architecture, losses: Any, *, env_steps: int = CAP) -> Message:
    arrays = {f"g/{k}": np.zeros(shape, np.float32) for k, shape in expected_shapes(arch).items()}
    arrays.update(ep_returns=np.zeros(0), ep_lengths=np.zeros(0, np.int32))
    fields: dict[str, Any] = {"version": 0, "env_steps": env_steps}
    if losses is not ...:
        fields["losses"] = losses
    return Message(MsgType.GRADS, fields, arrays)


def test_an_honest_segment_passes(arch: Architecture) -> None:
    assert check_message(traj(CAP, episodes=3), algo="ppo", arch=arch, max_steps=CAP) is None


@pytest.mark.parametrize("msg_args,reason", [
    ({"rows": CAP + 1}, "over_limit"),  # more rows than n_steps x workers
    ({"rows": CAP, "env_steps": 10_000_000}, "over_limit"),  # one frame adding 10 M env steps
    ({"rows": 4, "env_steps": 4, "episodes": 5}, "over_limit"),  # more episodes ended than steps taken
    ({"rows": 4, "env_steps": -1}, "malformed"),
])
def test_segments_bigger_than_the_spec_allows_are_refused(arch: Architecture, msg_args: dict, reason: str) -> None:
    got = check_message(traj(**msg_args), algo="ppo", arch=arch, max_steps=CAP)
    assert got == reason
    assert got in CLOSING_REASONS  # a group that does this is broken or hostile: its link is closed


def test_the_cap_follows_the_groups_workers() -> None:
    assert max_steps_per_message(64, 1) == 64
    assert max_steps_per_message(64, 16) == 1024


def test_a3c_gradients_with_numeric_losses_pass(arch: Architecture) -> None:
    assert check_message(grads(arch, {"pi": 0.1, "v": 2, "entropy": 0.5}), algo="a3c", arch=arch, max_steps=CAP) is None
    assert check_message(grads(arch, ...), algo="a3c", arch=arch, max_steps=CAP) is None  # no losses reported


@pytest.mark.parametrize("losses", [[1.0, 2.0], "x", {"pi": "nan"}, {"pi": float("inf")}, {"pi": 10**400},
                                    {"pi": True}, {f"k{i}": 1.0 for i in range(100)}, {"k" * 100: 1.0}, {"pi": [1]}])
def test_a3c_losses_that_are_not_a_small_object_of_numbers_are_malformed(arch: Architecture, losses: Any) -> None:
    # A list used to pass validation and then end the run with exit 1 in the learner's bookkeeping.
    assert check_message(grads(arch, losses), algo="a3c", arch=arch, max_steps=CAP) == "malformed"


def test_a3c_env_steps_are_capped_too(arch: Architecture) -> None:
    assert check_message(grads(arch, {}, env_steps=CAP + 1), algo="a3c", arch=arch, max_steps=CAP) == "over_limit"


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
