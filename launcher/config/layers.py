"""The layers: defaults < ``launcher.toml`` < ``LAUNCHER_*`` < flags, each value with where it came from."""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.errors import ConfigErrors
from launcher.config.options import (BY_FIELD, BY_NAME, CONFIG_ENV, CONFIG_FILE_NAME, FIELD_TYPES, OPTIONS, RunConfig,
                                     _toml, _type_name, check_env_args, coerce)


# ------------------------------------------------------------------------------------------ the layers
@dataclass(frozen=True)
class FileValues:
    """What a config file set, by RunConfig field, with the problems found reading it."""

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    from_build: tuple[str, ...] = ()  # fields only inherited from the [build] table (``with``), not set in [up]


def find_config_file(explicit: str | Path | None, *, environ: Mapping[str, str] | None = None,
                     cwd: Path | None = None) -> tuple[Path | None, bool]:
    """The config file to read: ``explicit`` (``--config``), else ``$LAUNCHER_CONFIG``, else
    ``./launcher.toml`` if it exists. Returns (path or None, whether the user named it)."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit).expanduser(), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser(), True
    local = (cwd or Path.cwd()) / CONFIG_FILE_NAME
    return (local, False) if local.is_file() else (None, False)


def read_config_file(path: Path) -> FileValues:
    """Read a TOML config file's ``[up]`` and ``[up.hparams]`` tables. Never raises: problems are returned,
    each naming the file, the key and the value (unknown keys, wrong types, TOML syntax)."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return FileValues(path, problems=(f"{where}: config file not found",))
    except (OSError, UnicodeDecodeError) as exc:
        return FileValues(path, problems=(f"{where}: cannot read the config file: {exc}",))
    except tomllib.TOMLDecodeError as exc:
        return FileValues(path, problems=(f"{where}: not valid TOML: {exc}",))
    problems: list[str] = []
    for key in data:
        if key not in ("up", "build"):
            problems.append(f"{where}: unknown table or key {key!r} (the file has two tables, [up] and [build])")
    build = read_build_table(data, where, problems)
    up = data.get("up", {})
    if not isinstance(up, dict):
        return FileValues(path, problems=(*problems, f"{where}: 'up' must be a table ([up]), got {_type_name(up)}"))
    values: dict[str, Any] = {}
    for key, value in up.items():
        if key in ("hparams", "env_args", "env-args"):
            name = key.replace("-", "_")
            if not isinstance(value, dict):
                problems.append(f"{where}: [up] {key} = {_toml(value)}: expected a table ([up.{name}]), "
                                f"got {_type_name(value)}")
            else:
                values[name] = dict(value)
                if name == "env_args":
                    problems.extend(check_env_args(value, f"{where}: [up.env_args]"))
            continue
        opt = BY_NAME.get(key.replace("_", "-"))
        if opt is None:
            names = [o.name for o in OPTIONS] + ["hparams", "env_args"]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            problems.append(f"{where}: unknown key {key!r} in [up]" + (f" (did you mean {close[0]!r}?)" if close
                                                                       else f"; known keys: {', '.join(names)}"))
            continue
        try:
            values[opt.field] = coerce(opt, value, strict=True)
        except ValueError as exc:
            problems.append(f"{where}: [up] {key} = {_toml(value)}: {exc}")
    inherited: tuple[str, ...] = ()
    if "with" in build and "with_packages" not in values:  # `up` runs on the image `launcher build` made
        values["with_packages"] = build["with"]
        inherited = ("with_packages",)
    return FileValues(path, values, tuple(problems), inherited)


BUILD_KEYS = ("with",)


def read_build_table(data: Mapping[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """The ``[build]`` table of a parsed config file: ``with = ["pkg", "dist/x.whl"]`` (what ``launcher build
    --with`` adds; ``launcher up`` runs on that image unless ``[up] with`` says otherwise). Problems are
    appended to ``problems``."""
    build = data.get("build", {})
    if not isinstance(build, dict):
        problems.append(f"{where}: 'build' must be a table ([build]), got {_type_name(build)}")
        return {}
    out: dict[str, Any] = {}
    for key, value in build.items():
        if key not in BUILD_KEYS:
            problems.append(f"{where}: unknown key {key!r} in [build]; known keys: {', '.join(BUILD_KEYS)}")
            continue
        try:
            out[key] = coerce(BY_NAME["with"], value, strict=True)
        except ValueError as exc:
            problems.append(f"{where}: [build] {key} = {_toml(value)}: {exc}")
    return out


def build_with_from_file(explicit: str | Path | None, *, environ: Mapping[str, str] | None = None,
                         cwd: Path | None = None) -> tuple[tuple[str, ...], Path | None]:
    """``launcher build``'s packages from the config file (``[build] with``), and the file read.

    Raises:
        ConfigErrors: the file cannot be read or its ``[build]`` table is wrong.
    """
    path, _ = find_config_file(explicit, environ=environ, cwd=cwd)
    if path is None:
        return (), None
    problems: list[str] = []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigErrors([f"{path}: cannot read the config file: {exc}"]) from None
    build = read_build_table(data, str(path), problems)
    if problems:
        raise ConfigErrors(problems, hint="[build] takes: with = [\"package\", \"path/to/file.whl\"]")
    return tuple(build.get("with", ())), path


def load_config(flags: Mapping[str, Any], *, config_path: str | Path | None = None,
                environ: Mapping[str, str] | None = None, cwd: Path | None = None
                ) -> tuple[RunConfig, dict[str, str]]:
    """The configuration ``launcher up`` runs with: defaults < config file < environment < flags.

    Args:
        flags: RunConfig fields the user gave as flags (None values mean "not given"); ``hparams`` merges
            key by key over the file's ``[up.hparams]``.
        config_path: ``--config``; else ``$LAUNCHER_CONFIG``, else ``./launcher.toml`` if present.
        environ: the environment (default ``os.environ``).

    Returns:
        (config, origin): origin maps each field to ``default``, ``file PATH``, ``env LAUNCHER_X`` or
        ``flag --x`` (``file PATH [build]``: ``with`` only inherited from the file's ``[build]`` table).

    Raises:
        ConfigErrors: every unknown key and wrong value, each naming the key, the value and its source.
    """
    path, named = find_config_file(config_path, environ=environ, cwd=cwd)
    file = read_config_file(path) if path is not None else FileValues(None)
    cfg, origin = resolve_config(flags, file_values=file.values, environ=environ,
                                 file_label=str(path) if path else "file", extra_problems=file.problems)
    for name in file.from_build:  # still the file's value: say it is the [build] table's
        if origin.get(name, "").startswith("file "):
            origin[name] += " [build]"
    return cfg, origin


def resolve_config(flags: Mapping[str, Any], *, file_values: Mapping[str, Any] | None = None,
                   environ: Mapping[str, str] | None = None, file_label: str = "file",
                   extra_problems: tuple[str, ...] = ()) -> tuple[RunConfig, dict[str, str]]:
    """Layer defaults < file < environment < flags. Returns the config and where each value came from.

    ``flags`` and ``file_values`` are keyed by RunConfig field; ``flags`` holds only options the user gave.
    Raises ConfigErrors listing every problem, each with its source.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {name: "default" for name in FIELD_TYPES}
    problems: list[str] = list(extra_problems)
    hparams: dict[str, Any] = {}
    env_args: dict[str, Any] = {}
    for name, value in (file_values or {}).items():
        if name == "hparams":
            hparams.update(value or {})
            origin["hparams"] = f"file {file_label}"
        elif name == "env_args":
            env_args.update(value or {})
            origin["env_args"] = f"file {file_label}"
        elif name in BY_FIELD:
            try:
                values[name] = coerce(BY_FIELD[name], value)
                origin[name] = f"file {file_label}"
            except ValueError as exc:
                problems.append(f"{file_label}: {BY_FIELD[name].name} = {value!r}: {exc}")
        elif name in FIELD_TYPES:
            values[name] = value
            origin[name] = f"file {file_label}"
        else:
            problems.append(f"{file_label}: unknown key {name!r}")
    env = os.environ if environ is None else environ
    for opt in OPTIONS:
        if opt.env_var in env:
            try:
                values[opt.field] = coerce(opt, env[opt.env_var])
                origin[opt.field] = f"env {opt.env_var}"
            except ValueError as exc:
                problems.append(f"environment: {opt.env_var}={env[opt.env_var]!r}: {exc}")
    for name, value in flags.items():
        if value is None:
            continue
        if name in ("hparams", "env_args"):
            flag = "--set" if name == "hparams" else "--env-arg"
            (hparams if name == "hparams" else env_args).update(value)
            origin[name] = f"flag {flag}" if origin[name] == "default" else f"{origin[name]} + flag {flag}"
            continue
        flag_opt = BY_FIELD.get(name)
        if flag_opt is None:
            if name in FIELD_TYPES:  # resume: flag-only, already typed
                values[name] = value
                origin[name] = f"flag --{name}"
            else:
                problems.append(f"unknown option {name!r}")
            continue
        try:
            values[name] = coerce(flag_opt, value)
            origin[name] = f"flag {flag_opt.flag}"
        except ValueError as exc:
            problems.append(f"flag {flag_opt.flag} {value!r}: {exc}")
    if hparams:
        values["hparams"] = hparams
    if env_args:
        values["env_args"] = env_args
    if problems:
        raise ConfigErrors(problems, hint="fix the values above; `launcher up --help` lists every option and "
                                          "docs/operator.md the config file")
    return RunConfig(**values), origin


def show_rows(cfg: RunConfig, origin: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per option (and hparams) for ``launcher config show``: name, value, source, env var."""
    rows: list[dict[str, Any]] = []
    for opt in OPTIONS:
        value = getattr(cfg, opt.field)
        rows.append({"key": opt.name, "value": str(value) if isinstance(value, Path) else value,
                     "source": origin.get(opt.field, "default"), "env": opt.env_var, "flag": opt.flag})
    rows.append({"key": "hparams", "value": dict(cfg.hparams), "source": origin.get("hparams", "default"),
                 "env": None, "flag": "--set"})
    rows.append({"key": "env_args", "value": dict(cfg.env_args), "source": origin.get("env_args", "default"),
                 "env": None, "flag": "--env-arg"})
    return rows


