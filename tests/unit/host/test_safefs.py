"""Issue 14, item 1: the host never follows a link, blocks on a FIFO, reads without bound or tracebacks on what a
container planted in a run directory it can write (real files, FIFOs, links and ``/dev/zero``; no mocks).

Each test is able to fail on commit c1dca51: there ``save_logs`` appended with ``open(path, "ab")`` (through any
link) and the host read ``status.json`` with ``Path.read_text`` (a FIFO hangs, ``/dev/zero`` never ends,
invalid UTF-8 raises).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from launcher import safefs
from launcher.backends.containers import LogCopy, logs_dir_for, save_logs
from launcher.engine.labels import RESULTS_LABEL, ROLE_LABEL, USER_LABEL
from launcher.history import describe
from launcher.lifecycle import log_files
from launcher.runs import RunDir
from launcher.runstate import Seen


def bounded(fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it does not return in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} did not return within {timeout_s} s (blocked on a FIFO or an endless file?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    d = tmp_path / "results" / "cartpole-ppo-20261122-000000-abcd"
    (d / "logs").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"env_id": "CartPole-v1", "algo": "ppo", "groups": []}))
    (d / "run.json").write_text(json.dumps({"state": "finished", "backend": "process", "workers": 2}))
    return RunDir(d.name, d)


def copy(role: str = "master") -> LogCopy:
    return LogCopy({ROLE_LABEL: role, USER_LABEL: str(os.getuid())}, "output of container x", b"hello\n")


# ------------------------------------------------------------------------------------------ log saving
def test_save_logs_refuses_a_planted_link_to_a_file_outside(run_dir: RunDir, tmp_path: Path) -> None:
    victim = tmp_path / "authorized_keys"
    victim.write_bytes(b"ssh-ed25519 AAAA me\n")
    (run_dir.files.logs / "master.log").symlink_to(victim)
    written = save_logs([copy()], run_dir.files.logs)
    assert written == []
    assert victim.read_bytes() == b"ssh-ed25519 AAAA me\n"


def test_save_logs_refuses_a_logs_directory_that_is_a_link(run_dir: RunDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "ssh"
    elsewhere.mkdir()
    (run_dir.files.logs / "master.log").unlink(missing_ok=True)
    run_dir.files.logs.rmdir()
    run_dir.files.logs.symlink_to(elsewhere, target_is_directory=True)
    assert save_logs([copy()], run_dir.files.logs) == []
    assert list(elsewhere.iterdir()) == []


def test_save_logs_refuses_a_fifo_without_blocking(run_dir: RunDir) -> None:
    os.mkfifo(run_dir.files.logs / "master.log")
    assert bounded(lambda: save_logs([copy()], run_dir.files.logs)) == []


def test_save_logs_refuses_a_hard_link(run_dir: RunDir) -> None:
    other = run_dir.path / "spec.json"
    before = other.read_bytes()
    os.link(other, run_dir.files.logs / "master.log")
    assert save_logs([copy()], run_dir.files.logs) == []
    assert other.read_bytes() == before


def test_save_logs_appends_to_a_regular_file_and_creates_logs(run_dir: RunDir) -> None:
    (run_dir.files.logs / "master.log").write_bytes(b"earlier\n")
    assert save_logs([copy(), copy("group")], run_dir.files.logs) == [run_dir.files.logs / "master.log",
                                                                      run_dir.files.logs / "group-unknown.log"]
    expected = b"earlier\n--- launcher: output of container x ---\nhello\n"
    assert (run_dir.files.logs / "master.log").read_bytes() == expected


def test_labels_naming_a_world_writable_or_foreign_directory_are_not_trusted(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert logs_dir_for(None, {RESULTS_LABEL: str(shared), USER_LABEL: str(os.getuid())}) is None
    mine = tmp_path / "mine"
    mine.mkdir()
    assert logs_dir_for(None, {RESULTS_LABEL: str(mine), USER_LABEL: str(os.getuid())}) == mine / "logs"
    if os.geteuid() == 0:  # a directory of uid 4918 labelled as uid 4917's run
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 4918, 4918)
        assert logs_dir_for(None, {RESULTS_LABEL: str(theirs), USER_LABEL: "4917"}) is None
    link = tmp_path / "link"
    link.symlink_to(mine, target_is_directory=True)
    assert logs_dir_for(None, {RESULTS_LABEL: str(link), USER_LABEL: str(os.getuid())}) is None


# ------------------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("plant", ["fifo", "dev_zero", "invalid_utf8", "huge", "link_out", "not_object", "deep"])
def test_status_summary_and_record_that_a_container_planted_are_refused(run_dir: RunDir, tmp_path: Path,
                                                                         plant: str) -> None:
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"mean_return": 1234.5, "env_steps": 99}))
    for name in ("status.json", "summary.json"):
        path = run_dir.path / name
        if plant == "fifo":
            os.mkfifo(path)
        elif plant == "dev_zero":
            path.symlink_to("/dev/zero")
        elif plant == "invalid_utf8":
            path.write_bytes(b'{"mean_return": "\xff\xfe"}')
        elif plant == "huge":
            with open(path, "wb") as fh:
                fh.truncate(safefs.MAX_JSON_BYTES + 1)  # sparse: no disk used
        elif plant == "link_out":
            path.symlink_to(outside)
        elif plant == "not_object":
            path.write_text("[1, 2, 3]")
        elif plant == "deep":
            path.write_text("[" * 100_000 + "]" * 100_000)
    row = bounded(lambda: describe(run_dir, seen=lambda rd, rec: Seen(unreachable="no engine here")))
    assert row.last_return is None and row.steps is None  # nothing read through the link or the junk
    assert row.status == "finished"  # run.json itself was fine
    assert bounded(lambda: safefs.read_json_at(run_dir.path / "status.json")) is None


def test_run_json_replaced_by_a_fifo_reads_as_empty(run_dir: RunDir) -> None:
    run_dir.record.unlink()
    os.mkfifo(run_dir.record)
    assert bounded(run_dir.read_record) == {}


def test_metrics_fifo_does_not_block_history(run_dir: RunDir) -> None:
    os.mkfifo(run_dir.files.metrics)
    bounded(lambda: describe(run_dir, seen=lambda rd, rec: Seen(unreachable="no engine here")))


def test_refusals_say_which_file_and_why(run_dir: RunDir) -> None:
    os.mkfifo(run_dir.path / "status.json")
    with pytest.raises(safefs.UnsafeFile, match=r"status\.json.*FIFO"):
        safefs.load_json(run_dir.path, "status.json")
    (run_dir.path / "summary.json").symlink_to("/etc/hostname")
    with pytest.raises(safefs.UnsafeFile, match="symbolic link"):
        safefs.load_json(run_dir.path, "summary.json")
    with pytest.raises(ValueError):
        safefs.read_bytes(run_dir.path, "../escape")


def test_logs_read_back_never_through_a_link(run_dir: RunDir, tmp_path: Path) -> None:
    victim = tmp_path / "private"
    victim.write_bytes(b"TOP SECRET\n")
    (run_dir.files.logs / "master.log").symlink_to(victim)
    (run_dir.files.logs / "group-0.log").write_bytes(b"group output\n")
    files = log_files(run_dir)
    with pytest.raises(safefs.UnsafeFile):
        safefs.read_tail(run_dir.path, f"logs/{files['master'].name}")
    assert safefs.read_tail(run_dir.path, "logs/group-0.log") == b"group output\n"
    big = run_dir.files.logs / "group-1.log"
    big.write_bytes(b"a" * 100 + b"END")
    assert safefs.read_tail(run_dir.path, "logs/group-1.log", max_bytes=3).endswith(b"\nEND")


def test_eval_refuses_a_planted_policy_without_blocking(run_dir: RunDir, tmp_path: Path) -> None:
    """``launcher eval`` reads model/policy.npz, which the master container writes: a FIFO there hung it at
    c1dca51 (np.load on the path)."""
    from launcher.errors import BadInput
    from launcher.eval_policy import _npz

    model = run_dir.path / "model"
    model.mkdir()
    os.mkfifo(model / "policy.npz")
    with pytest.raises(BadInput, match="FIFO"):
        bounded(lambda: _npz(model / "policy.npz"))
    (model / "best_policy.npz").symlink_to(tmp_path / "elsewhere.npz")
    with pytest.raises(BadInput, match="symbolic link"):
        bounded(lambda: _npz(model / "best_policy.npz"))


def test_a_capped_append_rotates_once_and_keeps_the_end(tmp_path: Path) -> None:
    """Kept container logs (Docker's logs/master.log) are capped with one rotated copy (issue 25, item 6)."""
    cap = 1000
    for i in range(5):  # five sessions of a resumed run, 600 bytes each
        safefs.append(tmp_path, "logs/master.log", f"{i}".encode() * 600, cap_bytes=cap)
    log, kept = (tmp_path / "logs" / "master.log").read_bytes(), (tmp_path / "logs" / "master.log.1").read_bytes()
    assert len(log) <= cap + 200 and log.endswith(b"4" * 600) and b"passed 1000 bytes" in log
    assert kept.endswith(b"3" * 600) and len(kept) <= cap + 200
    safefs.append(tmp_path, "logs/group-0.log", b"a" * 5000 + b"END", cap_bytes=cap)  # one part bigger than the cap
    one = (tmp_path / "logs" / "group-0.log").read_bytes()
    assert one.endswith(b"END") and len(one) <= cap + 200 and b"left out" in one
    (tmp_path / "logs" / "group-1.log.1").symlink_to(tmp_path / "victim")  # a planted link as the rotated name
    (tmp_path / "logs" / "group-1.log").write_bytes(b"b" * 900)
    safefs.append(tmp_path, "logs/group-1.log", b"c" * 300, cap_bytes=cap)
    assert not (tmp_path / "victim").exists() and (tmp_path / "logs" / "group-1.log").read_bytes().endswith(b"c" * 300)
