"""Fault suite, bad input: every ``launcher up`` option with a wrong value (as a flag, as a ``LAUNCHER_*``
variable and in ``launcher.toml``), plus what the machine can get wrong: a results directory on a full or
read-only file system or one the user cannot read, a port in use, no Docker engine, no NVIDIA runtime for
a GPU plan, a lock directory that is a file.

Each must end with one line naming the problem (the README's exit code: 2, or 6 for a missing dependency),
before anything is started: no process, no container, no new run directory, and nothing already in the
results directory touched (its tree is checksummed before and after).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.cli.main import main
from tests.fault.helpers import FAULT_UID, record, tree_digest
from tests.helpers import child_env, launcher_cmd, processes_mentioning
from tests.nvml_fixtures import NvmlStub, machine


# (option, wrong value, text the one problem line must contain)
WRONG: list[tuple[str, str, str]] = [
    ("env", "NoSuchEnv-v0", "NoSuchEnv-v0"),
    ("algo", "dqn", "dqn"),
    ("workers", "-3", "-3"),
    ("workers", "many", "many"),
    ("workers", "5000", "5000"),
    ("backend", "k8s", "k8s"),
    ("max-steps", "0", "max-steps"),
    ("max-steps", "1e3x", "1e3x"),
    ("until-return", "nan", "until-return"),
    ("until-return", "lots", "lots"),
    ("return-window", "0", "return-window"),
    ("seed", "x1", "x1"),
    ("gpus", "banana", "banana"),
    ("gpus", "0,0", "0"),
    ("groups", "0", "groups"),
    ("groups", "99", "99"),
    ("max-workers-per-group", "0", "max-workers-per-group"),
    ("timeout", "soon", "soon"),
    ("timeout", "-5s", "-5s"),
    ("port", "70000", "70000"),
    ("port", "-1", "-1"),
    ("checkpoint-every", "0", "checkpoint-every"),
    ("restart-budget", "-1", "restart-budget"),
    ("min-free-memory", "lots", "lots"),
    ("max-utilization", "150", "150"),
    ("image", "Bad Image!", "Bad Image!"),
    ("progress", "fancy", "fancy"),
    ("progress-interval", "0", "progress-interval"),
]
NOT_IN_FILE_OR_ENV = {("gpus", "0,0")}  # duplicates are found when parsed, the same from any source
BOOL_OPTIONS = ("detach", "json")  # flags without a value: wrong only as a variable or in the file


@pytest.fixture
def existing(tmp_path: Path) -> Path:
    """A results root that already holds a run (files a new launch must not touch)."""
    root = tmp_path / "results"
    old = root / "cartpole-ppo-20260101-000000-beef"
    (old / "checkpoints").mkdir(parents=True)
    (old / "logs").mkdir()
    (old / "run.json").write_text('{"state": "finished", "run_id": "cartpole-ppo-20260101-000000-beef"}\n')
    (old / "spec.json").write_text('{"run_id": "cartpole-ppo-20260101-000000-beef"}\n')
    (old / "summary.json").write_text('{"outcome": "max_steps"}\n')
    (old / "checkpoints" / "ckpt-5.index").write_bytes(os.urandom(256))
    (old / "logs" / "master.log").write_text("master log\n")
    return root


def _problem_lines(stderr: str) -> list[str]:
    """The lines that state a problem: the ``launcher: error:`` line, or the ``  - `` items under
    ``invalid configuration:``. Usage and HINT lines are not problems."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if any(ln.endswith("invalid configuration:") for ln in lines):
        return [ln for ln in lines if ln.startswith("  - ")]
    return [ln for ln in lines if ln.startswith("launcher: error:")]


def _check(code: int, stderr: str, needle: str, expected: int = 2) -> str:
    assert code == expected, f"exit {code}, expected {expected}: {stderr}"
    assert "Traceback" not in stderr, stderr
    problems = _problem_lines(stderr)
    assert len(problems) == 1, f"expected one problem line: {stderr}"
    # An option is named as given: --max-steps (flag, file) or LAUNCHER_MAX_STEPS (environment).
    assert needle in problems[0] or needle in problems[0].lower().replace("_", "-"), \
        f"{needle!r} not in {problems[0]!r}"
    others = [ln for ln in stderr.splitlines() if ln.strip() and ln not in problems and not
              ln.startswith(("usage:", "HINT:", "launcher: error: invalid configuration:", "  ", "               "))]
    assert not others, f"more than one clear line: {others}"
    return problems[0]


def _run_in_process(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def _toml_value(value: str) -> str:
    try:
        int(value)
        return value
    except ValueError:
        return '"' + value.replace('"', '\\"') + '"'


@pytest.mark.parametrize("source", ["flag", "env", "file"])
def test_every_option_with_a_wrong_value(existing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """In-process (`launcher.cli.main.main`), so all of them fit in seconds."""
    monkeypatch.chdir(tmp_path)  # no stray launcher.toml
    for key in [k for k in os.environ if k.startswith("LAUNCHER_")]:
        monkeypatch.delenv(key)
    before = tree_digest(existing)
    base = ["up", "--backend", "process", "--gpus", "none", "--max-steps", "1000", "--results", str(existing)]
    cases = [(o, v, n) for o, v, n in WRONG if source == "flag" or (o, v) not in NOT_IN_FILE_OR_ENV]
    if source != "flag":
        cases += [(o, "maybe", "maybe") for o in BOOL_OPTIONS]
    seen = []
    for option, value, needle in cases:
        argv = list(base)
        env_name = "LAUNCHER_" + option.upper().replace("-", "_")
        if option in ("gpus", "max-steps", "backend"):  # drop the base's value for this option
            i = argv.index(f"--{option}")
            del argv[i:i + 2]
        if source == "flag":
            argv.append(f"--{option}={value}")  # "=": argparse reads "-3" after a space as an option
        elif source == "env":
            monkeypatch.setenv(env_name, value)
        else:
            (tmp_path / "launcher.toml").write_text(f"[up]\n{option} = {_toml_value(value)}\n")
        if option == "image":
            argv[argv.index("process")] = "docker"  # an image reference matters to the docker backend
        code, err = _run_in_process(capsys, argv)
        monkeypatch.delenv(env_name, raising=False)
        (tmp_path / "launcher.toml").unlink(missing_ok=True)
        line = _check(code, err, needle)
        seen.append(line)
        assert tree_digest(existing) == before, f"--{option} {value}: the results directory changed"
    assert not processes_mentioning(str(existing))
    record(f"bad_input_{source}", cases=len(seen), exit_2=len(seen), results_untouched=True)


def test_other_wrong_flags(existing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = tree_digest(existing)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (tmp_path / "bad.toml").write_text("[up\nworkers = 2\n")
    (tmp_path / "unknown.toml").write_text("[up]\nworkerz = 2\n")
    common = ["--gpus", "none", "--max-steps", "1000"]
    cases = [
        (["--results", str(blocker / "sub"), "--backend", "process"], "is not a directory"),
        (["--results", str(existing), "--backend", "process", "--detach"], "--detach needs the docker backend"),
        (["--results", str(existing), "--backend", "process", "--set", "lr"], "key=value"),
        (["--results", str(existing), "--backend", "process", "--set", "bogus=1"], "bogus"),
        (["--results", str(existing), "--backend", "process", "--config", str(tmp_path / "missing.toml")], "not found"),
        (["--results", str(existing), "--backend", "process", "--config", str(tmp_path / "bad.toml")], "not valid TOML"),
        (["--results", str(existing), "--backend", "process", "--config", str(tmp_path / "unknown.toml")], "workerz"),
        (["--results", str(existing), "--backend", "process", "--resume", "no-such-run"], "no-such-run"),
        (["--results", str(existing), "--backend", "process", "--workers"], "--workers"),
    ]
    for args, needle in cases:
        code, err = _run_in_process(capsys, ["up", *common, *args])
        _check(code, err, needle)
        assert tree_digest(existing) == before, f"{args}: the results directory changed"
    record("bad_input_other_flags", cases=len(cases), exit_2=len(cases), results_untouched=True)


def test_lock_dir_that_is_a_file(nvml_stub: NvmlStub, existing: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_stub.configure(machine(4))
    monkeypatch.chdir(tmp_path)
    before = tree_digest(existing)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for lock_dir in (blocker, blocker / "sub"):
        code, err = _run_in_process(capsys, ["up", "--backend", "process", "--workers", "2", "--max-steps", "1000",
                                             "--results", str(existing), "--lock-dir", str(lock_dir)])
        _check(code, err, str(lock_dir))
    assert tree_digest(existing) == before


# ---------------------------------------------------------------------------------- the real CLI, outside
def _cli(args: list[str], cwd: Path, user: int | None = None, **env: Any) -> subprocess.CompletedProcess[str]:
    argv = launcher_cmd("up", *args)
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(argv, cwd=cwd, env=child_env(**env), capture_output=True, text=True, timeout=120)


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points made by the test, unmounted at teardown."""
    made: list[Path] = []
    yield made
    for m in made:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def _tmpfs(where: Path, options: str, mounts: list[Path]) -> None:
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    mounts.append(where)


def test_full_and_read_only_results_file_systems(tmp_path: Path, mounts: list[Path]) -> None:
    full, ro = tmp_path / "full", tmp_path / "ro"
    _tmpfs(full, "size=64k", mounts)
    (full / "results" / "old-run").mkdir(parents=True)
    (full / "results" / "old-run" / "summary.json").write_text('{"outcome": "max_steps"}\n')
    with open(full / "filler", "wb", buffering=0) as fh:  # fill it to the last byte
        try:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        except OSError:
            pass
    _tmpfs(ro, "ro,size=64k", mounts)
    cases = {"full": (full / "results", "No space left"), "read-only": (ro / "results", "not writable")}
    for name, (root, needle) in cases.items():
        before = tree_digest(root)
        proc = _cli(["--backend", "process", "--gpus", "none", "--max-steps", "1000", "--results", str(root)], tmp_path)
        _check(proc.returncode, proc.stderr, needle)
        assert tree_digest(root) == before, f"{name}: the results directory changed"
    record("bad_input_filesystems", full_disk="exit 2", read_only="exit 2", results_untouched=True)


def test_results_directory_the_user_cannot_read(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    base = Path(tempfile.mkdtemp(prefix="fault-perm-"))
    try:
        os.chmod(base, 0o755)
        root = base / "results"
        root.mkdir(mode=0o700)  # root's, unreadable and unwritable for FAULT_UID
        (root / "old").mkdir()
        before = tree_digest(root)
        proc = _cli(["--backend", "process", "--gpus", "none", "--max-steps", "1000", "--results", str(root)], base,
                    user=FAULT_UID, HOME=str(base))
        _check(proc.returncode, proc.stderr, "not writable")
        assert tree_digest(root) == before
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_port_in_use(existing: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        before = tree_digest(existing)
        proc = _cli(["--backend", "process", "--gpus", "none", "--max-steps", "1000", "--port", str(port),
                     "--results", str(existing)], tmp_path)
        _check(proc.returncode, proc.stderr, f"--port {port} is already in use")
        assert tree_digest(existing) == before


def test_no_docker_engine(existing: Path, tmp_path: Path) -> None:
    before = tree_digest(existing)
    proc = _cli(["--backend", "docker", "--gpus", "none", "--max-steps", "1000", "--results", str(existing)], tmp_path,
                DOCKER_HOST="unix:///nonexistent/docker.sock")
    _check(proc.returncode, proc.stderr, "no Docker engine answers", expected=6)
    assert tree_digest(existing) == before, "a run directory was made for a run that could not start"
    record("bad_input_no_engine", exit=proc.returncode, results_untouched=True)


@pytest.mark.docker
def test_gpu_plan_without_nvidia_runtime(nvml_stub: NvmlStub, existing: Path, tmp_path: Path,
                                         docker_client: object) -> None:
    nvml_stub.configure(machine(4))
    before = tree_digest(existing)
    env: dict[str, Any] = {k: v for k, v in nvml_stub.env().items() if k in ("LD_LIBRARY_PATH", "NVML_STUB_CONFIG")}
    proc = _cli(["--backend", "docker", "--workers", "2", "--max-steps", "1000", "--results", str(existing),
                 "--lock-dir", str(nvml_stub.lock_dir)], tmp_path, **env)
    _check(proc.returncode, proc.stderr, "no NVIDIA runtime", expected=6)
    assert "nvidia-container-toolkit" in proc.stderr
    assert tree_digest(existing) == before, "a run directory was made for a run that could not start"
    record("bad_input_no_nvidia_runtime", exit=proc.returncode, results_untouched=True)
