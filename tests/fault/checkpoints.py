"""``python -m tests.fault.checkpoints RUN_DIR``: restore every checkpoint of a run, each on its own, in a fresh
interpreter, and print what each holds as one JSON line (``tests.fault.helpers.verify_checkpoints`` reads it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def main(run: Path) -> int:
    """Print, as JSON, what each checkpoint the run's manager lists holds (see ``helpers.verify_checkpoints``)."""
    import tensorflow as tf

    from tests.policy_fixtures import builtin, learner_of
    from worker.checkpoint import COUNTERS, Checkpointer
    from worker.contract import RunSpec
    from worker.envs import make_env

    spec = RunSpec.from_json((run / "spec.json").read_text())
    env = make_env(spec.env_id, seed=0)
    out = []
    state = tf.train.get_checkpoint_state(str(run / "checkpoints"))
    listed = list(state.all_model_checkpoint_paths) if state is not None else []
    for path in listed:
        # Fresh variables each time (the run's algorithm, model and learner): nothing carries over between restores.
        learner = learner_of(*builtin(env, algo=spec.algo, env_id=spec.env_id, hparams=spec.hparams))
        ck = Checkpointer(run / "checkpoints", learner.checkpoint(), window=spec.return_window)
        entry: dict[str, Any] = {"path": os.path.basename(path), "ok": False, "error": None}
        try:
            # Read every tensor (each read checks the data file's CRCs), then restore it as the master does.
            reader = tf.train.load_checkpoint(path)
            entry["tensors"] = len([reader.get_tensor(name) for name in reader.get_variable_to_shape_map()])
            ck.checkpoint.restore(path).expect_partial()
            entry.update(ok=True, **dict(zip(COUNTERS, (int(v) for v in ck._counters.numpy()))))
        except (tf.errors.OpError, ValueError, AssertionError) as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.append(entry)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
