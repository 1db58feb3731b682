"""``launcher up``: start a run and (attached) watch it to the end."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launcher.config import parse_hparam, resolve_config
from launcher.errors import BadInput


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start a training run", description=__doc__,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=None, help="number of workers (env instances) [8]")
    p.add_argument("--env", dest="env_id", default=None, help="gymnasium env id [CartPole-v1]")
    p.add_argument("--algo", choices=("ppo", "a3c"), default=None, help="algorithm [ppo]")
    p.add_argument("--backend", choices=("auto", "process", "docker", "swarm"), default=None,
                   help="where to run [auto: docker if an engine answers, else process]")
    p.add_argument("--results", default=None, help="results root; each run gets a directory in it [results]")
    p.add_argument("--max-steps", dest="max_steps", default=None, help="total env steps ('none': no limit) [1000000]")
    p.add_argument("--until-return", dest="until_return", type=float, default=None,
                   help="stop when the mean return of the last --return-window episodes reaches this")
    p.add_argument("--return-window", dest="return_window", type=int, default=None, help="episodes averaged [100]")
    p.add_argument("--seed", type=int, default=None, help="base seed [0]")
    p.add_argument("--gpus", default=None, help="auto | none | indices (0,2) | UUIDs [auto]")
    p.add_argument("--groups", type=int, default=None, help="number of worker groups [computed]")
    p.add_argument("--max-workers-per-group", dest="max_workers_per_group", type=int, default=None)
    p.add_argument("--timeout", dest="timeout_s", default=None, help="hard wall-clock limit (90s, 15m, 1h30m)")
    p.add_argument("--port", type=int, default=None, help="master port on 127.0.0.1 (process backend) [0: any]")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=None, help="updates between checkpoints")
    p.add_argument("--restart-budget", dest="restart_budget", type=int, default=None, help="restarts per worker group [3]")
    p.add_argument("--min-free-memory", dest="min_free_memory", default=None, help="per GPU, e.g. 8GiB [1GiB]")
    p.add_argument("--max-utilization", dest="max_utilization", type=float, default=None, help="percent [50]")
    p.add_argument("--image", default=None, help="container image (docker/swarm backends)")
    p.add_argument("--set", dest="hparams", action="append", default=None, metavar="KEY=VALUE",
                   help="algorithm hyper-parameter, e.g. --set lr=3e-4 (repeatable)")
    p.add_argument("--resume", default=None, metavar="RUN", help="continue RUN from its latest checkpoint")
    p.add_argument("--detach", action="store_const", const=True, default=None, help="return at once (docker)")
    p.add_argument("--json", action="store_const", const=True, default=None, help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = ("workers", "env_id", "algo", "backend", "results", "max_steps", "until_return", "return_window", "seed",
             "gpus", "groups", "max_workers_per_group", "timeout_s", "port", "checkpoint_every", "restart_budget",
             "min_free_memory", "max_utilization", "image", "detach", "json")
    flags = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if args.hparams:
        try:
            flags["hparams"] = dict(parse_hparam(h) for h in args.hparams)
        except ValueError as exc:
            raise BadInput(str(exc), hint="example: --set lr=3e-4 --set n_steps=128") from None
    return flags


def run(args: argparse.Namespace) -> int:
    from launcher.progress import make_reporter
    from launcher.up import resume_config, up

    flags = flags_from_args(args)
    if args.resume:
        cfg = resume_config({k: v for k, v in flags.items()}, Path(flags.get("results", "results")), args.resume)
    else:
        cfg, _ = resolve_config(flags)
    reporter = make_reporter(sys.stderr)
    try:
        result = up(cfg, on_event=reporter)
    finally:
        reporter.close()
    s = result.summary
    if cfg.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    else:
        mean = s.get("mean_return")
        sys.stdout.write(
            f"{result.state.value}: {result.message}\n"
            f"  run         {result.run_id}\n"
            f"  return      {'-' if mean is None else f'{mean:.2f}'} (mean of last {s.get('episodes_in_window', 0)} episodes)"
            f"{'' if cfg.until_return is None else f', target {cfg.until_return:g}'}\n"
            f"  env steps   {s.get('env_steps', 0)} in {result.wall_s:.1f} s, {s.get('updates', 0)} updates\n"
            f"  results     {cfg.results / result.run_id if not cfg.resume else cfg.results / result.run_id}\n")
    return int(result.exit_code)
