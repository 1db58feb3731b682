"""DPPO (clipped surrogate, a queue of segments) on Pendulum-v1, written on worker.api (examples/README.md).

Every env of a group plays 32-step segments with a Gaussian policy; a payload holds one segment of each of the
group's K envs, with discounted returns bootstrapped from the critic. The master queues payloads
(``Schedule.queue``) until they hold ``max_qsize`` segments, then takes ``pi_iter`` actor steps and ``v_iter``
critic steps on each segment in turn. One departure from the recipe (``old_policy``, see the README).

    launcher up --backend process --algo examples/dppo_pendulum.py:DPPO --env Pendulum-v1 --workers 4 \\
        --until-return -300 --max-steps 1000000
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from worker.api import Actor, Algorithm, Field, HParam, Learner, Payload, Rollout, Schedule, discounted_returns

POLICY_LAYERS, VALUE_LAYERS = ("pi_hidden", "pi_mu", "pi_sigma"), ("v_hidden", "v_out")


class SegmentWorker(Actor):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.rollout = Rollout(ctx.envs, seed=ctx.seed)

    def act(self, obs: np.ndarray) -> np.ndarray:
        mu, sigma, _ = self.ctx.policy(obs)
        return (mu + sigma * self.ctx.rng.standard_normal(mu.shape)).astype(np.float32)  # the env clips it

    def collect(self) -> Mapping[str, np.ndarray]:
        hp, policy = self.ctx.hparams, self.ctx.policy
        gamma = float(hp["gamma"])
        seg = self.rollout.run(int(hp["n_steps"]), self.act)
        rewards = np.where(seg.valid, (seg.rewards + hp["reward_shift"]) / hp["reward_scale"], 0.0)
        for (t, i), final_obs in seg.truncated_obs.items():  # a time limit: bootstrap from the state cut at
            rewards[t, i] += gamma * policy(final_obs[None])[2][0, 0]
        returns = discounted_returns(rewards.astype(np.float32), seg.dones, policy(seg.next_obs)[2][:, 0], gamma)

        def env_major(x: np.ndarray, dtype: Any) -> np.ndarray:  # (T, K, ...) -> (K*T, ...): segment after segment
            return np.ascontiguousarray(x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), dtype=dtype)

        return {"obs": env_major(seg.obs, np.float32), "actions": env_major(seg.actions, np.float32),
                "returns": env_major(returns, np.float32), "valid": env_major(seg.valid, bool)}


class SegmentLearner(Learner):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        import keras
        import tensorflow as tf

        hp, model, ops = ctx.hparams, ctx.model, keras.ops
        pi_vars = [v for n in POLICY_LAYERS for v in model.get_layer(n).trainable_variables]
        v_vars = [v for n in VALUE_LAYERS for v in model.get_layer(n).trainable_variables]
        self.pi_opt, self.v_opt = keras.optimizers.Adam(float(hp["pi_lr"])), keras.optimizers.Adam(float(hp["v_lr"]))
        self.pi_opt.build(pi_vars)
        self.v_opt.build(v_vars)
        eps, pi_iter, v_iter = float(hp["clip"]), int(hp["pi_iter"]), int(hp["v_iter"])
        per_segment, n_steps = hp["old_policy"] == "segment", int(hp["n_steps"])

        def log_prob(mu: Any, sigma: Any, a: Any) -> Any:
            return ops.sum(-0.5 * ops.square((a - mu) / sigma) - ops.log(sigma) - 0.5 * math.log(2 * math.pi), axis=1)

        def masked_mean(x: Any, mask: Any) -> Any:
            return ops.sum(x * mask) / ops.maximum(ops.sum(mask), 1.0)

        def pi_step(o: Any, a: Any, adv: Any, old_logp: Any, m: Any) -> Any:
            with tf.GradientTape() as tape:
                mu, sigma, _ = model(o, training=True)
                ratio = ops.exp(log_prob(mu, sigma, a) - old_logp)
                loss = -masked_mean(ops.minimum(ratio * adv, ops.clip(ratio, 1 - eps, 1 + eps) * adv), m)
            self.pi_opt.apply_gradients(zip(tape.gradient(loss, pi_vars), pi_vars))
            return loss

        def v_step(o: Any, r: Any, m: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = masked_mean(ops.square(r - ops.reshape(model(o, training=True)[2], (-1,))), m)
            self.v_opt.apply_gradients(zip(tape.gradient(loss, v_vars), v_vars))
            return loss

        @tf.function(jit_compile=bool(hp["jit_compile"]), reduce_retracing=True)
        def train(obs: Any, actions: Any, returns: Any, valid: Any) -> Any:
            mu, sigma, _ = model(ops.reshape(obs, (-1, *obs.shape[2:])))  # the policy at the update's start
            start_logp = ops.reshape(log_prob(mu, sigma, ops.reshape(actions, (-1, actions.shape[-1]))), (-1, n_steps))
            total = ops.zeros(2)
            for s in tf.range(ops.shape(obs)[0]):  # one segment at a time, as the recipe's queue
                o, a, r, m = obs[s], actions[s], returns[s], valid[s]
                mu, sigma, v = model(o)
                # The surrogate's old policy: the current one, made anew before each segment (the recipe), or
                # the one the update started from, which collected the queue (the default: see the README).
                old_logp = log_prob(mu, sigma, a) if per_segment else start_logp[s]
                adv = r - ops.reshape(v, (-1,))
                pi_loss = v_loss = ops.zeros(())
                for _ in tf.range(pi_iter):
                    pi_loss = pi_step(o, a, adv, old_logp, m)
                for _ in tf.range(v_iter):
                    v_loss = v_step(o, r, m)
                total += ops.stack([pi_loss, v_loss])
            return total / ops.cast(ops.maximum(ops.shape(obs)[0], 1), "float32")

        self.train = train

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        t = int(self.ctx.hparams["n_steps"])

        def segments(name: str) -> np.ndarray:  # every payload's K segments, stacked: (S, T, ...)
            return np.concatenate([p[name].reshape(-1, t, *p[name].shape[1:]) for p in payloads])

        valid = segments("valid").astype(np.float32)
        pi_loss, v_loss = self.train(segments("obs"), segments("actions"), segments("returns"), valid).numpy()
        return {"pi_loss": float(pi_loss), "v_loss": float(v_loss), "segments": float(len(valid))}

    def checkpoint(self) -> Mapping[str, Any]:
        return {"model": self.ctx.model, "pi_optimizer": self.pi_opt, "v_optimizer": self.v_opt}


class DPPO(Algorithm):
    """Distributed PPO with a segment queue, as in the classic DPPO recipes (Pendulum's values)."""

    hparams = {
        "n_steps": HParam(32, "steps of each env per segment (the recipe's BATCH_SIZE)"),
        "max_qsize": HParam(128, "update once this many segments are queued (MAX_QSIZE)"),
        "queue_payloads": HParam(0, "update once this many payloads are queued; 0: max_qsize / workers"),
        "old_policy": HParam("update", "update: the surrogate's old policy is the one the update starts from; "
                                       "segment: the current one, made anew before each segment (the recipe)"),
        "pi_iter": HParam(10, "actor steps per segment"),
        "v_iter": HParam(10, "critic steps per segment"),
        "pi_lr": HParam(1e-4, "actor Adam learning rate"),
        "v_lr": HParam(2e-4, "critic Adam learning rate"),
        "clip": HParam(0.2, "surrogate clipping range (epsilon)"),
        "gamma": HParam(0.9, "discount factor"),
        "reward_shift": HParam(8.0, "rewards are trained on as (r + reward_shift) / reward_scale"),
        "reward_scale": HParam(8.0, "see reward_shift"),
        "hidden": HParam(100, "units of the actor's and the critic's hidden layer"),
        "jit_compile": HParam(True, "compile the update with XLA (~25x faster per update; ~10-40 s to compile)"),
    }
    actor = SegmentWorker
    learner = SegmentLearner

    def model(self) -> Any:
        import keras

        if self.spaces.discrete:
            raise ValueError("DPPO needs a Box action space (a Gaussian policy)")
        n, units, ortho = self.spaces.n_actions, int(self.hp["hidden"]), keras.initializers.Orthogonal()
        obs = keras.Input(self.spaces.obs_shape)
        h = keras.layers.Dense(units, "relu", kernel_initializer=ortho, name="pi_hidden")(obs)
        mu = keras.layers.Dense(n, "tanh", kernel_initializer=ortho, name="pi_mu")(h)
        mu = keras.layers.Rescaling(2.0, name="pi_scale")(mu)  # 2 tanh: Pendulum's torque bound
        sigma = keras.layers.Dense(n, "softplus", kernel_initializer=ortho, name="pi_sigma")(h)
        v = keras.layers.Dense(1, name="v_out")(keras.layers.Dense(units, "relu", name="v_hidden")(obs))
        return keras.Model(obs, [mu, sigma, v])

    def schedule(self) -> Schedule:
        size = int(self.hp["queue_payloads"]) or math.ceil(int(self.hp["max_qsize"]) / self.num_workers)
        return Schedule.queue(max(1, size), max_lag=1)

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        s = self.spaces
        return {"obs": Field("float32", s.obs_shape), "actions": Field("float32", (s.n_actions,)),
                "returns": Field("float32"), "valid": Field("bool")}
