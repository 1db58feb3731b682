"""Synchronous A2C for a 10x10 Snake with the recipe's CNN, written on worker.api (examples/README.md).

Every env plays its share of a round (``batch_steps`` over all workers); a step's value target is the recipe's:
1 when the snake eats a fruit before its episode ends, 0 when it dies or starves first. Steps whose target is
not known yet (no fruit and no end since) carry over to the next payload. The master takes one policy step
(cross-entropy on the logits times the advantage) and one value step (squared error), each with its own Adam
and every gradient tensor's norm clipped at 20, on the whole round; then all groups get the new weights.

    launcher up --backend process --algo examples/snake_a2c.py:SnakeA2C --env launcher/Snake-v0 --workers 32 \\
        --max-steps 3000000 --until-return 10
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from worker.api import Actor, Algorithm, Field, HParam, Learner, Payload, Rollout, Schedule, sample_categorical


class SnakePlayer(Actor):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.rollout = Rollout(ctx.envs, seed=ctx.seed)
        # Per env, the steps since its last fruit: (obs, action), waiting for their target.
        self.pending: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(ctx.num_envs)]

    def act(self, obs: np.ndarray) -> np.ndarray:
        return sample_categorical(self.ctx.policy(obs)[0], self.ctx.rng)  # softmax of the logits

    def collect(self) -> Mapping[str, np.ndarray]:
        steps = math.ceil(int(self.ctx.hparams["batch_steps"]) / self.ctx.algorithm.num_workers)
        seg = self.rollout.run(steps, self.act)
        obs, actions, labels = [], [], []
        for t in range(seg.valid.shape[0]):
            for i in np.flatnonzero(seg.valid[t]):
                self.pending[i].append((seg.obs[t, i], int(seg.actions[t, i])))
                ate, ended = seg.rewards[t, i] > 0, bool(seg.dones[t, i])
                if ate or ended:  # a fruit: 1 for every step since the last; an end without one: 0
                    obs += [o for o, _ in self.pending[i]]
                    actions += [a for _, a in self.pending[i]]
                    labels += [1.0 if ate else 0.0] * len(self.pending[i])
                    self.pending[i] = []
        shape = self.ctx.envs.single_observation_space.shape
        return {"obs": np.asarray(obs, np.uint8).reshape(-1, *shape),  # one-hot boards: 0/1 travel as bytes
                "actions": np.asarray(actions, np.int64), "labels": np.asarray(labels, np.float32)}


class SnakeLearner(Learner):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        import keras
        import tensorflow as tf

        hp, model, ops = ctx.hparams, ctx.model, keras.ops
        variables = [ctx.variables[n] for n in ctx.trainable]
        self.pi_opt, self.v_opt = keras.optimizers.Adam(float(hp["lr"])), keras.optimizers.Adam(float(hp["lr"]))
        self.pi_opt.build(variables)
        self.v_opt.build(variables)
        clip, ent_coef = float(hp["clip_norm"]), float(hp["ent_coef"])

        def step(optimizer: Any, loss_fn: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn()
            grads = [tf.clip_by_norm(g, clip) if g is not None else tf.zeros_like(v)
                     for g, v in zip(tape.gradient(loss, variables), variables)]
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        @tf.function(reduce_retracing=True)
        def train(obs: Any, actions: Any, labels: Any) -> Any:
            obs = ops.cast(obs, "float32")
            # BatchNormalization in inference mode, as the recipe's layers ran (their `training` was left False).
            advantages = labels - ops.reshape(model(obs, training=False)[1], (-1,))

            def policy_loss() -> Any:
                logits = model(obs, training=False)[0]
                logp = ops.log_softmax(logits)
                ce = -ops.take_along_axis(logp, actions[:, None], axis=1)[:, 0]
                entropy = -ops.sum(ops.exp(logp) * logp, axis=1)
                return ops.mean(ce * advantages) - ent_coef * ops.mean(entropy)

            def value_loss() -> Any:
                return ops.mean(ops.square(labels - ops.reshape(model(obs, training=False)[1], (-1,))))

            return ops.stack([step(self.pi_opt, policy_loss), step(self.v_opt, value_loss)])

        self.train = train

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        obs, actions, labels = (np.concatenate([p[k] for p in payloads]) for k in ("obs", "actions", "labels"))
        chunk, losses = int(self.ctx.hparams["batch_steps"]), []
        for s in range(0, len(labels), chunk):  # the recipe's training loop over chunks of the round
            losses.append(self.train(obs[s:s + chunk], actions[s:s + chunk], labels[s:s + chunk]).numpy())
        pi_loss, v_loss = np.mean(losses, axis=0) if losses else (0.0, 0.0)
        return {"pi_loss": float(pi_loss), "v_loss": float(v_loss), "fruit_rate": float(labels.mean()),
                "rows": float(len(labels))}

    def checkpoint(self) -> Mapping[str, Any]:
        return {"model": self.ctx.model, "pi_optimizer": self.pi_opt, "v_optimizer": self.v_opt}


class SnakeA2C(Algorithm):
    """Synchronous A2C with the Snake recipe's CNN, targets and update (32 actors and one learner)."""

    hparams = {
        "batch_steps": HParam(7000, "env steps per round over all workers, and the learner's chunk"),
        "lr": HParam(3e-4, "learning rate of both Adam optimisers (policy step, value step)"),
        "clip_norm": HParam(20.0, "each gradient tensor is clipped to this norm"),
        "ent_coef": HParam(0.0, "entropy bonus (the recipe's is off)"),
        "max_wait_s": HParam(30.0, "a round updates without a group that has not sent for this long"),
    }
    actor = SnakePlayer
    learner = SnakeLearner

    def model(self) -> Any:
        import keras

        if not self.spaces.discrete or len(self.spaces.obs_shape) != 3:
            raise ValueError("SnakeA2C needs image observations (H, W, C) and a Discrete action space")
        L = keras.layers
        obs = keras.Input(self.spaces.obs_shape)
        x = L.BatchNormalization()(L.Conv2D(100, 4, activation="relu")(obs))
        x = L.BatchNormalization()(L.Conv2D(200, 3, activation="relu")(x))  # on the first conv (a recipe bug)
        x = L.Flatten()(x)
        logits = L.Dense(self.spaces.n_actions)(L.Dense(200, activation="leaky_relu")(x))
        value = L.Dense(1)(L.Dense(200, activation="leaky_relu")(x))
        return keras.Model(obs, [logits, value])

    def schedule(self) -> Schedule:
        return Schedule.sync(max_wait_s=float(self.hp["max_wait_s"]))

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        return {"obs": Field("uint8", self.spaces.obs_shape, low=0, high=1), "actions": Field.actions(self.spaces),
                "labels": Field("float32", low=0, high=1)}

    def max_rows(self, num_envs: int) -> int:
        # This round's steps plus those carried over: at most 100 per env (the env ends 100 steps without fruit).
        return (math.ceil(int(self.hp["batch_steps"]) / self.num_workers) + 100) * max(1, int(num_envs))
