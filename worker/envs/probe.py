"""``python -m worker.envs.probe ENV [--args JSON] [--algo REF] [--model REF] [--hparams JSON]``: make ``ENV``
once, exactly as the run's processes will, load the algorithm (and ``--model``'s function) and resolve its
hyper-parameters for that env, and print one JSON line saying what came out.

The launcher runs this where the worker groups will run (the host's interpreter for the process backend, a
throw-away container of the run's image for Docker) before it starts a run, so a missing env package is one
clear message instead of every group crashing. Standard output's last line is the result::

    {"ok": true, "info": {"env_id": ..., "obs_shape": [...], ...}, "algo": {"hparams": {...}, "docs": {...}}}
    {"ok": false, "error": {"kind": "missing_module", "module": ..., "missing": ..., "package": ..., "message": ...}}
    {"ok": false, "error": {"kind": "algo", "what": "import" | "name" | "type" | "hparams", "message": ...}}

Exit status 0 when the env was made and the algorithm loaded, 3 when not. Imports gymnasium and numpy, and the
algorithm's module (a user's module may import TensorFlow itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

EXIT_NOT_MADE = 3


def probe(env_id: str, env_args: dict[str, Any], algo: str | None = None, model: str | None = None,
          hparams: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result document for ``env_id`` made with ``env_args`` and, with ``algo``, the algorithm loaded and its
    hyper-parameters resolved with ``hparams`` (never raises for the env's or the user's own errors)."""
    from worker.envs import EnvError, describe_env, missing_library

    try:
        info = describe_env(env_id, **env_args)
    except EnvError as exc:
        return {"ok": False, "error": exc.to_dict()}
    except Exception as exc:  # noqa: BLE001 - the env's constructor may raise anything; report it
        if (lib := missing_library(exc)) is not None:  # e.g. pygame's mixer without libglib in the image
            lib.env_id = env_id
            return {"ok": False, "error": lib.to_dict()}
        return {"ok": False, "error": {"kind": "error", "env_id": env_id, "module": None, "missing": None,
                                       "package": None, "message": f"{type(exc).__name__}: {exc}"}}
    doc: dict[str, Any] = {"ok": True, "info": dataclasses.asdict(info)}
    if algo is not None:
        try:
            doc["algo"] = load(env_id, env_args, algo, model, hparams or {})
        except Exception as exc:  # noqa: BLE001 - a UserCodeError, or the user's tuned()/check_hparams raising
            from worker.algorithms import UserCodeError, describe

            what = exc.kind if isinstance(exc, UserCodeError) else "raised"
            message = exc.detail if isinstance(exc, UserCodeError) else describe(exc)
            return {"ok": False, "error": {"kind": "algo", "what": what, "message": message, "env_id": env_id,
                                           "module": None, "missing": None, "package": None}}
    return doc


def load(env_id: str, env_args: dict[str, Any], algo: str, model: str | None, hparams: dict[str, Any]) -> dict[str, Any]:
    """Load the algorithm (and the model function) as the run's processes will; its resolved hyper-parameters
    for this env and their docs."""
    from worker.algorithms import load_algorithm, load_model_fn, resolve_hparams
    from worker.api import Spaces
    from worker.envs import make_env

    cls = load_algorithm(algo)
    if model is not None:
        load_model_fn(model)
    env = make_env(env_id, seed=0, **env_args)
    try:
        spaces = Spaces(env.observation_space, env.action_space)
    finally:
        env.close()
    hp = resolve_hparams(cls, algo, env_id, spaces, hparams)
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "hparams": {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()},
            "docs": {k: h.doc for k, h in cls.hparams.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.envs.probe", description=__doc__.splitlines()[0])
    parser.add_argument("env", help="gymnasium id or module:EnvId")
    parser.add_argument("--args", default="{}", help="keyword arguments for gymnasium.make, as a JSON object")
    parser.add_argument("--algo", default=None, help="the algorithm: a built-in's name, MODULE:Class or FILE.py:Class")
    parser.add_argument("--model", default=None, help="a model function: MODULE:function or FILE.py:function")
    parser.add_argument("--hparams", default="{}", help="--set values, as a JSON object")
    args = parser.parse_args(argv)
    doc = probe(args.env, json.loads(args.args), args.algo, args.model, json.loads(args.hparams))
    sys.stdout.flush()
    print(json.dumps(doc))
    return 0 if doc["ok"] else EXIT_NOT_MADE


if __name__ == "__main__":
    sys.exit(main())
