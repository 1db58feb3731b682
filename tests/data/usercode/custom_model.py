"""Test data: a Keras model with a layer of the user's own, which has no numpy implementation, so the groups
act with TensorFlow. ``build(spaces, hparams)`` is a ``--model`` for the built-in PPO: (logits, value)."""

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="launcher_tests")
class Scaled(keras.layers.Layer):
    """x * a trained scalar: a custom layer."""

    def build(self, input_shape: Any) -> None:
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x: Any) -> Any:
        return x * self.scale


def build(spaces: Any, hparams: Any) -> Any:
    inp = keras.Input(spaces.obs_shape)
    h = Scaled()(keras.layers.Dense(32, activation="tanh")(inp))
    return keras.Model(inp, [keras.layers.Dense(spaces.n_actions)(h), keras.layers.Dense(1)(h)])
