"""The Snake env (worker/envs/snake.py) and the env helpers in worker/envs/__init__.py, on real gymnasium."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import worker.envs
from worker.envs import SNAKE_ID, EnvInfo, describe_env, describe_spaces, make_env
from worker.envs.snake import (
    BODY,
    BODY_COLOR,
    DOWN,
    FRUIT,
    FRUIT_COLOR,
    HEAD,
    HEAD_COLOR,
    LEFT,
    RIGHT,
    UP,
    SnakeEnv,
)

# A 3-cell snake in the middle of the board heading right, fruit straight ahead: (row, col), tail first.
STRAIGHT = [(5, 3), (5, 4), (5, 5)]


def _cells(obs: np.ndarray, channel: int) -> set[tuple[int, int]]:
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(obs[:, :, channel]), strict=True)}


def _seeded(seed: int = 0, **kwargs: object) -> SnakeEnv:
    env = SnakeEnv(**kwargs)  # type: ignore[arg-type]
    env.reset(seed=seed)
    return env


def test_check_env_passes_without_warnings() -> None:
    env = gymnasium.make(SNAKE_ID, render_mode="rgb_array").unwrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=False)


def test_reset_board() -> None:
    env = SnakeEnv()
    obs, info = env.reset(seed=3)
    assert obs.shape == (10, 10, 3) and obs.dtype == np.float32
    assert info == {"fruit": 0, "length": 3}
    assert _cells(obs, HEAD) == {(5, 5)}
    assert len(_cells(obs, BODY)) == 2 and len(_cells(obs, FRUIT)) == 1
    assert obs.sum(axis=2).max() == 1.0  # one-hot: no cell in two channels


def test_same_seed_same_episode_and_different_seeds_differ() -> None:
    def rollout(seed: int) -> list[tuple[bytes, float, bool, bool, dict[str, int]]]:
        env = gymnasium.make(SNAKE_ID)
        obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        trace: list[tuple[bytes, float, bool, bool, dict[str, int]]]
        trace = [(obs.tobytes(), 0.0, False, False, {})]
        for _ in range(300):
            obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
            trace.append((obs.tobytes(), float(reward), terminated, truncated, info))
            if terminated or truncated:
                obs, _ = env.reset()
                trace.append((obs.tobytes(), 0.0, False, False, {}))
        return trace

    assert rollout(7) == rollout(7)
    assert rollout(7) != rollout(8)


def test_observation_stays_consistent_with_info_under_random_play() -> None:
    env = SnakeEnv()
    rng = np.random.default_rng(0)
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        done = False
        while not done:
            assert len(_cells(obs, HEAD)) == 1
            assert len(_cells(obs, BODY)) == info["length"] - 1
            assert len(_cells(obs, FRUIT)) == 1
            assert obs.sum(axis=2).max() == 1.0
            obs, _, terminated, truncated, info = env.step(int(rng.integers(4)))
            done = terminated or truncated


def test_eating_a_fruit_rewards_one_grows_and_places_a_new_fruit() -> None:
    env = _seeded()
    env.load_state(STRAIGHT, fruit=(5, 6))
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert reward == 1.0 and not terminated and not truncated
    assert info == {"fruit": 1, "length": 4}
    assert _cells(obs, HEAD) == {(5, 6)}
    assert _cells(obs, BODY) == {(5, 3), (5, 4), (5, 5)}  # the tail stayed: the snake grew
    (fruit,) = _cells(obs, FRUIT)
    assert fruit not in {(5, 3), (5, 4), (5, 5), (5, 6)}

    # Next step without fruit: the snake moves, its length stays 4.
    obs, reward, _, _, info = env.step(UP)
    assert reward == 0.0 and info == {"fruit": 1, "length": 4}
    assert _cells(obs, HEAD) == {(4, 6)} and _cells(obs, BODY) == {(5, 4), (5, 5), (5, 6)}


def test_moving_without_fruit_keeps_length() -> None:
    env = _seeded()
    env.load_state(STRAIGHT, fruit=(0, 0))
    obs, reward, terminated, _, info = env.step(DOWN)
    assert reward == 0.0 and not terminated and info == {"fruit": 0, "length": 3}
    assert _cells(obs, HEAD) == {(6, 5)} and _cells(obs, BODY) == {(5, 4), (5, 5)}


def test_reversing_into_the_neck_continues_straight() -> None:
    env = _seeded()
    env.load_state(STRAIGHT, fruit=(0, 0))
    obs, _, terminated, _, _ = env.step(LEFT)  # heading right: left would hit the neck
    assert not terminated
    assert _cells(obs, HEAD) == {(5, 6)}


def test_a_one_cell_snake_may_reverse() -> None:
    env = _seeded(initial_length=1)
    env.load_state([(5, 5)], fruit=(0, 0))
    env.step(RIGHT)
    obs, _, terminated, _, _ = env.step(LEFT)
    assert not terminated and _cells(obs, HEAD) == {(5, 5)}


@pytest.mark.parametrize(
    ("snake", "action"),
    [
        ([(2, 0), (1, 0), (0, 0)], UP),
        ([(0, 2), (0, 1), (0, 0)], LEFT),
        ([(7, 9), (8, 9), (9, 9)], DOWN),
        ([(9, 7), (9, 8), (9, 9)], RIGHT),
    ],
)
def test_hitting_a_wall_terminates(snake: list[tuple[int, int]], action: int) -> None:
    env = _seeded()
    before, _ = env.load_state(snake, fruit=(5, 5))
    obs, reward, terminated, truncated, info = env.step(action)
    assert terminated and not truncated and reward == 0.0
    assert info == {"fruit": 0, "length": 3}
    np.testing.assert_array_equal(obs, before)  # the last legal board: the head cannot be drawn off it
    with pytest.raises(RuntimeError, match="reset"):
        env.step(action)


def test_death_penalty_is_configurable() -> None:
    env = _seeded(death_penalty=0.5)
    env.load_state([(2, 0), (1, 0), (0, 0)], fruit=(5, 5))
    _, reward, terminated, _, _ = env.step(UP)
    assert terminated and reward == -0.5


# Tail first; the head at (5, 5) came down from (4, 5), with the body hooked round to its left.
HOOK = [(6, 5), (6, 4), (5, 4), (4, 4), (4, 5), (5, 5)]


def test_running_into_the_body_terminates() -> None:
    env = _seeded()
    env.load_state(HOOK, fruit=(0, 0))
    _, reward, terminated, truncated, _ = env.step(LEFT)  # (5, 4) is body
    assert terminated and not truncated and reward == 0.0


def test_moving_into_the_cell_the_tail_leaves_is_allowed() -> None:
    env = _seeded()
    env.load_state(HOOK, fruit=(0, 0))
    obs, _, terminated, _, info = env.step(DOWN)  # (6, 5) is the tail, which moves away this step
    assert not terminated and info["length"] == 6
    assert _cells(obs, HEAD) == {(6, 5)}
    assert (6, 5) not in _cells(obs, BODY)


# A 4-cell snake chasing its tail round a 2x2 square never eats and never dies.
SQUARE = [(5, 5), (5, 6), (6, 6), (6, 5)]
ROUND = [UP, RIGHT, DOWN, LEFT]


@pytest.mark.parametrize("limit", [100, 7])
def test_steps_without_fruit_truncate(limit: int) -> None:
    kwargs = {} if limit == 100 else {"max_steps_without_fruit": limit}
    env = _seeded(**kwargs)
    env.load_state(SQUARE, fruit=(0, 0))
    for t in range(1, limit + 1):
        _, reward, terminated, truncated, _ = env.step(ROUND[(t - 1) % 4])
        assert reward == 0.0 and not terminated
        assert truncated == (t == limit), f"step {t}"


def test_eating_resets_the_truncation_clock() -> None:
    env = _seeded(max_steps_without_fruit=3)
    env.load_state(STRAIGHT, fruit=(5, 7))
    env.step(RIGHT)
    _, reward, _, truncated, _ = env.step(RIGHT)  # eats on step 2 of 3
    assert reward == 1.0 and not truncated
    env.load_state(SQUARE, fruit=(0, 0))  # now circle without fruit: truncated 3 steps later
    results = [env.step(a)[3] for a in ROUND[:3]]
    assert results == [False, False, True]


def test_filling_the_board_wins_and_terminates() -> None:
    env = _seeded(size=3, initial_length=1)
    # A snake covering 8 of the 9 cells, head at (1, 0) next to the fruit in the last free cell, (1, 1).
    snake = [(2, 0), (2, 1), (2, 2), (1, 2), (0, 2), (0, 1), (0, 0), (1, 0)]
    env.load_state(snake, fruit=(1, 1))
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert reward == 1.0 and terminated and not truncated
    assert info == {"fruit": 1, "length": 9}
    assert not _cells(obs, FRUIT)


@pytest.mark.parametrize("seed", range(5))
def test_fruit_goes_to_the_last_free_cell_on_a_crowded_board(seed: int) -> None:
    env = _seeded(seed, size=3, initial_length=1)
    # 7 of the 9 cells are snake; eating the fruit at (1, 0) leaves (1, 1) as the only free cell.
    env.load_state([(2, 0), (2, 1), (2, 2), (1, 2), (0, 2), (0, 1), (0, 0)], fruit=(1, 0))
    obs, reward, terminated, _, info = env.step(DOWN)
    assert reward == 1.0 and not terminated and info["length"] == 8
    assert _cells(obs, FRUIT) == {(1, 1)}


def test_load_state_rejects_impossible_boards() -> None:
    env = _seeded()
    with pytest.raises(ValueError, match="side by side"):
        env.load_state([(0, 0), (0, 2)])
    with pytest.raises(ValueError, match="overlap"):
        env.load_state([(0, 0), (0, 1), (0, 0)])
    with pytest.raises(ValueError, match="fruit"):
        env.load_state(STRAIGHT, fruit=(5, 4))


def test_bad_constructor_arguments_are_all_reported() -> None:
    with pytest.raises(ValueError) as excinfo:
        SnakeEnv(size=2, max_steps_without_fruit=0, death_penalty=-1.0)
    message = str(excinfo.value)
    assert "size=2" in message and "max_steps_without_fruit=0" in message and "death_penalty=-1.0" in message


def test_size_is_configurable_through_gymnasium_make() -> None:
    env = make_env(SNAKE_ID, seed=0, size=6)
    obs, _ = env.reset()
    assert obs.shape == (6, 6, 3) and env.observation_space.shape == (6, 6, 3)


def test_rgb_array_frame() -> None:
    env = SnakeEnv(render_mode="rgb_array")
    env.reset(seed=0)
    env.load_state(STRAIGHT, fruit=(0, 0))
    frame = env.render()
    assert frame is not None
    assert frame.shape == (200, 200, 3) and frame.dtype == np.uint8
    assert tuple(frame[5 * 20 + 10, 5 * 20 + 10]) == HEAD_COLOR  # the head cell's centre
    assert tuple(frame[5 * 20 + 10, 3 * 20 + 10]) == BODY_COLOR
    assert tuple(frame[10, 10]) == FRUIT_COLOR
    colours = {tuple(int(v) for v in px) for px in frame.reshape(-1, 3)}
    assert {HEAD_COLOR, BODY_COLOR, FRUIT_COLOR} <= colours
    assert SnakeEnv.metadata["render_fps"] > 0
    assert SnakeEnv().render() is None  # no render_mode: nothing to draw


def test_random_policy_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """Mean fruit per episode of a uniformly random policy: 0.178 over 500 episodes (seeds 0..499).

    Learning on launcher/Snake-v0 has to beat this. Printed so ``pytest -s`` shows the figure.
    """
    env = make_env(SNAKE_ID, seed=0)
    fruits, lengths = [], []
    for episode in range(500):
        env.reset(seed=episode)
        env.action_space.seed(episode)
        steps, done = 0, False
        while not done:
            _, _, terminated, truncated, info = env.step(env.action_space.sample())
            steps += 1
            done = terminated or truncated
        fruits.append(info["fruit"])
        lengths.append(steps)
    mean = float(np.mean(fruits))
    with capsys.disabled():
        print(
            f"\nrandom policy on {SNAKE_ID}: {mean:.3f} fruit/episode, "
            f"{np.mean(lengths):.1f} steps/episode (500 episodes)"
        )
    assert 0.1 < mean < 0.3  # a rules change that moves the baseline must update the docstrings too


# --- worker.envs helpers ---


def test_registration_is_idempotent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium warns when an id is registered twice
        worker.envs.register_envs()
        worker.envs.register_envs()
    assert gymnasium.spec(SNAKE_ID).entry_point == "worker.envs.snake:SnakeEnv"
    # Importing the package again (a reload, as a fresh interpreter would see it) must not warn either.
    # In a subprocess, so the reload cannot swap the classes other tests imported.
    code = (
        "import importlib, gymnasium, worker.envs; importlib.reload(worker.envs); "
        f"gymnasium.make({SNAKE_ID!r})"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_make_env_is_seeded() -> None:
    a = make_env(SNAKE_ID, seed=11)
    b = make_env(SNAKE_ID, seed=11)
    for _ in range(5):
        np.testing.assert_array_equal(a.reset()[0], b.reset()[0])
    assert a.action_space.sample() == b.action_space.sample()


def test_make_env_renders() -> None:
    env = make_env(SNAKE_ID, seed=0, render_mode="rgb_array")
    frame = env.render()
    assert isinstance(frame, np.ndarray) and frame.shape == (200, 200, 3)


def test_make_env_unknown_id_names_it_and_suggests_close_ids() -> None:
    with pytest.raises(ValueError) as excinfo:
        make_env("launcher/Snak-v0", seed=0)
    message = str(excinfo.value)
    assert "'launcher/Snak-v0'" in message and "'launcher/Snake-v0'" in message
    with pytest.raises(ValueError, match="'CartPole-v1'"):
        make_env("cartpole-v1", seed=0)
    with pytest.raises(ValueError, match="pprint_registry"):
        describe_env("NoSuchThingAtAll-v9")


def test_describe_env() -> None:
    snake = describe_env(SNAKE_ID)
    assert snake == EnvInfo(SNAKE_ID, (10, 10, 3), "float32", "discrete", n_actions=4)
    assert snake.image_like
    cartpole = describe_env("CartPole-v1")
    assert cartpole.obs_shape == (4,) and not cartpole.image_like and cartpole.n_actions == 2
    pendulum = describe_env("Pendulum-v1")
    assert pendulum.action_kind == "box" and pendulum.action_dim == 1
    assert pendulum.action_low == (-2.0,) and pendulum.action_high == (2.0,) and pendulum.n_actions is None


def test_describe_spaces_rejects_what_policies_cannot_handle() -> None:
    box = gymnasium.spaces.Box(0.0, 1.0, shape=(3,))
    with pytest.raises(ValueError, match="observation space"):
        describe_spaces("x", gymnasium.spaces.Discrete(5), gymnasium.spaces.Discrete(2))
    with pytest.raises(ValueError, match="action space"):
        describe_spaces("x", box, gymnasium.spaces.MultiDiscrete([2, 2]))
    with pytest.raises(ValueError, match="starts at 1"):
        describe_spaces("x", box, gymnasium.spaces.Discrete(2, start=1))
    with pytest.raises(ValueError, match="n_actions"):
        EnvInfo("x", (3,), "float32", "discrete")
