"""A3C: worker groups compute actor-critic gradients on their own experience; the master applies them
asynchronously, as they arrive, and answers each with the current weights.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from worker.algorithms.tfdist import LearnerBase, log_prob_entropy
from worker.models import Architecture, build_keras_model, set_named_weights, trainable_variables, variable_name


class A3CGradients:
    """Group side: the same Keras model, used only to compute gradients of the A3C loss."""

    def __init__(self, arch: Architecture, hp: Mapping[str, Any], seed: int) -> None:
        self.arch = arch
        self.model = build_keras_model(arch, seed)
        self.variables = trainable_variables(self.model)
        self.names = [variable_name(v) for v in self.variables]
        vf, ent, cont = float(hp["vf_coef"]), float(hp["ent_coef"]), arch.continuous
        model, variables = self.model, self.variables

        @tf.function(reduce_retracing=True)
        def grads(obs: tf.Tensor, actions: tf.Tensor, adv: tf.Tensor, ret: tf.Tensor) -> Any:
            with tf.GradientTape() as tape:
                out, value = model(obs, training=True)
                logp, entropy = log_prob_entropy(model, out, actions, cont)
                pg = -tf.reduce_mean(logp * tf.stop_gradient(adv))
                v_loss = 0.5 * tf.reduce_mean(tf.square(ret - value))
                loss = pg + vf * v_loss - ent * entropy
            return tape.gradient(loss, variables), pg, v_loss, entropy

        self._grads = grads

    def compute(self, weights: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Gradients of the loss on ``batch`` at ``weights``, by variable name, and the loss terms."""
        set_named_weights(self.model, weights)
        g, pg, v_loss, entropy = self._grads(batch["obs"], batch["actions"], batch["advantages"], batch["returns"])
        named = {n: np.asarray(x.numpy(), dtype=np.float32) for n, x in zip(self.names, g)}
        return named, {"policy_loss": float(pg), "value_loss": float(v_loss), "entropy": float(entropy)}


class A3CLearner(LearnerBase):
    """Master side: applies pushed gradients (clipped by global norm) with one shared optimiser."""

    def __init__(self, arch: Architecture, hp: Mapping[str, Any], seed: int) -> None:
        super().__init__(arch, hp, seed)
        self.names = [variable_name(v) for v in self.variables]
        max_norm = float(hp["max_grad_norm"])
        variables, opt = self.variables, self.optimizer

        @tf.function(reduce_retracing=True)
        def apply(grads: list[tf.Tensor]) -> tf.Tensor:
            clipped, norm = tf.clip_by_global_norm(grads, max_norm)
            opt.apply_gradients(zip(clipped, variables))
            return norm

        self._apply = apply

    def apply(self, grads: Mapping[str, np.ndarray]) -> float:
        """Apply one group's gradients. Returns the pre-clipping global norm."""
        return float(self._apply([tf.convert_to_tensor(grads[n]) for n in self.names]))
