"""TensorFlow pieces the built-in actor-critic learners share: action distributions (categorical for Discrete,
diagonal Gaussian for Box) and the optimiser every learner holds.

The Gaussian's log standard deviation is state-independent and trained with the rest, but it is not part of
the Keras model: it is the learner's own variable (checkpointed, and sent to the groups with every weights
version as an extra), so any Keras model with a (policy output, value) pair of outputs fits, ``--model`` too.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import tensorflow as tf

LOG_STD_NAME = "log_std"


def log_prob_entropy(log_std: Any, out: tf.Tensor, actions: tf.Tensor, continuous: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Log-probability of ``actions`` under the policy output ``out`` and the mean entropy."""
    if not continuous:
        logp_all = tf.nn.log_softmax(out)
        idx = tf.cast(actions, tf.int32)
        logp = tf.gather(logp_all, idx, axis=1, batch_dims=1)
        entropy = -tf.reduce_sum(tf.exp(logp_all) * logp_all, axis=1)
        return logp, tf.reduce_mean(entropy)
    std = tf.exp(log_std)
    z = (tf.cast(actions, tf.float32) - out) / std
    logp = tf.reduce_sum(-0.5 * tf.square(z) - log_std - 0.5 * math.log(2 * math.pi), axis=1)
    entropy = tf.reduce_sum(log_std + 0.5 * math.log(2 * math.pi * math.e))
    return logp, entropy


def make_log_std(continuous: bool, n_outputs: int, init: float) -> tf.Variable | None:
    """The Gaussian policy's trained log standard deviation (None for Discrete actions)."""
    if not continuous:
        return None
    return tf.Variable(np.full(n_outputs, init, np.float32), name=LOG_STD_NAME, trainable=True)


class LearnerBase:
    """The model's trainable variables (plus the log standard deviation) and their Adam optimiser.

    Args:
        model: the Keras model: observations -> (policy logits or action mean, value).
        continuous: Box actions (a Gaussian policy) or Discrete (categorical).
        n_outputs: logits for Discrete(n), action dims for a Box.
        obs_shape, obs_dtype: one observation's shape and dtype (the update's input signature).
    """

    def __init__(self, model: Any, *, continuous: bool, n_outputs: int, obs_shape: tuple[int, ...],
                 obs_dtype: str, hp: Mapping[str, Any]) -> None:
        self.model = model
        self.continuous = continuous
        self.n_outputs = n_outputs
        self.obs_shape = tuple(obs_shape)
        self.obs_dtype = obs_dtype
        self.hp = dict(hp)
        self.log_std = make_log_std(continuous, n_outputs, float(hp.get("log_std_init", -0.5)))
        self.optimizer = tf.keras.optimizers.Adam(learning_rate=float(hp["lr"]), epsilon=1e-5)
        self.variables = list(model.trainable_variables) + ([self.log_std] if self.log_std is not None else [])
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
