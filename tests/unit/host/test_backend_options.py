"""Issue 23 item 4: each backend declares its own ``launcher up`` options, and ``up`` uses that ownership.

* the central list (:data:`launcher.config.options.COMMON_OPTIONS`) holds only options every run reads; each
  backend's options come from its light options module, named in the registry (``launcher.backends.BACKENDS``),
  and reading them imports no backend code (no Docker SDK at parse time);
* a backend option set by flag, config file or ``LAUNCHER_*`` variable for a backend the run does not use is one
  problem in the ConfigErrors list (exit 2, nothing started) naming the option, value, source, its backend and
  the backend chosen, and the fix;
* ``--backend auto`` picks docker or process: options only swarm/slurm read are refused, docker's are not;
* ``--help`` lists each backend's options under its own heading.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli.main import main
from tests.helpers import ROOT

INVALID = ("--workers", "0")  # every case is refused anyway: nothing could start even where the check is missing


def _up(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    results = tmp_path / "results"
    code = main(["up", "--results", str(results), *INVALID, *args])
    assert not results.exists() or not any(results.iterdir()), "nothing may be started or written"
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("LAUNCHER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no ./launcher.toml but the test's own


# ------------------------------------------------------------------------------------------ ownership
def test_each_backend_declares_its_own_options_and_the_central_list_none() -> None:
    from launcher.backends import BACKENDS, backend_options
    from launcher.backends import docker_options, slurm_options, swarm_options
    from launcher.config import OPTIONS
    from launcher.config.options import COMMON_OPTIONS, OWNERS

    declared = backend_options()
    assert list(declared) == list(BACKENDS), "one entry per backend of the registry"
    assert {o.name for o in declared["slurm"]} == {"image", "slurm-partition", "slurm-nodes", "slurm-runtime",
                                                   "slurm-arg"}
    assert {o.name for o in declared["swarm"]} == {"image", "with", "swarm-master", "swarm-groups"}
    assert {o.name for o in declared["docker"]} == {"image", "with", "build"}
    assert declared["process"] == ()
    assert declared["slurm"] == slurm_options.OPTIONS and declared["swarm"] == swarm_options.OPTIONS
    assert declared["docker"] == docker_options.OPTIONS
    for opt in COMMON_OPTIONS:  # the central list: options of no backend
        assert opt.name not in OWNERS, f"{opt.flag} is declared centrally but belongs to {OWNERS[opt.name]}"
        assert not opt.help.startswith(("slurm backend", "swarm backend", "docker backend", "docker/swarm")), opt
    for name, owners in OWNERS.items():  # each backend option is named by every backend that owns it
        assert owners and all(name in {o.name for o in declared[b]} for b in owners)
    assert {o.name for o in OPTIONS} == {o.name for o in COMMON_OPTIONS} | set(OWNERS), "OPTIONS: both, once each"
    assert len(OPTIONS) == len({o.name for o in OPTIONS})


def test_option_tables_come_from_the_registry_without_backend_code(tmp_path: Path) -> None:
    """A backend added to the registry brings its options; reading them imports no backend module."""
    (tmp_path / "fake_options.py").write_text(
        "from launcher.option import Option\n"
        "OPTIONS = (Option('fake-zone', 'slurm_partition', 'str', 'fake backend: zone', nullable=True),)\n")
    code = ("import sys; import launcher.backends as b; "
            "b.BACKENDS['fake'] = b.Entry('launcher.backends.process', 'ProcessBackend', 'fake_options'); "
            "import launcher.config as c; from launcher.config.options import OWNERS; "
            "assert OWNERS['fake-zone'] == ('fake',), OWNERS; "
            "assert 'fake-zone' in [o.name for o in c.OPTIONS]; "
            "heavy = {'docker', 'launcher.backends.docker', 'launcher.backends.swarm', 'launcher.backends.slurm', "
            "'launcher.backends.process', 'launcher.engine'} & set(sys.modules); assert not heavy, heavy; "
            "assert 'launcher.backends.slurm_options' in sys.modules")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------ mismatch
def test_a_flag_of_another_backend_is_one_problem_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _up(tmp_path, capsys, "--backend", "docker", "--slurm-partition", "gpu")
    assert code == 2
    lines = [line for line in err.splitlines() if "--slurm-partition" in line]
    assert lines == ["  - --slurm-partition gpu (flag) is an option of --backend slurm; this run uses --backend "
                     "docker (flag): drop --slurm-partition or run with --backend slurm"], err
    assert "--workers must be between" in err, "with the other problems, in the one list"


def test_an_env_var_of_another_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCHER_SWARM_MASTER", "local")
    monkeypatch.setenv("LAUNCHER_BACKEND", "slurm")
    code, err = _up(tmp_path, capsys, "--with", "ale-py")
    assert code == 2
    assert ("LAUNCHER_SWARM_MASTER=local (environment) is an option of --backend swarm; this run uses --backend "
            "slurm (LAUNCHER_BACKEND): unset LAUNCHER_SWARM_MASTER or run with --backend swarm") in err, err
    assert ("--with ale-py (flag) is an option of --backend docker or swarm; this run uses --backend slurm "
            "(LAUNCHER_BACKEND): drop --with or run with --backend docker or swarm") in err, err


def test_a_file_key_of_another_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "site.toml"
    cfg.write_text('[up]\nbackend = "swarm"\nslurm-arg = ["--qos=normal"]\nbuild = "offline"\nimage = "x:1"\n')
    code, err = _up(tmp_path, capsys, "--config", str(cfg))
    assert code == 2
    assert (f'slurm-arg = ["--qos=normal"] ({cfg} [up]) is an option of --backend slurm; this run uses --backend '
            f"swarm ({cfg}): remove slurm-arg from {cfg} or run with --backend slurm") in err, err
    assert f'build = "offline" ({cfg} [up]) is an option of --backend docker;' in err, err
    assert "image =" not in err, "swarm reads --image"


def test_the_chosen_backends_own_options_are_fine() -> None:
    from launcher.config import load_config
    from launcher.config.checks import backend_mismatch

    flags = {"backend": "slurm", "slurm_partition": "gpu", "image": "x:1", "slurm_args": ["--qos=normal"]}
    cfg, origin = load_config(flags, environ={"LAUNCHER_SLURM_NODES": "2"})
    assert backend_mismatch(cfg, origin) == []
    cfg, origin = load_config({"backend": "process"}, environ={})
    assert backend_mismatch(cfg, origin) == [], "defaults are never a problem"


def test_with_inherited_from_the_build_table_is_not_refused(tmp_path: Path) -> None:
    from launcher.config import load_config
    from launcher.config.checks import backend_mismatch

    cfg_file = tmp_path / "launcher.toml"
    cfg_file.write_text('[build]\nwith = ["ale-py"]\n')
    cfg, origin = load_config({"backend": "process"}, environ={}, cwd=tmp_path)
    assert cfg.with_packages == ("ale-py",) and origin["with_packages"] == f"file {cfg_file} [build]"
    assert backend_mismatch(cfg, origin) == [], "[build] is launcher build's table; up only inherits it"


# ------------------------------------------------------------------------------------------ --backend auto
def test_auto_refuses_what_it_can_never_pick_and_keeps_dockers() -> None:
    """``--backend auto`` picks docker or process (before any engine is asked): slurm/swarm options can never
    apply; docker's apply when an engine answers, so a file for both kinds of host stays valid."""
    from launcher.config import load_config
    from launcher.config.checks import backend_mismatch

    cfg, origin = load_config({"slurm_nodes": "2", "image": "x:1", "build": "offline", "with_packages": ["a"]},
                              environ={"LAUNCHER_SWARM_GROUPS": "any"})
    assert cfg.backend == "auto" and origin["backend"] == "default"
    assert backend_mismatch(cfg, origin) == [
        "LAUNCHER_SWARM_GROUPS=any (environment) is an option of --backend swarm; this run uses --backend auto "
        "(default), which picks docker or process: unset LAUNCHER_SWARM_GROUPS or run with --backend swarm",
        "--slurm-nodes 2 (flag) is an option of --backend slurm; this run uses --backend auto (default), which "
        "picks docker or process: drop --slurm-nodes or run with --backend slurm"]
    cfg, origin = load_config({"backend": "process", "image": "x:1"}, environ={})
    assert len(backend_mismatch(cfg, origin)) == 1, "an explicit process backend reads no image"


def test_plan_refuses_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--backend", "process", "--swarm-groups", "any"]) == 2
    assert "--swarm-groups any (flag) is an option of --backend swarm" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ --help
def test_help_lists_each_backends_options_under_its_heading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = capsys.readouterr().out
    sections = {}
    for block in out.split("\n\n"):
        head, _, body = block.partition("\n")
        sections[head.strip()] = body
    assert "--slurm-partition" in sections["options of --backend slurm:"]
    assert "--swarm-master" in sections["options of --backend swarm:"]
    assert "--build" in sections["options of --backend docker:"]
    assert "--image" in sections["options of --backend docker, swarm or slurm:"]
    assert "--slurm-partition" not in sections["options:"] and "--workers" in sections["options:"]


# ------------------------------------------------------------------------------------------ --resume
def test_a_backend_option_given_with_resume_is_refused_and_the_runs_own_record_never(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`up --resume RUN --slurm-partition gpu` on a process run: before, the flag was silently ignored (the
    check ran only on new runs). Now it is the same exit-2 problem, naming the run's record as where the backend
    came from; the run's own values (recorded, not given now) are never judged, and nothing is started."""
    from contextlib import ExitStack

    from launcher.config import RunConfig
    from launcher.up import prepare

    root = tmp_path / "results"
    cfg = RunConfig(env_id="CartPole-v1", workers=2, groups=1, backend="process", gpus="none", results=root,
                    max_steps=1000)
    with ExitStack() as stack:
        run_id = prepare(cfg, stack).run.run_id
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    code = main(["up", "--resume", run_id, "--results", str(root), "--slurm-partition", "gpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--slurm-partition gpu (flag) is an option of --backend slurm" in err, err
    assert f"--backend process (run {run_id}'s record)" in err, err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before, "nothing started or written"
