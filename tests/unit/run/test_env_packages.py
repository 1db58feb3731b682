"""Env ids from packages and users' modules (``module:EnvId``), env arguments, the env probe and Atari, on real
gymnasium: worker/envs/__init__.py, worker/envs/probe.py, worker/envs/atari.py.

The modules are tests/data/envpkg/src/launcher_test_envpkg (a package that registers ``TinyPkg-v0`` on import)
and tests/data/userenv/lab_env.py (a lab's own module, ``LabTiny-v0``), put on ``sys.path`` per test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest

from worker.envs import EnvError, describe_env, make_env, make_vector_env, plain_id, split_env_id

DATA = Path(__file__).resolve().parents[2] / "data"
PKG_SRC = DATA / "envpkg" / "src"
USER_DIR = DATA / "userenv"


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PKG_SRC))
    monkeypatch.syspath_prepend(str(USER_DIR))


def test_split_and_plain_id() -> None:
    assert split_env_id("CartPole-v1") == (None, "CartPole-v1")
    assert split_env_id("launcher/Snake-v0") == (None, "launcher/Snake-v0")
    assert split_env_id("flappy_bird_gymnasium:FlappyBird-v0") == ("flappy_bird_gymnasium", "FlappyBird-v0")
    assert split_env_id("a.b.c:Env-v3") == ("a.b.c", "Env-v3")
    assert plain_id("flappy_bird_gymnasium:FlappyBird-v0") == "FlappyBird-v0"
    assert plain_id("CartPole-v1") == "CartPole-v1"
    for bad in ("a b:X-v0", ":X-v0", "mod:", "a:b:c", "1mod:X-v0"):
        with pytest.raises(EnvError, match="is not 'EnvId' or 'module:EnvId'") as err:
            split_env_id(bad)
        assert err.value.kind == "unknown_id"


def test_a_package_env_is_made_after_importing_its_module(on_path: None) -> None:
    env = make_env("launcher_test_envpkg:TinyPkg-v0", seed=3, length=7)
    steps, done = 0, False
    while not done:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        steps, done = steps + 1, term or trunc
    assert steps == 7, "the env argument length=7 reached the constructor"
    assert "TinyPkg-v0" in gymnasium.registry  # registered by the import, under its plain id
    info = describe_env("launcher_test_envpkg:TinyPkg-v0", length=5)
    assert info.env_id == "launcher_test_envpkg:TinyPkg-v0" and info.obs_shape == (4,) and info.n_actions == 2


def test_a_user_module_env_in_a_vector_env_with_arguments(on_path: None) -> None:
    envs = make_vector_env("lab_env:LabTiny-v0", 3, length=4)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (3, 2) and obs.dtype == np.float32
    for _ in range(4):
        _, _, term, _, _ = envs.step(np.ones(3, dtype=np.int64))
    assert term.all(), "length=4 ends every copy's episode at step 4"
    envs.close()


def test_a_module_that_is_not_there_names_it_and_what_to_install() -> None:
    with pytest.raises(EnvError) as err:
        make_env("no_such_env_pkg:Thing-v0", seed=0)
    e = err.value
    assert (e.kind, e.module, e.missing, e.package) == ("missing_module", "no_such_env_pkg", "no_such_env_pkg",
                                                         "no-such-env-pkg")
    assert "module 'no_such_env_pkg' cannot be imported" in str(e) and "install" in str(e)
    assert isinstance(e, ValueError), "callers that caught ValueError still do"


def test_a_module_whose_own_import_fails_names_what_it_needs(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_more_env.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError) as err:
        describe_env("needs_more_env:X-v0")
    assert err.value.missing == "not_installed_dependency_xyz" and err.value.module == "needs_more_env"
    assert "it needs 'not_installed_dependency_xyz', which is not installed" in str(err.value)


def test_an_unknown_id_in_a_module_suggests_what_it_registers(on_path: None) -> None:
    with pytest.raises(EnvError, match=r"unknown env id 'LabTiny-v1' \(after importing 'lab_env'\).*'LabTiny-v0'") \
            as err:
        make_env("lab_env:LabTiny-v1", seed=0)
    assert err.value.kind == "unknown_id" and err.value.env_id == "lab_env:LabTiny-v1"
    with pytest.raises(EnvError, match="did you mean 'CartPole-v1'"):
        make_vector_env("cartpole-v1", 2)


def test_arguments_the_env_refuses(on_path: None) -> None:
    with pytest.raises(EnvError, match=r"does not take the arguments \['colour'\]") as err:
        make_env("lab_env:LabTiny-v0", seed=0, colour="red")
    assert err.value.kind == "bad_args"
    with pytest.raises(EnvError) as err:
        make_vector_env("CartPole-v1", 2, colour="red")
    assert err.value.kind == "bad_args"


def test_a_missing_shared_library_is_named_with_its_system_package(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # As pygame's mixer fails in an image without libglib2.0-0: on import, or in the constructor.
    msg = "libgthread-2.0.so.0: cannot open shared object file: No such file or directory"
    (tmp_path / "needs_glib_env.py").write_text(f"raise ImportError({msg!r})\n")
    (tmp_path / "glib_ctor_env.py").write_text(
        "import gymnasium\nclass E(gymnasium.Env):\n    def __init__(self, **kw):\n"
        f"        raise NotImplementedError('mixer module not available (ImportError: ' + {msg!r} + ')')\n"
        "if 'GlibCtor-v0' not in gymnasium.registry:\n    gymnasium.register('GlibCtor-v0', entry_point=E)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError) as err:
        make_env("needs_glib_env:X-v0", seed=0)
    assert (err.value.kind, err.value.missing, err.value.package) == ("missing_library", "libgthread-2.0.so.0",
                                                                      "libglib2.0-0")
    from worker.envs.probe import probe

    doc = probe("glib_ctor_env:GlibCtor-v0", {})
    assert not doc["ok"] and doc["error"]["kind"] == "missing_library"
    assert doc["error"]["package"] == "libglib2.0-0" and doc["error"]["env_id"] == "glib_ctor_env:GlibCtor-v0"


def _probe(*args: str, pythonpath: str = "") -> tuple[int, dict]:
    import os

    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-m", "worker.envs.probe", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_probe_prints_one_json_line_and_exits_3_when_the_env_cannot_be_made() -> None:
    code, doc = _probe("lab_env:LabTiny-v0", "--args", '{"length": 3}', pythonpath=str(USER_DIR))
    assert code == 0 and doc["ok"] and doc["info"]["obs_shape"] == [2] and doc["info"]["n_actions"] == 2
    code, doc = _probe("lab_env:LabTiny-v0")  # without the directory on the path
    assert code == 3 and not doc["ok"]
    assert doc["error"]["kind"] == "missing_module" and doc["error"]["module"] == "lab_env"
    code, doc = _probe("launcher_test_envpkg:TinyPkg-v0", "--args", '{"length": 0}', pythonpath=str(PKG_SRC))
    assert code == 3 and doc["error"]["kind"] == "error" and "length must be >= 1" in doc["error"]["message"]


# ------------------------------------------------------------------------------------------------ Atari
def test_atari_ids_are_preprocessed_to_84x84x4_uint8() -> None:
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    info = describe_env("ALE/Pong-v5")
    assert info.obs_shape == (84, 84, 4) and info.obs_dtype == "uint8" and info.n_actions == 6 and info.image_like
    env = make_env("ALE/Pong-v5", seed=0)
    obs, _ = env.reset()
    assert obs.shape == (84, 84, 4) and obs.dtype == np.uint8
    assert env.unwrapped.ale is not None and env.unwrapped._frameskip == 1, "the wrapper skips frames, not ALE"
    obs, *_ = env.step(0)
    assert obs.shape == (84, 84, 4)
    env.close()
    envs = make_vector_env("ALE/Pong-v5", 2)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 84, 84, 4) and obs.dtype == np.uint8
    obs, *_ = envs.step(np.zeros(2, dtype=np.int64))
    assert obs.shape == (2, 84, 84, 4)
    envs.close()
    with pytest.raises(EnvError, match="frameskip") as err:
        make_env("ALE/Pong-v5", seed=0, frameskip=4)
    assert err.value.kind == "bad_args"
