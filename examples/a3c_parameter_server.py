"""A3C with a parameter server on TF2, written on worker.api (examples/README.md tells what it replaces).

Groups play whole episodes. For each finished episode a group computes, with TensorFlow and the weights it
holds, the gradient of the actor-critic loss on per-episode normalised discounted returns, and pushes it;
the master applies every episode's gradient with Adam as it arrives (``Schedule.asynchronous``) and answers
that group alone with the current weights.

    launcher up --backend process --algo examples/a3c_parameter_server.py:A3CParameterServer \\
        --env CartPole-v1 --workers 2 --max-workers-per-group 1 --until-return 475
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from worker.api import Actor, Algorithm, Field, HParam, Learner, Payload, Rollout, Schedule, discounted_returns


def normalised_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted returns of one whole episode (no bootstrap), standardised over that episode."""
    ret = discounted_returns(rewards[:, None], np.zeros((len(rewards), 1)), 0.0, gamma)[:, 0]
    return ((ret - ret.mean()) / (ret.std() + 1e-9)).astype(np.float32)


class EpisodeWorker(Actor):
    """Steps the group's K envs; each collect ends once at least one episode has finished and returns one
    gradient row per finished episode. Episodes still running carry over to the next collect."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        import keras
        import tensorflow as tf

        hp, ops = ctx.hparams, keras.ops
        model = ctx.keras_model()  # TensorFlow in the group, with the weights now acting
        names = {id(v): n for n, v in ctx.variables().items()}
        self.names = [names[id(v)] for v in model.trainable_variables]
        variables, huber = model.trainable_variables, keras.losses.Huber(reduction=None)
        value_coef, ent_coef = float(hp["value_coef"]), float(hp["ent_coef"])

        @tf.function(reduce_retracing=True)
        def gradients(obs: Any, actions: Any, targets: Any) -> Any:
            with tf.GradientTape() as tape:
                probs, values = model(obs, training=True)
                values = ops.reshape(values, (-1,))
                log_all = ops.log(ops.clip(probs, 1e-8, 1.0))  # softmax probabilities, as the recipe's head
                logp = ops.take_along_axis(log_all, actions[:, None], axis=1)[:, 0]
                advantage = ops.stop_gradient(targets - values)
                actor = -ops.sum(logp * advantage)
                critic = ops.sum(huber(targets[:, None], values[:, None]))  # a Huber term per step, summed
                entropy = -ops.sum(probs * log_all)
                loss = actor + value_coef * critic - ent_coef * entropy
            return tape.gradient(loss, variables), loss

        self.gradients = gradients
        self.rollout = Rollout(ctx.envs, seed=ctx.seed)
        self.episodes: list[list[tuple[np.ndarray, int, float]]] = [[] for _ in range(ctx.num_envs)]

    def act(self, obs: np.ndarray) -> np.ndarray:
        probs = self.ctx.policy(obs)[0]
        u = self.ctx.rng.random((len(obs), 1))
        return np.minimum((u > probs.cumsum(axis=1)).sum(axis=1), probs.shape[1] - 1)  # inverse-CDF draw

    def collect(self) -> Mapping[str, np.ndarray]:
        hp, finished = self.ctx.hparams, []
        while not finished:
            seg = self.rollout.run(1, self.act)
            for i in np.flatnonzero(seg.valid[0]):
                ep = self.episodes[i]
                ep.append((seg.obs[0, i], int(seg.actions[0, i]), float(seg.rewards[0, i])))
                if seg.dones[0, i] or len(ep) >= int(hp["max_len"]):
                    finished.append(ep)
                    self.episodes[i] = []
        rows: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
        losses = []
        for ep in finished:
            obs = np.stack([s[0] for s in ep]).astype(np.float32)
            actions = np.asarray([s[1] for s in ep], np.int64)
            targets = normalised_returns(np.asarray([s[2] for s in ep], np.float32), float(hp["gamma"]))
            grads, loss = self.gradients(obs, actions, targets)
            for n, g in zip(self.names, grads):
                rows[n].append(np.asarray(g, np.float32))
            losses.append(float(loss))
        return {**{f"g/{n}": np.stack(r) for n, r in rows.items()}, "loss": np.asarray(losses, np.float32)}


class ParameterServer(Learner):
    """Applies each pushed episode gradient with one Adam optimiser, in the order they came."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        import keras

        self.optimizer = keras.optimizers.Adam(learning_rate=float(ctx.hparams["lr"]))
        self.variables = [ctx.variables[n] for n in ctx.trainable]
        self.optimizer.build(self.variables)

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        losses: list[float] = []
        for p in payloads:
            for row in range(p.rows):
                self.optimizer.apply_gradients(zip([p[f"g/{n}"][row] for n in self.ctx.trainable], self.variables))
            losses.extend(p["loss"].tolist())
        return {"loss": float(np.mean(losses)) if losses else 0.0, "episodes": float(len(losses))}


class A3CParameterServer(Algorithm):
    """A3C as a parameter server: episode gradients from the groups, applied by the master."""

    hparams = {
        "lr": HParam(0.003, "Adam learning rate of the parameter server"),
        "gamma": HParam(0.99, "discount factor"),
        "value_coef": HParam(1.0, "weight of the Huber critic loss"),
        "ent_coef": HParam(0.0, "entropy bonus (the recipe's is 0)"),
        "max_len": HParam(1000, "an episode longer than this is cut into pieces of this many steps"),
        "max_staleness": HParam(32, "gradients on weights more than this many versions old are dropped"),
    }
    actor = EpisodeWorker
    learner = ParameterServer
    checkpoint_every = 500  # an update per payload

    def model(self) -> Any:
        import keras

        if not self.spaces.discrete:
            raise ValueError("A3CParameterServer needs a Discrete action space (a softmax policy)")
        obs = keras.Input(self.spaces.obs_shape)
        trunk = keras.layers.Dense(128, activation="relu")(obs)
        probs = keras.layers.Dense(self.spaces.n_actions, activation="softmax")(trunk)
        value = keras.layers.Dense(1)(trunk)
        return keras.Model(obs, [probs, value])

    def schedule(self) -> Schedule:
        return Schedule.asynchronous(max_lag=int(self.hp["max_staleness"]))

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        # One row per finished episode: its gradient of every trainable variable and its loss.
        return {**{f"g/{n}": Field("float32", weights[n]) for n in trainable}, "loss": Field("float32")}

    def max_rows(self, num_envs: int) -> int:
        # A collect stops within max_len steps of its K envs (any episode reaching max_len is cut).
        return int(self.hp["max_len"]) * max(1, int(num_envs))
