"""TensorFlow pieces shared by the learners: action distributions (categorical for Discrete, diagonal
Gaussian for Box) and the model + optimiser every learner holds."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from worker.models import Architecture, build_keras_model, trainable_variables


def log_prob_entropy(model: Any, out: tf.Tensor, actions: tf.Tensor, continuous: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Log-probability of ``actions`` under the policy output ``out`` and the mean entropy."""
    if not continuous:
        logp_all = tf.nn.log_softmax(out)
        idx = tf.cast(actions, tf.int32)
        logp = tf.gather(logp_all, idx, axis=1, batch_dims=1)
        entropy = -tf.reduce_sum(tf.exp(logp_all) * logp_all, axis=1)
        return logp, tf.reduce_mean(entropy)
    log_std = model.log_std
    std = tf.exp(log_std)
    z = (tf.cast(actions, tf.float32) - out) / std
    logp = tf.reduce_sum(-0.5 * tf.square(z) - log_std - 0.5 * math.log(2 * math.pi), axis=1)
    entropy = tf.reduce_sum(log_std + 0.5 * math.log(2 * math.pi * math.e))
    return logp, entropy


class LearnerBase:
    """The Keras model, its Adam optimiser and the trainable variables, built once per learner."""

    def __init__(self, arch: Architecture, hp: Any, seed: int) -> None:
        self.arch = arch
        self.hp = dict(hp)
        self.model = build_keras_model(arch, seed)
        self.optimizer = tf.keras.optimizers.Adam(learning_rate=float(hp["lr"]), epsilon=1e-5)
        self.variables = trainable_variables(self.model)
        # Its slots made now, eagerly: made inside the first tf.function call instead, they force a second
        # trace of the whole update (measured: the first PPO update took 2.4x as long).
        self.optimizer.build(self.variables)

    def set_progress(self, done: float) -> float:
        """Follow the learning-rate schedule (``lr_schedule``): ``constant``, or ``linear`` from ``lr`` down to
        0 as the run's progress ``done`` (env steps / --max-steps, in [0, 1]) goes from 0 to 1, as cleanrl and
        the SB3 zoo anneal PPO for continuous control (late, smaller steps keep a narrow policy from being
        thrown off by one noisy round). Returns the rate now in use."""
        lr = float(self.hp["lr"])
        if self.hp.get("lr_schedule", "constant") == "linear":
            lr *= max(0.0, 1.0 - min(max(done, 0.0), 1.0))
        self.optimizer.learning_rate.assign(lr)
        return lr
