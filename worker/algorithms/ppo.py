"""Clipped PPO, master side: the learner that turns queued trajectory segments into new weights."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from worker.algorithms.tfdist import LearnerBase, log_prob_entropy
from worker.models import Architecture


class PPOLearner(LearnerBase):
    """Holds the model and optimiser; :meth:`update` runs ``epochs`` x ``minibatches`` clipped steps."""

    def __init__(self, arch: Architecture, hp: Mapping[str, Any], seed: int) -> None:
        super().__init__(arch, hp, seed)
        self.rng = np.random.default_rng(seed)
        self._step = self._make_step()

    def _make_step(self) -> Any:
        model, opt, variables, hp, cont = self.model, self.optimizer, self.variables, self.hp, self.arch.continuous
        clip, vf, ent, max_norm = float(hp["clip"]), float(hp["vf_coef"]), float(hp["ent_coef"]), float(hp["max_grad_norm"])

        @tf.function(reduce_retracing=True)
        def step(obs: tf.Tensor, actions: tf.Tensor, old_logp: tf.Tensor, adv: tf.Tensor, ret: tf.Tensor) -> Any:
            adv = (adv - tf.reduce_mean(adv)) / (tf.math.reduce_std(adv) + 1e-8)
            with tf.GradientTape() as tape:
                out, value = model(obs, training=True)
                logp, entropy = log_prob_entropy(model, out, actions, cont)
                log_ratio = logp - old_logp
                ratio = tf.exp(log_ratio)
                pg = -tf.reduce_mean(tf.minimum(ratio * adv, tf.clip_by_value(ratio, 1 - clip, 1 + clip) * adv))
                v_loss = 0.5 * tf.reduce_mean(tf.square(ret - value))
                loss = pg + vf * v_loss - ent * entropy
            grads = tape.gradient(loss, variables)
            grads, norm = tf.clip_by_global_norm(grads, max_norm)
            opt.apply_gradients(zip(grads, variables))
            approx_kl = tf.reduce_mean((ratio - 1) - log_ratio)
            clipfrac = tf.reduce_mean(tf.cast(tf.abs(ratio - 1) > clip, tf.float32))
            return pg, v_loss, entropy, approx_kl, clipfrac, norm

        return step

    def update(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Run the PPO epochs on one batch (keys: obs, actions, logp, advantages, returns)."""
        n = len(batch["logp"])
        mb = max(1, n // int(self.hp["minibatches"]))
        stats = np.zeros(6)
        count = 0
        tensors = {k: tf.convert_to_tensor(v) for k, v in batch.items()}
        for _ in range(int(self.hp["epochs"])):
            order = self.rng.permutation(n)
            for start in range(0, n - mb + 1, mb):
                idx = tf.convert_to_tensor(order[start:start + mb])
                out = self._step(*(tf.gather(tensors[k], idx) for k in ("obs", "actions", "logp", "advantages", "returns")))
                stats += np.array([float(x) for x in out])
                count += 1
        stats /= max(count, 1)
        return dict(zip(("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "grad_norm"), stats.tolist()))
