"""``launcher up``: start a run and (attached) watch it to the end.

Options come from :data:`launcher.config.OPTIONS`; each can also be set in ``launcher.toml`` (``[up]``) or a
``LAUNCHER_*`` variable, which flags override. On exit the launcher's result is printed (``--json``: the
``launcher.result/v1`` document) and written to the run's ``result.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launcher import __version__
from launcher.config import DEFAULTS, OPTIONS, Option, RunConfig, load_config, parse_hparam
from launcher.config.options import OWNERS, parse_env_arg
from launcher.errors import BadInput
from launcher.schemas import RESULT_SCHEMA
from worker.contract import RESULT_FILE

_EPILOG = ("Every option can also be set in launcher.toml ([up] table, key = flag name) or as LAUNCHER_<NAME> "
           "(e.g. LAUNCHER_MAX_STEPS); flags override the environment, which overrides the file. "
           "`launcher config show` prints the result. The options under \"options of --backend X\" are that "
           "backend's own: set for another backend, `up` refuses them (exit 2); with --backend auto, those of "
           "docker apply when an engine answers. Exit codes: docs/operator.md.")


def add_up_options(p: argparse.ArgumentParser, *, exclude: tuple[str, ...] = (),
                   only: tuple[str, ...] | None = None) -> None:
    """The ``up`` options (shared with ``launcher config show``; ``launcher plan`` takes ``only`` the
    placement ones, and no ``--set``). Every default is None: "not given". Each backend's own options
    (:data:`launcher.config.options.OWNERS`) are listed under their backends in ``--help``."""
    groups: dict[tuple[str, ...], Any] = {}
    for opt in OPTIONS:
        if opt.name in exclude or (only is not None and opt.name not in only):
            continue
        owners = OWNERS.get(opt.name, ())
        if owners and owners not in groups:
            names = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} or {owners[-1]}"
            groups[owners] = p.add_argument_group(f"options of --backend {names}")
        _add_option(groups[owners] if owners else p, opt)
    if only is None:
        _add_free_options(p)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML config file [./launcher.toml if present; env LAUNCHER_CONFIG]")


def _add_option(p: Any, opt: Option) -> None:
    """One option's flag on ``p`` (the parser or one of its argument groups)."""
    default = getattr(DEFAULTS, opt.field)
    shown = "none" if default is None else default
    if opt.kind == "bool":
        p.add_argument(opt.flag, dest=opt.field, action="store_const", const=True, default=None,
                       help=f"{opt.help} [env {opt.env_var}]")
    elif opt.kind == "list":
        p.add_argument(opt.flag, dest=opt.field, action="append", default=None, metavar=opt.metavar,
                       help=f"{opt.help} [env {opt.env_var}, whitespace-separated]".replace("%", "%%"))
    else:
        optional_value: dict[str, Any] = {"nargs": "?", "const": opt.const} if opt.const else {}
        p.add_argument(opt.flag, dest=opt.field, default=None, metavar=opt.metavar,
                       choices=opt.choices or None, **optional_value,
                       help=f"{opt.help} [{shown}; env {opt.env_var}]".replace("%", "%%"))


def _add_free_options(p: argparse.ArgumentParser) -> None:
    """``--set`` and ``--env-arg``: free key=value pairs, not declared options."""
    p.add_argument("--set", dest="hparams", action="append", default=None, metavar="KEY=VALUE",
                   help="algorithm hyper-parameter, e.g. --set lr=3e-4 (repeatable; file: [up.hparams]); "
                        "--set help lists them with their docs and exits")
    p.add_argument("--env-arg", dest="env_args", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument for gymnasium.make, e.g. --env-arg use_lidar=false; the value is "
                        "true/false, a number, a quoted or bare string (repeatable; file: [up.env_args])")


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start a training run", epilog=_EPILOG,
                       description="Start a training run and watch it to the end (attached).")
    add_up_options(p)
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue RUN (id or path) from its latest checkpoint, with its saved configuration "
                        "and the flags given now on top")
    p.set_defaults(func=run)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, by RunConfig field (``--set`` pairs as ``hparams``)."""
    flags = {o.field: getattr(args, o.field) for o in OPTIONS if getattr(args, o.field, None) is not None}
    if getattr(args, "hparams", None):
        try:
            flags["hparams"] = dict(parse_hparam(h) for h in args.hparams)
        except ValueError as exc:
            raise BadInput(str(exc), hint="example: --set lr=3e-4 --set n_steps=128") from None
    if getattr(args, "env_args", None):
        try:
            flags["env_args"] = dict(parse_env_arg(a) for a in args.env_args)
        except ValueError as exc:
            raise BadInput(str(exc), hint="example: --env-arg use_lidar=false --env-arg difficulty=2 "
                                          "--env-arg mode='\"hard\"'") from None
    return flags


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of ``launcher up ARGS``: file < environment < flags, or the saved run's with --resume."""
    return config_and_origin(args)[0]


def config_and_origin(args: argparse.Namespace) -> tuple[RunConfig, dict[str, str] | None]:
    """:func:`config_from_args` and where each value came from (with --resume: ``record RUN`` for the run's own
    values, ``flag ...`` for those given now)."""
    from launcher.up import resume_config_and_origin

    flags = flags_from_args(args)
    cfg, origin = load_config(flags, config_path=args.config)
    if args.resume:
        # The config file and environment only say where the results root is; the run keeps its own values.
        return resume_config_and_origin(flags, cfg.results, args.resume)
    return cfg, origin


def result_document(result: Any, results_dir: Path) -> dict[str, Any]:
    """The ``launcher.result/v1`` document: how the run ended (``--json`` and ``result.json``)."""
    return {**result.to_dict(), "schema": RESULT_SCHEMA, "results_dir": str(results_dir.resolve()),
            "launcher_version": __version__}


def run(args: argparse.Namespace) -> int:
    from launcher.progress import make_reporter
    from launcher.up import up
    from worker.results import atomic_write_json

    if args.hparams and "help" in args.hparams:  # `--set help`: list the algorithm's hyper-parameters
        from launcher.up import hparam_help

        args.hparams = [h for h in args.hparams if h != "help"]
        sys.stdout.write(hparam_help(config_from_args(args)) + "\n")
        return 0
    cfg, origin = config_and_origin(args)
    reporter = make_reporter(sys.stderr, mode=cfg.progress, interval_s=cfg.progress_interval_s)
    try:
        result = up(cfg, on_event=reporter, origin=origin)
        results_dir = cfg.results / result.run_id
        doc = result_document(result, results_dir)
        atomic_write_json(results_dir / RESULT_FILE, doc)
        reporter("result", doc)
    finally:
        reporter.close()
    s = result.summary
    if cfg.json:
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    elif cfg.detach:
        sys.stdout.write(f"{result.state.value}: {result.message}\n  run         {result.run_id}\n"
                         f"  results     {results_dir}\n")
    else:
        mean = s.get("mean_return")
        sys.stdout.write(
            f"{result.state.value}: {result.message}\n"
            f"  run         {result.run_id}\n"
            f"  return      {'-' if mean is None else f'{mean:.2f}'} (mean of last {s.get('episodes_in_window', 0)} "
            f"episodes){'' if cfg.until_return is None else f', target {cfg.until_return:g}'}\n"
            f"  env steps   {s.get('env_steps', 0)} in {result.wall_s:.1f} s, {s.get('updates', 0)} updates\n"
            f"  results     {results_dir}\n"
            f"  exit code   {int(result.exit_code)} ({result.exit_code.name})\n")
    return int(result.exit_code)
