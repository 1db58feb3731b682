"""A user's Keras model as a numpy program (worker.keras_convert, worker.numpy_model): every supported layer gives
Keras's own outputs on random inputs; anything else is named as the reason the groups act with TensorFlow; a
program read from the network or a results directory is checked before it runs. Real Keras, real numpy."""

from __future__ import annotations

import json
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import pytest

keras = pytest.importorskip("keras")
L = keras.layers

from worker.keras_convert import check_program, convert, get_weights, set_weights, to_program, weight_names  # noqa: E402
from worker.numpy_model import NumpyModel, Program  # noqa: E402

VEC = gym.spaces.Box(-3.0, 3.0, (6,), np.float32)
IMG = gym.spaces.Box(0.0, 1.0, (9, 9, 3), np.float32)


def randomise(model: Any, seed: int = 0) -> Any:
    """Non-trivial values for every weight (batch-norm statistics too), so an identity would not pass."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if "variance" in v.path:
            v.assign(rng.uniform(0.5, 2.0, v.shape).astype(np.float32))
        else:
            v.assign(rng.normal(0, 0.3, v.shape).astype(np.float32))
    return model


def vec_model(*layers: Any) -> Any:
    inp = keras.Input((6,))
    x = inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


def img_model(*layers: Any) -> Any:
    inp = keras.Input((9, 9, 3))
    x = inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


ACTIVATIONS = ["relu", "tanh", "sigmoid", "softmax", "softplus", "softsign", "elu", "selu", "leaky_relu", "silu",
               "gelu", "relu6", "hard_sigmoid", "exponential", "mish", "linear"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_matches_keras(activation: str) -> None:
    model = randomise(vec_model(L.Dense(8, activation=activation), L.Dense(3)))
    assert check_program(model, to_program(model), VEC) <= 1.0


CASES: dict[str, tuple[Callable[[], Any], Any]] = {
    "conv-same-strided": (lambda: img_model(L.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
                                            L.Flatten(), L.Dense(2)), IMG),
    "conv-valid-5x5": (lambda: img_model(L.Conv2D(5, 5, use_bias=False), L.GlobalAveragePooling2D()), IMG),
    "pooling": (lambda: img_model(L.MaxPooling2D(2, padding="same"), L.AveragePooling2D(2), L.Flatten()), IMG),
    "global-max": (lambda: img_model(L.Conv2D(3, 2), L.GlobalMaxPooling2D()), IMG),
    "batch-norm": (lambda: img_model(L.Conv2D(6, 3), L.BatchNormalization(), L.ReLU(), L.Flatten()), IMG),
    "batch-norm-no-scale": (lambda: vec_model(L.Dense(5), L.BatchNormalization(center=False, scale=False)), VEC),
    "layer-norm": (lambda: vec_model(L.Dense(7), L.LayerNormalization(), L.Dense(2)), VEC),
    "relu-options": (lambda: vec_model(L.Dense(5), L.ReLU(max_value=0.5, negative_slope=0.1, threshold=0.05)), VEC),
    "leaky-elu-softmax": (lambda: vec_model(L.Dense(5), L.LeakyReLU(0.3), L.ELU(0.7), L.Softmax()), VEC),
    "identities": (lambda: vec_model(L.Dense(5), L.Dropout(0.5), L.GaussianNoise(1.0), L.Activation("tanh")), VEC),
    "reshape-permute": (lambda: vec_model(L.Reshape((2, 3)), L.Permute((2, 1)), L.Flatten(), L.Dense(2)), VEC),
    "rescaling": (lambda: vec_model(L.Rescaling(2.0, offset=-1.0), L.Dense(3)), VEC),
    "sequential": (lambda: keras.Sequential([keras.Input((6,)), L.Dense(4, activation="tanh"), L.Dense(2)]), VEC),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_supported_layers_match_keras(name: str) -> None:
    make, space = CASES[name]
    model = randomise(make())
    program = to_program(model)
    assert check_program(model, program, space) <= 1.0
    assert [n for n, _ in program.weights] == weight_names(model)


def test_graphs_with_branches_shared_layers_and_several_outputs() -> None:
    inp = keras.Input((6,))
    shared = L.Dense(4, activation="tanh")
    a, b = shared(inp), shared(L.Rescaling(-1.0)(inp))  # one layer called twice
    merged = [L.Add()([a, b]), L.Subtract()([a, b]), L.Multiply()([a, b]), L.Average()([a, b]),
              L.Maximum()([a, b]), L.Minimum()([a, b]), L.Concatenate()([a, b, inp])]
    model = randomise(keras.Model(inp, [L.Dense(2)(m) for m in merged] + [inp]))  # the input itself an output
    program = to_program(model)
    assert len(program.outputs) == 8 and program.outputs[-1] == (-1, 0)
    assert check_program(model, program, VEC) <= 1.0


def test_uint8_frames_are_cast_as_keras_casts_them() -> None:
    space = gym.spaces.Box(0, 255, (8, 8, 2), np.uint8)
    inp = keras.Input((8, 8, 2), dtype="uint8")
    model = randomise(keras.Model(inp, L.Dense(3)(L.Flatten()(L.Conv2D(2, 3)(L.Rescaling(1 / 255)(inp))))))
    assert check_program(model, to_program(model), space) <= 1.0


class Scale(L.Layer):  # a layer of the user's own: no numpy implementation
    def call(self, x: Any) -> Any:
        return 2.0 * x


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.d = L.Dense(2)

    def call(self, x: Any) -> Any:
        return self.d(x)


@pytest.mark.parametrize("make,reason", [
    (lambda: vec_model(L.Reshape((2, 3)), L.LSTM(4)), "layer 'lstm' (LSTM): LSTM has no numpy implementation"),
    (lambda: vec_model(L.Lambda(lambda x: 2 * x)), "Lambda has no numpy implementation"),
    (lambda: vec_model(Scale()), "is not a stock Keras layer"),
    (lambda: vec_model(L.Dense(3, activation=lambda x: x)), "has no numpy implementation"),
    (lambda: img_model(L.Conv2D(2, 3, dilation_rate=2)), "dilated or grouped convolution"),
    (lambda: Subclassed(), "build it with the functional API"),
])
def test_a_model_that_cannot_act_in_numpy_says_which_layer(make: Callable[[], Any], reason: str) -> None:
    model = make()
    if isinstance(model, Subclassed):
        model(np.zeros((1, 6), np.float32))
    conversion = convert(model, VEC)
    assert conversion.program is None and reason in conversion.reason, conversion.reason


def test_named_outputs_need_tensorflow() -> None:
    inp = keras.Input((6,))
    model = keras.Model(inp, {"pi": L.Dense(2)(inp), "v": L.Dense(1)(inp)})
    conversion = convert(model, VEC)
    assert conversion.program is None and "named (dict) outputs" in conversion.reason


def test_a_wrong_numpy_implementation_would_be_caught_by_the_check() -> None:
    """The start-up check is what makes numpy acting safe: a program that computes something else fails it."""
    model = randomise(vec_model(L.Dense(4, activation="tanh"), L.Dense(2)))
    program = to_program(model)
    doc = program.to_dict()
    doc["nodes"][0]["config"]["activation"] = "sigmoid"  # not what Keras computes
    conversion_error = None
    try:
        check_program(model, Program.from_dict(doc), VEC)
    except ValueError as exc:
        conversion_error = str(exc)
    assert conversion_error is not None and "differ" in conversion_error


def test_programs_travel_as_json_and_weights_move_between_models_by_order() -> None:
    model = randomise(vec_model(L.Dense(4), L.Dense(2)))
    program = Program.from_dict(json.loads(json.dumps(to_program(model).to_dict())))
    runner = NumpyModel(program)
    runner.set_weights(get_weights(model), 7)
    x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
    np.testing.assert_allclose(runner(x)[0], model(x).numpy(), rtol=1e-4, atol=1e-5)
    # Another process's copy of the same model (its layers numbered differently) takes the weights by order.
    other = vec_model(L.Dense(4), L.Dense(2))
    assert weight_names(other) != weight_names(model)
    set_weights(other, get_weights(model), weight_names(model))
    np.testing.assert_allclose(other(x).numpy(), model(x).numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="has shape"):
        set_weights(vec_model(L.Dense(5), L.Dense(2)), get_weights(model), weight_names(model))


@pytest.mark.parametrize("mutate,problem", [
    (lambda d: d.update(version=99), "program version 99"),
    (lambda d: d["nodes"][0].update(op="Evil"), "no numpy implementation of 'Evil'"),
    (lambda d: d["nodes"][0].update(inputs=[[5, 0]]), "does not come before it"),
    (lambda d: d["nodes"][0].update(weights=["nope"]), "does not declare"),
    (lambda d: d.update(outputs=[[9, 0]]), "does not exist"),
    (lambda d: d.pop("nodes"), "not a model program"),
    (lambda d: d.update(nodes="x"), "not a model program"),
])
def test_a_program_from_the_network_is_checked_before_it_runs(mutate: Callable[[dict], Any], problem: str) -> None:
    doc = to_program(vec_model(L.Dense(4), L.Dense(2))).to_dict()
    mutate(doc)
    with pytest.raises(ValueError, match=problem):
        Program.from_dict(doc)


def test_the_master_decides_how_groups_act_from_the_conversion_and_acting() -> None:
    from worker.acting import Setup, decide_acting

    model = randomise(vec_model(L.Dense(4), L.Dense(2)))
    shapes = {n: tuple(v.shape) for n, v in zip(weight_names(model), model.weights)}
    converted = convert(model, VEC)
    program, acting, setup = decide_acting(converted, "auto", shapes, tuple(shapes), groups_wait=False)
    assert program is not None and acting["path"] == "numpy" and Setup.from_fields(setup).program == program
    _, forced, setup = decide_acting(converted, "tensorflow", shapes, tuple(shapes), groups_wait=True)
    assert forced == {"path": "tensorflow", "reason": "--acting tensorflow", "max_error": acting["max_error"]}
    assert setup["program"] is None and Setup.from_fields(setup).groups_wait
    lstm = convert(vec_model(L.Reshape((2, 3)), L.LSTM(4)), VEC)
    _, fallback, _ = decide_acting(lstm, "auto", shapes, (), groups_wait=False)
    assert fallback["path"] == "tensorflow" and "LSTM" in fallback["reason"]
    with pytest.raises(ValueError, match="--acting numpy, but the model cannot act in numpy: layer 'lstm"):
        decide_acting(lstm, "numpy", shapes, (), groups_wait=False)
