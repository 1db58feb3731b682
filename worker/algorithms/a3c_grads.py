"""A3C's TensorFlow parts: the group computes actor-critic gradients on its own experience; the master applies
them asynchronously, as they arrive, and answers each with the current weights.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

from worker.algorithms.tfdist import LOG_STD_NAME, LearnerBase, log_prob_entropy, make_log_std


class A3CGradients:
    """Group side: gradients of the A3C loss with respect to the model's trainable variables and the log
    standard deviation, on the group's copy of the Keras model (``names``: the variables' names on the wire)."""

    def __init__(self, model: Any, names: Sequence[str], hp: Mapping[str, Any], *, continuous: bool,
                 n_outputs: int) -> None:
        self.model = model
        self.log_std = make_log_std(continuous, n_outputs, float(hp.get("log_std_init", -0.5)))
        self.variables = list(model.trainable_variables) + ([self.log_std] if self.log_std is not None else [])
        self.names = list(names) + ([LOG_STD_NAME] if self.log_std is not None else [])
        vf, ent, cont = float(hp["vf_coef"]), float(hp["ent_coef"]), continuous
        variables, log_std = self.variables, self.log_std

        @tf.function(reduce_retracing=True)
        def grads(obs: tf.Tensor, actions: tf.Tensor, adv: tf.Tensor, ret: tf.Tensor) -> Any:
            with tf.GradientTape() as tape:
                out, value = model(obs, training=True)
                value = tf.reshape(value, [-1])  # (B,) or (B, 1): a --model may end in Dense(1)
                logp, entropy = log_prob_entropy(log_std, out, actions, cont)
                pg = -tf.reduce_mean(logp * tf.stop_gradient(adv))
                v_loss = 0.5 * tf.reduce_mean(tf.square(ret - value))
                loss = pg + vf * v_loss - ent * entropy
            return tape.gradient(loss, variables), pg, v_loss, entropy

        self._grads = grads

    def compute(self, batch: Mapping[str, np.ndarray], log_std: np.ndarray | None
                ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Gradients of the loss on ``batch`` at the model's current weights (and ``log_std``), by name, and
        the loss terms."""
        if self.log_std is not None and log_std is not None:
            self.log_std.assign(log_std)
        g, pg, v_loss, entropy = self._grads(batch["obs"], batch["actions"], batch["advantages"], batch["returns"])
        named = {n: np.asarray(x.numpy(), dtype=np.float32) for n, x in zip(self.names, g)}
        return named, {"policy_loss": float(pg), "value_loss": float(v_loss), "entropy": float(entropy)}


class A3CLearner(LearnerBase):
    """Master side: applies pushed gradients (clipped by global norm) with one shared optimiser.

    ``names``: the trainable variables' names on the wire, in ``model.trainable_variables`` order."""

    def __init__(self, model: Any, names: Sequence[str], hp: Mapping[str, Any], **shape: Any) -> None:
        super().__init__(model, hp=hp, **shape)
        self.names = list(names) + ([LOG_STD_NAME] if self.log_std is not None else [])
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
