"""``launcher eval RUN``: play a trained policy greedily, report the return's mean and spread, draw a GIF."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launcher.errors import BadInput
from launcher.schemas import EVAL_SCHEMA


def register(sub: Any) -> None:
    from launcher.evaluate import DEFAULT_GIF_MAX_FRAMES, DEFAULT_MAX_EPISODE_STEPS, DEFAULT_SEED

    p = sub.add_parser("eval", help="evaluate a trained run's policy (return, GIF)",
                       description="Load a run's policy, play --episodes episodes greedily (no exploration noise), "
                                   "report the mean and spread of the return, and optionally write a GIF of one "
                                   "episode. Weights: final (model/policy.npz, default), best "
                                   "(model/best_policy.npz), latest (the policy saved with the newest checkpoint) or a "
                                   "path. Nothing of the run's code is imported: the model acts in numpy from "
                                   "model/policy.json, or (a model that acted with TensorFlow) from "
                                   "model/final_model.keras.")
    p.add_argument("run", metavar="RUN", help="run id (under --results) or the run's directory")
    p.add_argument("--episodes", type=int, default=10, metavar="N", help="episodes to play [10]")
    p.add_argument("--checkpoint", default="final", metavar="final|best|latest|PATH",
                   help="which weights [final]; PATH: a checkpoint prefix (checkpoints/ckpt-190) or an .npz")
    p.add_argument("--gif", type=Path, default=None, metavar="FILE", help="write episode 0 as an animated GIF")
    p.add_argument("--gif-max-frames", type=int, default=DEFAULT_GIF_MAX_FRAMES, metavar="N",
                   help=f"thin longer episodes to N frames [{DEFAULT_GIF_MAX_FRAMES}]")
    p.add_argument("--max-episode-steps", type=int, default=DEFAULT_MAX_EPISODE_STEPS, metavar="N",
                   help=f"cut an episode after N steps, for envs with no time limit [{DEFAULT_MAX_EPISODE_STEPS}]")
    p.add_argument("--code", default=None, metavar="FILE.py|MODULE",
                   help="your code to import first: the file that defines a custom layer of a TensorFlow-acting model")
    p.add_argument("--env-dir", type=Path, default=None, metavar="DIR",
                   help="your env modules (a module:EnvId of your own is made here too) [the run's `up --env-dir`, from the "
                        "launcher's record]")
    p.add_argument("--env", default=None, metavar="ID",
                   help="the env to play (default: the one the run was started with, from the launcher's record)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="N", help="episode i uses seed N+i")
    p.add_argument("--results", default=None, metavar="DIR", help="results root [as `launcher up`: launcher.toml, $LAUNCHER_RESULTS, or results]")
    p.add_argument("--json", action="store_true", help=f"print JSON ({EVAL_SCHEMA}) instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from launcher.evaluate import evaluate, format_report
    from launcher.runs import find_run

    if args.episodes < 1:
        raise BadInput(f"--episodes must be >= 1, got {args.episodes}")
    if args.gif_max_frames < 2:
        raise BadInput(f"--gif-max-frames must be >= 2, got {args.gif_max_frames}")
    from launcher.cli.runs import results_root

    doc = evaluate(find_run(results_root(args.results), args.run), episodes=args.episodes, checkpoint=args.checkpoint, seed=args.seed,
                   gif=args.gif, gif_max_frames=args.gif_max_frames, max_episode_steps=args.max_episode_steps,
                   code=args.code, env_dir=args.env_dir, env=args.env)
    sys.stdout.write((json.dumps(doc, indent=2) if args.json else format_report(doc)) + "\n")
    return 0
