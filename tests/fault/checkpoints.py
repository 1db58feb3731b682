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

    from worker.algorithms import hparams as hparams_mod
    from worker.checkpoint import COUNTERS, Checkpointer
    from worker.envs import make_env
    from worker.models import Architecture
    from worker.spec import RunSpec

    spec = RunSpec.from_json((run / "spec.json").read_text())
    hp = hparams_mod.resolve(spec.algo, spec.env_id, spec.hparams)
    env = make_env(spec.env_id, seed=0)
    arch = Architecture.for_spaces(env.observation_space, env.action_space, hp)
    env.close()
    if spec.algo == "ppo":
        from worker.algorithms.ppo import PPOLearner as Learner
    else:
        from worker.algorithms.a3c import A3CLearner as Learner  # type: ignore[assignment]
    out = []
    state = tf.train.get_checkpoint_state(str(run / "checkpoints"))
    listed = list(state.all_model_checkpoint_paths) if state is not None else []
    for path in listed:
        learner = Learner(arch, hp, 0)  # fresh variables each time: nothing carries over between restores
        ck = Checkpointer(run / "checkpoints", learner.model, learner.optimizer, window=spec.return_window)
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
