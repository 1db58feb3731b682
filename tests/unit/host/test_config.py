"""Configuration: launcher.toml < LAUNCHER_* < flags, `launcher config show`, and every error message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from launcher import schemas
from launcher.config import (OPTIONS, RunConfig, find_config_file, load_config, parse_duration, read_config_file,
                             resolve_config, validate)
from launcher.errors import ConfigErrors
from tests.helpers import ROOT, child_env

FILE = """\
[up]
workers = 16
max-steps = 50000
seed = 7
timeout = "15m"
algo = "a3c"
results = "/data/runs"

[up.hparams]
lr = 3e-4
hidden = [32, 32]
"""


def cli(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = child_env(**env)
    e["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=60)


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    (tmp_path / "launcher.toml").write_text(FILE)
    env = {"LAUNCHER_WORKERS": "4", "LAUNCHER_SEED": "9", "LAUNCHER_TIMEOUT": "90s", "LAUNCHER_DETACH": "yes",
           "LAUNCHER_SECRET": "not an option, ignored"}
    cfg, origin = load_config({"seed": "11", "hparams": {"lr": 1e-3, "n_steps": 16}}, environ=env, cwd=tmp_path)
    where = str(tmp_path / "launcher.toml")
    assert (cfg.workers, origin["workers"]) == (4, "env LAUNCHER_WORKERS")  # env beats file
    assert (cfg.seed, origin["seed"]) == (11, "flag --seed")  # flag beats env and file
    assert (cfg.max_steps, origin["max_steps"]) == (50000, f"file {where}")  # file beats default
    assert (cfg.timeout_s, origin["timeout_s"]) == (90.0, "env LAUNCHER_TIMEOUT")
    assert (cfg.algo, cfg.results, cfg.detach) == ("a3c", Path("/data/runs"), True)
    assert (cfg.env_id, origin["env_id"]) == ("CartPole-v1", "default")
    # hparams merge key by key: the flag's lr wins, the file's hidden stays.
    assert cfg.hparams == {"lr": 1e-3, "hidden": [32, 32], "n_steps": 16}
    assert origin["hparams"] == f"file {where} + flag --set"


def test_where_the_file_comes_from(tmp_path: Path) -> None:
    assert find_config_file(None, environ={}, cwd=tmp_path) == (None, False)
    (tmp_path / "launcher.toml").write_text("[up]\nworkers = 2\n")
    assert find_config_file(None, environ={}, cwd=tmp_path) == (tmp_path / "launcher.toml", False)
    other = tmp_path / "other.toml"
    other.write_text("[up]\nworkers = 3\n")
    assert find_config_file(None, environ={"LAUNCHER_CONFIG": str(other)}, cwd=tmp_path) == (other, True)
    assert find_config_file(str(other), environ={"LAUNCHER_CONFIG": "x"}, cwd=tmp_path) == (other, True)
    assert load_config({}, config_path=other, environ={}, cwd=tmp_path)[0].workers == 3
    assert load_config({}, environ={}, cwd=tmp_path)[0].workers == 2


def test_every_option_reads_from_file_env_and_flag_alike(tmp_path: Path) -> None:
    """One declaration per option: the same text gives the same value from each layer."""
    samples = {"int": ("3", 3), "float": ("2.5", 2.5), "str": ("x", "x"), "bool": ("true", True),
               "duration": ("2m", 120.0), "size": ("2GiB", "2GiB"), "path": ("/r", Path("/r")),
               "list": ("ale-py", ("ale-py",))}
    for opt in OPTIONS:
        text, value = (opt.choices[-1], opt.choices[-1]) if opt.kind == "choice" else samples[opt.kind]
        toml_value = {"int": 3, "float": 2.5, "bool": True, "list": [text]}.get(opt.kind, text)
        f = tmp_path / f"{opt.name}.toml"
        f.write_text(f"[up]\n{opt.name} = {json.dumps(toml_value)}\n")
        from_file = load_config({}, config_path=f, environ={})[0]
        from_env = load_config({}, environ={opt.env_var: text}, cwd=tmp_path)[0]
        from_flag = resolve_config({opt.field: text}, environ={})[0]
        assert getattr(from_file, opt.field) == getattr(from_env, opt.field) == getattr(from_flag, opt.field) == value, \
            opt.name


ERRORS = [
    ("[up]\nwrokers = 4\n", "unknown key 'wrokers' in [up] (did you mean 'workers'?)"),
    ("[up]\ncolour = 4\n", "unknown key 'colour' in [up]; known keys: env, algo, model, acting, workers"),
    ("[plan]\nworkers = 4\n", "unknown table or key 'plan' (the file has two tables, [up] and [build])"),
    ("up = 3\n", "'up' must be a table ([up]), got integer"),
    ('[up]\nworkers = "eight"\n', '[up] workers = "eight": expected an integer, got string'),
    ("[up]\nworkers = 4.5\n", "[up] workers = 4.5: expected an integer, got float"),
    ('[up]\nmax-steps = "lots"\n', '[up] max-steps = "lots": expected an integer or "none", got string'),
    ('[up]\nuntil-return = "high"\n', '[up] until-return = "high": expected a number or "none", got string'),
    ('[up]\ndetach = "yes"\n', '[up] detach = "yes": expected true or false, got string'),
    ("[up]\nenv = 5\n", "[up] env = 5: expected a string, got integer"),
    ("[up]\ntimeout = true\n", '[up] timeout = true: expected a duration such as 90, "90s" or "15m" or "none", got boolean'),
    ('[up]\ntimeout = "soon"\n', "[up] timeout = \"soon\": 'soon' is not a duration (examples: 90, 90s, 15m, 1h30m)"),
    ('[up]\nmin-free-memory = "lots"\n', '[up] min-free-memory = "lots": expected a memory size such as 8GiB'),
    ('[up]\nalgo = 5\n', '[up] algo = 5: expected a string, got integer'),
    ('[up]\nhparams = "lr=1"\n', '[up] hparams = "lr=1": expected a table ([up.hparams]), got string'),
    ("[up]\nworkers = \n", "not valid TOML: Invalid value (at line 2, column 11)"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_config_file_errors_name_the_file_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "launcher.toml"
    f.write_text(text)
    with pytest.raises(ConfigErrors) as err:
        load_config({}, environ={}, cwd=tmp_path)
    assert err.value.exit_code == 2
    assert err.value.problems == [f"{f}: {message}"] or any(p.startswith(f"{f}: {message}")
                                                            for p in err.value.problems), err.value.problems


def test_environment_and_flag_errors_and_all_at_once(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[up]\nwrokers = 4\nseed = 1.5\n")
    with pytest.raises(ConfigErrors) as err:
        load_config({"max_steps": "many", "progress": "fancy"}, config_path=f,
                    environ={"LAUNCHER_RETURN_WINDOW": "ten", "LAUNCHER_JSON": "maybe"})
    assert err.value.problems == [
        f"{f}: unknown key 'wrokers' in [up] (did you mean 'workers'?)",
        f"{f}: [up] seed = 1.5: expected an integer, got float",
        "environment: LAUNCHER_RETURN_WINDOW='ten': expected a whole number",
        "environment: LAUNCHER_JSON='maybe': expected true or false",
        "flag --max-steps 'many': expected a whole number",
        "flag --progress 'fancy': expected one of auto, live, plain, off",
    ]
    with pytest.raises(ConfigErrors, match="config file not found"):
        load_config({}, config_path=tmp_path / "missing.toml", environ={})
    assert read_config_file(tmp_path / "missing.toml").problems == (f"{tmp_path / 'missing.toml'}: config file not found",)


def test_validate_checks_the_new_options() -> None:
    problems = validate(RunConfig(progress_interval_s=0.0, progress="loud"))
    assert "--progress must be one of auto, live, plain, off, got 'loud'" in problems
    assert "--progress-interval must be > 0 seconds, got 0.0" in problems
    assert parse_duration("1h30m") == 5400.0 and parse_duration(90) == 90.0
    with pytest.raises(ValueError):
        parse_duration(True)


# ----------------------------------------------------------------------------------------------- the CLI
def test_config_show_json_says_where_each_value_came_from(tmp_path: Path) -> None:
    (tmp_path / "launcher.toml").write_text(FILE)
    out = cli(tmp_path, "config", "show", "--json", "--seed", "3", "--set", "n_steps=8", LAUNCHER_WORKERS="6")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.CONFIG_SCHEMA))
    rows: dict[str, Any] = {r["key"]: r for r in doc["options"]}
    where = str(tmp_path / "launcher.toml")
    assert doc["config_file"] == where
    assert (rows["workers"]["value"], rows["workers"]["source"]) == (6, "env LAUNCHER_WORKERS")
    assert (rows["seed"]["value"], rows["seed"]["source"]) == (3, "flag --seed")
    assert (rows["max-steps"]["value"], rows["max-steps"]["source"]) == (50000, f"file {where}")
    assert (rows["timeout"]["value"], rows["env"]["source"]) == (900.0, "default")
    assert rows["hparams"] == {"key": "hparams", "value": {"lr": 3e-4, "hidden": [32, 32], "n_steps": 8},
                               "source": f"file {where} + flag --set", "env": None, "flag": "--set"}
    assert doc["values"]["workers"] == 6 and doc["values"]["results"] == "/data/runs"

    table = cli(tmp_path, "config", "show", LAUNCHER_WORKERS="6")
    assert table.returncode == 0
    assert f"config file: {where}" in table.stdout
    assert any(line.split()[:3] == ["workers", "6", "env"] for line in table.stdout.splitlines())


def test_bad_config_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (tmp_path / "launcher.toml").write_text(f'[up]\nworkers = "many"\nresults = "{results}"\n')
    for args in (("config", "show"), ("up", "--backend", "process")):
        out = cli(tmp_path, *args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines()[:2] == [
            "launcher: error: invalid configuration:",
            f'  - {tmp_path / "launcher.toml"}: [up] workers = "many": expected an integer, got string']
        assert "HINT:" in out.stderr and "Traceback" not in out.stderr
    assert not results.exists()
    missing = cli(tmp_path, "config", "show", "--config", "nope.toml")
    assert missing.returncode == 2 and "nope.toml: config file not found" in missing.stderr


def test_validate_checks_algo_model_and_acting(tmp_path: Path) -> None:
    problems = validate(RunConfig(algo="dqn", acting="gpu", model="not a reference"))
    assert any(p.startswith("--algo 'dqn' is neither a built-in (ppo, a3c) nor MODULE:Name or FILE.py:Name")
               for p in problems), problems
    assert "--model 'not a reference' is not MODULE:function or FILE.py:function" in problems
    assert "--acting must be one of auto, numpy, tensorflow, got 'gpu'" in problems
    assert any("no such file" in p for p in validate(RunConfig(algo=str(tmp_path / "missing.py") + ":Algo")))
    mine = tmp_path / "mine.py"
    mine.write_text("")
    assert not [p for p in validate(RunConfig(algo=f"{mine}:Algo", results=tmp_path)) if "--algo" in p]
    assert not [p for p in validate(RunConfig(algo="ppo", results=tmp_path)) if "--algo" in p]
