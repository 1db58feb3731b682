"""`launcher check`'s host probes for real: no Docker engine in reach, a results directory that cannot hold runs,
and a policy file that does not parse. Each runs the command in a subprocess with the machine as it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.check_probes import probe_python, probe_results

REPO = Path(__file__).resolve().parents[3]
NO_ENGINE = "unix:///nonexistent/docker.sock"


def _check(*args: str, **env: str) -> tuple[int, dict[str, Any], str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NVML_STUB_CONFIG")}
    out = subprocess.run([sys.executable, "-m", "launcher", "check", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**environ, "DOCKER_HOST": NO_ENGINE, **env})
    doc = json.loads(out.stdout) if "--json" in args else {}
    return out.returncode, doc, out.stdout


def _checks(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def test_no_engine_blocks_the_docker_backend_and_auto_uses_processes(tmp_path: Path) -> None:
    code, doc, _ = _check("--json", "--cpu", "--backend", "docker", "--results", str(tmp_path))
    engine = _checks(doc)["docker engine"]
    assert (code, doc["blocking"]) == (6, ["docker engine"])
    assert engine["status"] == "missing" and NO_ENGINE in engine["detail"]
    assert "sudo systemctl start docker" in engine["next_step"]
    code, doc, _ = _check("--json", "--cpu", "--results", str(tmp_path))
    assert doc["backend"] == "process" and doc["backend_why"] == "auto: no Docker engine, so local processes"
    assert _checks(doc)["docker engine"]["needed_for"] == []
    assert code == (0 if doc["ready"] else 6) and "docker engine" not in doc["blocking"]


def test_the_text_report_ends_with_the_verdict_and_each_problem_has_a_next_step(tmp_path: Path) -> None:
    code, _, text = _check("--cpu", "--backend", "docker", "--results", str(tmp_path))
    lines = text.splitlines()
    assert code == 6 and lines[-1].startswith("not ready: a CPU-only run cannot start here (backend docker")
    assert lines[-1].endswith("fix: docker engine")
    problems = [i for i, x in enumerate(lines) if x.startswith(("missing", "broken"))]
    assert problems and all(lines[i + 1].lstrip().startswith("next: ") for i in problems)
    assert any(x.startswith("missing  docker engine") and x.endswith("(needed)") for x in lines)


def test_a_results_path_under_a_file_is_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, doc, _ = _check("--json", "--cpu", "--backend", "process", "--results", str(blocker / "results"))
    line = _checks(doc)["results dir"]
    assert code == 6 and "results dir" in doc["blocking"] and line["status"] == "broken"
    assert "is not writable" in line["detail"] and "--results DIR" in line["next_step"]


def test_a_results_dir_is_measured_where_it_will_be(tmp_path: Path) -> None:
    probe = probe_results(tmp_path / "not" / "yet")
    st = os.statvfs(tmp_path)
    assert probe.writable and probe.probed == str(tmp_path) and probe.flock_error is None
    assert abs((probe.free_bytes or 0) - st.f_bavail * st.f_frsize) < 64 * 1024**2
    mounts = [line.split(" - ")[1].split()[0] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert probe.fstype in mounts and probe.mount_point and str(tmp_path).startswith(probe.mount_point)
    assert not list(tmp_path.iterdir())  # the probe's own file is gone


@pytest.mark.parametrize("text, words", [("max_gpus_per_user = -1", "max_gpus_per_user"), ("[[[", "cannot read")])
def test_a_bad_policy_file_blocks_every_run(tmp_path: Path, text: str, words: str) -> None:
    """`up` and `plan` load the policy before placing anything, --gpus none too, and exit 2 on a bad one."""
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    code, doc, _ = _check("--json", "--cpu", "--backend", "process", "--results", str(tmp_path),
                          LAUNCHER_POLICY=str(policy))
    line = _checks(doc)["site policy"]
    assert line["status"] == "broken" and words in line["detail"] and str(policy) in line["detail"]
    assert code == 6 and doc["blocking"] == ["site policy"] and line["needed_for"] == ["gpu", "cpu"]
    up = subprocess.run([sys.executable, "-m", "launcher", "plan", "--gpus", "none", "--workers", "2"], cwd=REPO,
                        capture_output=True, text=True, timeout=60, env={**os.environ, "LAUNCHER_POLICY": str(policy)})
    assert up.returncode == 2 and str(policy) in up.stderr  # what the check foretold


def test_slurm_as_the_backend_with_slurm_conf_naming_no_file(tmp_path: Path) -> None:
    conf = tmp_path / "no-such-slurm.conf"
    code, doc, _ = _check("--json", "--cpu", "--backend", "slurm", "--results", str(tmp_path), SLURM_CONF=str(conf))
    line = _checks(doc)["slurm"]
    assert code == 6 and "slurm" in doc["blocking"] and line["needed_for"] == ["gpu", "cpu"]
    clients = ("sinfo", "sbatch", "srun", "scontrol")
    if all(shutil.which(c) for c in clients):
        assert line["status"] == "broken" and f"SLURM_CONF={conf} names no file" in line["detail"]
        assert "point SLURM_CONF at the cluster's slurm.conf" in line["next_step"]
    else:
        assert line["status"] == "missing" and "slurm-client" in line["next_step"]
        assert all(c in line["detail"] for c in clients if not shutil.which(c))


def test_backend_and_results_come_from_the_config_file_as_for_up(tmp_path: Path) -> None:
    toml = tmp_path / "launcher.toml"
    toml.write_text(f'[up]\nbackend = "process"\nresults = "{tmp_path / "from-file"}"\n')
    _, doc, _ = _check("--json", "--cpu", "--config", str(toml))
    assert (doc["backend"], doc["backend_why"]) == ("process", f"from file {toml}")
    assert _checks(doc)["results dir"]["detail"].startswith(f"{tmp_path / 'from-file'} (not there yet; {tmp_path} is)")
    code, _, _ = _check("--cpu", "--config", str(tmp_path / "none.toml"))
    assert code == 2  # a config file that is not there is bad input, as for up


def test_the_ranges_checked_are_pyprojects() -> None:
    """One truth: the ranges come from the installed launcher's metadata, which pyproject.toml wrote."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["cpu"]]
    probe = probe_python()
    assert sorted(probe.wanted) == sorted(d.split("<")[0].split(">")[0].split("[")[0].lower() for d in declared)
    for dep in declared:
        name = dep.split("<")[0].split(">")[0].split("[")[0].lower()
        assert sorted(probe.wanted[name].split(",")) == sorted(dep[len(name):].split(","))
    assert all(probe.packages[n] for n in probe.wanted if n != "tensorflow-cpu")
