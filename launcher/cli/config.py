"""``launcher config show``: the configuration ``launcher up`` would run with, and where each value came from.

Layers: defaults < config file (``--config``, ``$LAUNCHER_CONFIG`` or ``./launcher.toml``) < ``LAUNCHER_*``
environment < flags. ``show`` takes the same flags as ``up``, so ``launcher config show --workers 4`` says what
``launcher up --workers 4`` would use. Unknown keys and wrong values exit 2, naming the key, value and file.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from launcher.config import find_config_file, load_config, show_rows
from launcher.schemas import CONFIG_SCHEMA


def register(sub: Any) -> None:
    from launcher.cli.up import add_up_options

    p = sub.add_parser("config", help="show the resolved configuration of `launcher up`",
                       description="Inspect the configuration `launcher up` resolves from launcher.toml, "
                                   "LAUNCHER_* variables and flags.")
    inner = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", parser_class=type(p))
    show = inner.add_parser("show", help="print every `up` option, its value and its source",
                            description=__doc__)
    add_up_options(show, exclude=("json",))  # --json here means: print this as JSON
    show.add_argument("--json", dest="as_json", action="store_true",
                      help=f"print JSON ({CONFIG_SCHEMA}) instead of a table")
    show.set_defaults(func=run_show)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])


def show_document(args: argparse.Namespace) -> dict[str, Any]:
    """The ``launcher.config-show/v1`` document for ``args`` (the ``up`` flags given to ``show``)."""
    from launcher.cli.up import flags_from_args

    flags = flags_from_args(args)
    cfg, origin = load_config(flags, config_path=args.config)
    path, _ = find_config_file(args.config)
    return {"schema": CONFIG_SCHEMA, "config_file": None if path is None else str(path),
            "options": show_rows(cfg, origin), "values": cfg.to_dict()}


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "-"
    return str(value)


def run_show(args: argparse.Namespace) -> int:
    doc = show_document(args)
    if args.as_json:
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
        return 0
    lines = [f"config file: {doc['config_file'] or 'none (no ./launcher.toml, no --config, no $LAUNCHER_CONFIG)'}",
             f"{'KEY':<22} {'VALUE':<24} SOURCE"]
    for row in doc["options"]:
        lines.append(f"{row['key']:<22} {_text(row['value']):<24} {row['source']}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
