"""Synchronous A2C for a 10x10 Snake with the recipe's CNN, written on worker.api (examples/README.md).

Every env plays its share of a round (``batch_steps`` over all workers). A step's value target is the recipe's:
1 when the snake eats a fruit before its episode ends, else 0 (steps not resolved yet carry over); or, with
``target=gae`` (the departure that reaches the target, README), GAE from the value head. The master takes one
policy step and one value step, each with its own Adam and every gradient clipped at norm 20; then all groups
get the new weights. The recipe's settings are the defaults; the run to the target:

    launcher up --backend process --algo examples/snake_a2c.py:SnakeA2C --env launcher/Snake-v0 --workers 32 \\
        --max-steps 3000000 --until-return 10 --set target=gae --set batch_steps=2048 --set lr=5e-4 --set ent_coef=0.01
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from worker.api import Actor, Algorithm, Field, HParam, Learner, Payload, Rollout, Schedule, gae, sample_categorical


class SnakePlayer(Actor):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.rollout = Rollout(ctx.envs, seed=ctx.seed)
        # Per env, the steps since its last fruit: (obs, action), waiting for their target.
        self.pending: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(ctx.num_envs)]

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits, value = self.ctx.policy(obs)
        return sample_categorical(logits, self.ctx.rng), {"value": value.reshape(-1)}  # softmax of the logits

    def collect(self) -> Mapping[str, np.ndarray]:
        hp = self.ctx.hparams
        seg = self.rollout.run(math.ceil(int(hp["batch_steps"]) / self.ctx.algorithm.num_workers), self.act)
        if hp["target"] == "gae":  # the departure (examples/README.md): n-step targets from the value head
            gamma, value = float(hp["gamma"]), lambda o: self.ctx.policy(o)[1].reshape(-1)
            rewards = seg.rewards.copy()
            for (t, i), cut in seg.truncated_obs.items():  # starved: the game goes on in value
                rewards[t, i] += gamma * value(cut[None])[0]
            adv, ret = gae(rewards, seg.extras["value"], seg.dones, value(seg.next_obs), gamma, float(hp["lam"]))
            return {"obs": seg.rows(seg.obs).astype(np.uint8), "actions": seg.rows(seg.actions).astype(np.int64),
                    "labels": seg.rows(ret), "advantages": seg.rows(adv)}
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
        shape, n = self.ctx.envs.single_observation_space.shape, len(labels)
        return {"obs": np.asarray(obs, np.uint8).reshape(-1, *shape),  # one-hot boards: 0/1 travel as bytes
                "actions": np.asarray(actions, np.int64), "labels": np.asarray(labels, np.float32),
                "advantages": np.zeros(n, np.float32)}  # the learner's: label - value


class SnakeLearner(Learner):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        import keras
        import tensorflow as tf

        hp, model, ops = ctx.hparams, ctx.model, keras.ops
        variables = [ctx.variables[n] for n in ctx.trainable]
        self.pi_opt, self.v_opt = keras.optimizers.Adam(float(hp["lr"])), keras.optimizers.Adam(float(hp["lr"]))
        self.pi_opt.build(variables), self.v_opt.build(variables)
        clip, ent_coef, bootstrapped = float(hp["clip_norm"]), float(hp["ent_coef"]), hp["target"] == "gae"

        def step(optimizer: Any, loss_fn: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn()
            grads = [tf.clip_by_norm(g, clip) if g is not None else tf.zeros_like(v)
                     for g, v in zip(tape.gradient(loss, variables), variables)]
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        @tf.function(reduce_retracing=True)
        def train(obs: Any, actions: Any, labels: Any, advantages: Any) -> Any:
            obs = ops.cast(obs, "float32")
            # BatchNormalization in inference mode, as the recipe's layers ran (their `training` was left False).
            advantages = ((advantages - ops.mean(advantages)) / (ops.std(advantages) + 1e-8) if bootstrapped
                          else labels - ops.reshape(model(obs, training=False)[1], (-1,)))  # GAE normalised; or 1/0 - V

            def policy_loss() -> Any:
                logits = model(obs, training=False)[0]
                logp = ops.log_softmax(logits)
                ce = -ops.take_along_axis(logp, actions[:, None], axis=1)[:, 0]
                entropy = -ops.sum(ops.exp(logp) * logp, axis=1)
                return ops.mean(ce * advantages) - ent_coef * ops.mean(entropy)

            def value_loss() -> Any:  # squared error
                return ops.mean(ops.square(labels - ops.reshape(model(obs, training=False)[1], (-1,))))

            return ops.stack([step(self.pi_opt, policy_loss), step(self.v_opt, value_loss)])

        self.train = train

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        cols = [np.concatenate([p[k] for p in payloads]) for k in ("obs", "actions", "labels", "advantages")]
        chunk, losses, labels = int(self.ctx.hparams["batch_steps"]), [], cols[2]
        for s in range(0, len(labels), chunk):  # the recipe's training loop over chunks of the round
            losses.append(self.train(*(c[s:s + chunk] for c in cols)).numpy())
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
        "target": HParam("fruit", "fruit: the recipe's (1 if a fruit comes before the end, else 0); gae: bootstrapped"),
        "gamma": HParam(0.97, "discount of the bootstrapped target (target=gae)"),
        "lam": HParam(0.95, "GAE lambda (target=gae)"),
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
        fruit = self.hp["target"] == "fruit"  # the recipe's labels are 0 or 1; bootstrapped ones any finite value
        return {"obs": Field("uint8", self.spaces.obs_shape, low=0, high=1), "actions": Field.actions(self.spaces),
                "labels": Field("float32", low=0 if fruit else None, high=1 if fruit else None),
                "advantages": Field("float32")}

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> list[str]:
        return [] if hp["target"] in ("fruit", "gae") else [f"target must be fruit or gae, got {hp['target']!r}"]

    def max_rows(self, num_envs: int) -> int:
        # This round's steps plus those carried over: at most 100 per env (the env ends 100 steps without fruit).
        return (math.ceil(int(self.hp["batch_steps"]) / self.num_workers) + 100) * max(1, int(num_envs))
