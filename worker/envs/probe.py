"""``python -m worker.envs.probe ENV [--args JSON]``: make ``ENV`` once, exactly as the run's processes will,
and print one JSON line saying what came out.

The launcher runs this where the worker groups will run (the host's interpreter for the process backend, a
throw-away container of the run's image for Docker) before it starts a run, so a missing env package is one
clear message instead of every group crashing. Standard output's last line is the result::

    {"ok": true, "info": {"env_id": ..., "obs_shape": [...], ...}}
    {"ok": false, "error": {"kind": "missing_module", "module": ..., "missing": ..., "package": ..., "message": ...}}

Exit status 0 when the env was made, 3 when it was not. Imports gymnasium and numpy only (no TensorFlow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

EXIT_NOT_MADE = 3


def probe(env_id: str, env_args: dict[str, Any]) -> dict[str, Any]:
    """The result document for ``env_id`` made with ``env_args`` (never raises for the env's own errors)."""
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
    return {"ok": True, "info": dataclasses.asdict(info)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.envs.probe", description=__doc__.splitlines()[0])
    parser.add_argument("env", help="gymnasium id or module:EnvId")
    parser.add_argument("--args", default="{}", help="keyword arguments for gymnasium.make, as a JSON object")
    args = parser.parse_args(argv)
    doc = probe(args.env, json.loads(args.args))
    sys.stdout.flush()
    print(json.dumps(doc))
    return 0 if doc["ok"] else EXIT_NOT_MADE


if __name__ == "__main__":
    sys.exit(main())
