"""A small user algorithm for the test suite: REINFORCE with a value baseline on a discrete action space, written
only against the public API (worker.api), Keras and numpy, as a user would write it.

The ``fault`` hyper-parameter makes it misbehave on purpose, one way at a time, for the tests of what the
launcher does with bad user code: ``actor_init`` / ``collect`` (the actor raises), ``update`` (the learner
raises), ``bad_field`` (every other payload breaks its own schema), ``diverge`` (the learner returns non-finite
weights from its fourth update on).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from worker.api import (Actor, ActorContext, Algorithm, Field, HParam, Learner, LearnerContext, Payload, Rollout,
                        Schedule, discounted_returns, sample_categorical)


class ReinforceActor(Actor):
    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        if ctx.hparams["fault"] == "actor_init":
            raise RuntimeError("the actor refused to start (fault=actor_init)")
        self.rollout = Rollout(ctx.envs, seed=ctx.seed)
        self.sent = 0

    def collect(self) -> Mapping[str, np.ndarray]:
        hp = self.ctx.hparams
        if hp["fault"] == "collect":
            raise RuntimeError("the actor broke while collecting (fault=collect)")

        def act(obs: np.ndarray) -> Any:
            logits, value = self.ctx.policy(obs)
            return sample_categorical(logits, self.ctx.rng), {"value": value[:, 0]}

        seg = self.rollout.run(int(hp["n_steps"]), act)
        last = self.ctx.policy(seg.next_obs)[1][:, 0]
        ret = discounted_returns(seg.rewards, seg.dones, last, float(hp["gamma"]))
        self.sent += 1
        obs = seg.rows(seg.obs).astype(np.float32)
        if hp["fault"] == "bad_field" and self.sent % 2 == 0:
            obs = obs.astype(np.float64)  # not what the schema says
        return {"obs": obs, "actions": seg.rows(seg.actions).astype(np.int64),
                "returns": seg.rows(ret), "values": seg.rows(seg.extras["value"]).astype(np.float32)}


class ReinforceLearner(Learner):
    def __init__(self, ctx: LearnerContext) -> None:
        super().__init__(ctx)
        import keras

        self.optimizer = keras.optimizers.Adam(float(ctx.hparams["lr"]))
        self.updates = 0

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        import tensorflow as tf

        hp = self.ctx.hparams
        if hp["fault"] == "update":
            raise ZeroDivisionError("the learner divided by zero (fault=update)")
        obs, actions, returns, values = (np.concatenate([p[k] for p in payloads])
                                         for k in ("obs", "actions", "returns", "values"))
        adv = returns - values
        model = self.ctx.model
        with tf.GradientTape() as tape:
            logits, value = model(obs, training=True)
            logp = tf.gather(tf.nn.log_softmax(logits), actions, axis=1, batch_dims=1)
            loss = -tf.reduce_mean(logp * adv) + 0.5 * tf.reduce_mean(tf.square(returns - value[:, 0]))
        grads = tape.gradient(loss, model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        self.updates += 1
        if hp["fault"] == "diverge" and self.updates >= 4:
            model.trainable_variables[0].assign(np.full(model.trainable_variables[0].shape, np.nan, np.float32))
        return {"loss": float(loss), "advantage": float(np.mean(adv))}


class Reinforce(Algorithm):
    """REINFORCE with a learned baseline, synchronous rounds."""

    hparams = {"lr": HParam(3e-3, "Adam learning rate"), "gamma": HParam(0.99, "discount factor"),
               "n_steps": HParam(32, "steps of every env per payload"),
               "fault": HParam("", "misbehave on purpose (tests): actor_init, collect, update, bad_field, diverge")}
    actor = ReinforceActor
    learner = ReinforceLearner

    def model(self) -> Any:
        import keras

        inp = keras.Input(self.spaces.obs_shape)
        h = keras.layers.Dense(64, activation="tanh")(inp)
        return keras.Model(inp, [keras.layers.Dense(self.spaces.n_actions)(h), keras.layers.Dense(1)(h)])

    def schedule(self) -> Schedule:
        return Schedule.sync()

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        return {"obs": Field("float32", self.spaces.obs_shape), "actions": Field.actions(self.spaces),
                "returns": Field("float32"), "values": Field("float32")}
