"""What a run's containers write reaches the terminal typed and escaped (issue 25, finding 6).

``summary.json`` and ``status.json`` are the run's to write. An OSC-52 escape (``ESC ] 52 ; c ; <base64> BEL``:
"set the clipboard") in ``outcome`` used to be printed as is by ``launcher status``, and ``"mean_return": "x"``
made the attached progress reporter raise ``ValueError``. Real run directories and the real CLI in a child
process; the progress reporters fed exactly what the supervisor reads.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from launcher.progress import PlainReporter, Tracker
from launcher.progress_live import LiveReporter
from launcher.rundata import printable, status_doc, summary_doc
from launcher.runs import create_run_dir
from tests.helpers import ROOT, child_env

OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # would put "hello" on the terminal's clipboard
HOSTILE_STATUS = {"schema": "launcher.status/v1", "run_id": "r\x1b[2J", "state": "running", "env_steps": "lots",
                  "mean_return": "x", "best_mean_return": [1], "env_steps_per_s": {"a": 1}, "updates": 3.5,
                  "target": {"max_steps": "never", "until_return": "x"}, "checkpoint": {"updates": "y", "age_s": "z"},
                  "policy_lag": {"mean": "m", "max": None, "dropped": "d"}, "network": {"rejected.bad": "y"},
                  "groups": {"x": {"connected": True}, "0": {"workers": "many", "connected": "yes",
                                                            "mean_return": "x", "env_steps": OSC52}}}


def _finished_run(root: Path) -> str:
    rid = "cartpole-ppo-20260101-000000-abcd"
    rd = create_run_dir(root, rid)
    (rd.path / "spec.json").write_text(json.dumps({"env_id": OSC52, "groups": ["not a group", {"workers": "x"}]}))
    rd.update_record(run_id=rid, backend="process", state="finished", pids={}, env_id=OSC52, workers="many")
    rd.files.summary.write_text(json.dumps({"schema": "launcher.summary/v1", "outcome": OSC52, "mean_return": "x",
                                            "best_mean_return": "y", "env_steps": "lots",
                                            "error": {"type": "E\x1b[31m", "message": "m", "where": "w"}}))
    rd.files.status.write_text(json.dumps(HOSTILE_STATUS))
    return rid


def _launcher(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)


def test_status_and_runs_print_the_escape_escaped_and_survive_wrong_types(tmp_path: Path) -> None:
    rid = _finished_run(tmp_path)
    status = _launcher("status", rid, "--results", str(tmp_path))
    assert status.returncode == 0, status.stderr
    assert "\x1b" not in status.stdout and "\x07" not in status.stdout, repr(status.stdout)
    # An outcome that is not one of worker.ending.Outcome's is not an outcome: not shown at all.
    assert "52;c;" not in status.stdout and "finished" in status.stdout, status.stdout
    assert "return -" in status.stdout  # "x" is not a number: not shown, not a crash
    assert "error       E\\x1b[31m: m (in w)" in status.stdout, status.stdout
    runs = _launcher("runs", "--results", str(tmp_path))
    assert runs.returncode == 0, runs.stderr
    assert rid in runs.stdout and "\x1b" not in runs.stdout and "\\x1b]52" in runs.stdout, runs.stdout
    listed = _launcher("status", "--results", str(tmp_path), "--json")
    assert listed.returncode == 0 and "\x1b" not in listed.stdout, listed.stderr
    # (the engine may be shared: runs it knows by label are listed too)
    (doc,) = [r for r in json.loads(listed.stdout)["runs"] if r["run_id"] == rid]
    assert doc["outcome"] is None and doc["mean_return"] is None  # not an Outcome: left out, not echoed


def test_the_progress_reporters_take_a_hostile_status_without_raising() -> None:
    plain = io.StringIO()
    rep = PlainReporter(plain, interval_s=0.0, gpu_reader=None)
    rep("prepared", {"run_id": "r1", "results": "/x", "plan": None})
    rep("status", {"status": HOSTILE_STATUS, "backend": None, "restarts": {}})
    rep.emit_progress()
    rep("result", {"run_id": "r1", "state": "finished", "exit_code": 0, "summary": {"mean_return": "x"}, "wall_s": 1})
    rep.close()
    out = plain.getvalue()
    assert "\x1b" not in out and " mean_return=- " in out, out
    tracker = Tracker()
    tracker.update("status", {"status": HOSTILE_STATUS})
    snap = tracker.snapshot()
    assert (snap.mean_return, snap.steps, snap.run_id) == (None, 0, "r\\x1b[2J")
    assert [(g.index, g.workers, g.recent_return) for g in snap.groups] == [(0, None, None)]
    from rich.console import Console

    live = LiveReporter(console=Console(file=io.StringIO(), width=120, force_terminal=True))
    try:
        live("prepared", {"run_id": "r1", "results": "/x", "plan": None})
        live("status", {"status": HOSTILE_STATUS, "backend": None, "restarts": {}})
        screen = Console(width=120, record=True, file=io.StringIO())
        screen.print(live.render())
        assert "\x1b" not in screen.export_text()
    finally:
        live.close()


def test_the_filters_keep_what_the_schema_allows_and_escape_every_string() -> None:
    assert printable("a\x1bb\n\u2028\x7f") == "a\\x1bb\\n\\u2028\\x7f"
    assert printable("x" * 500).endswith("...") and len(printable("x" * 500)) == 403
    good = {"schema": "launcher.status/v1", "env_steps": 5, "mean_return": 1.5, "groups": {"0": {"workers": 2}},
            "error": {"message": "bad\x1b"}, "extra": {"deep": ["\x07"]}}
    assert status_doc(good) == {**good, "error": {"message": "bad\\x1b"}, "extra": {"deep": ["\\x07"]}}
    assert status_doc("not an object") == {} and status_doc(None) == {}
    assert summary_doc({"outcome": 3, "mean_return": True, "env_steps": 7}) == {"env_steps": 7}


def _on_a_terminal(*args: str) -> bytes:
    """``launcher ARGS`` with stdout on a pseudo-terminal; what it wrote there."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=ROOT, env=child_env(), stdout=follower,
                            stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    return b"".join(chunks)


def test_logs_on_a_terminal_show_escapes_escaped_and_piped_logs_stay_byte_exact(tmp_path: Path) -> None:
    rid = _finished_run(tmp_path)
    logs = tmp_path / rid / "logs"
    logs.mkdir(exist_ok=True)
    written = b"step 1\r step 2\tdone\n" + OSC52.encode() + b"\xc2\x9b2J caf\xc3\xa9\n"
    (logs / "master.log").write_bytes(written)
    shown = _on_a_terminal("logs", rid, "--master", "--results", str(tmp_path))
    assert b"\x1b" not in shown and b"\x07" not in shown and b"\xc2\x9b" not in shown, shown
    assert b"\\x1b]52;c;aGVsbG8=\\x07" in shown and b"\\xc2\\x9b2J caf\xc3\xa9" in shown and b"step 2\tdone" in shown
    piped = subprocess.run([sys.executable, "-m", "launcher", "logs", rid, "--master", "--results", str(tmp_path)],
                           cwd=ROOT, env=child_env(), capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == written
