"""`launcher check` on this machine's real Docker engine: no GPU here, an engine present, and an image the engine
does not have (a tag nobody builds: cheaper than a fresh engine, and the same answer from the engine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from launcher import schemas
from launcher.check import DockerProbe, ImageProbe, Status, gpu_container_lines
from launcher.check_probes import CHECK_LABEL, probe_gpu_container
from launcher.engine import Engine
from launcher.engine.client import connect_client
from launcher.errors import LauncherError
from launcher.gpu.snapshots import GpuInfo, Inventory
from launcher.image import BuildOptions, Flavour, choose_build_path, default_tag
from tests.nvml_fixtures import NvmlStub, machine
from tests.testbed.bed import BedSpec

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
ABSENT = "launcher-check-absent:never"


def _check(tmp_path: Path, *args: str, **extra: str) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NVML_STUB_CONFIG")}
    env.update(extra)
    out = subprocess.run([sys.executable, "-m", "launcher", "check", "--json", "--results", str(tmp_path / "r"), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    doc: dict[str, Any] = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.CHECK_SCHEMA))
    assert out.returncode == (0 if doc["ready"] else 6), (out.returncode, doc["blocking"], out.stderr[-2000:])
    return out.returncode, doc


def _checks(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def _has_nvml() -> bool:
    """Whether this host has an NVIDIA library, asked in a fresh process: this one may hold the stand-in."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NVML_STUB_CONFIG")}
    return subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"], env=env,
                          capture_output=True, timeout=30).returncode == 0


def _absent(client: Any) -> None:
    names = {t for image in client.images.list() for t in image.tags}
    assert ABSENT not in names, f"{ABSENT} exists on this engine; remove it (`docker rmi {ABSENT}`)"


def test_this_machine_no_gpu_engine_present(docker_client: Any, tmp_path: Path) -> None:
    """A GPU run here: the engine is fine, NVML is not there, so the run cannot start and the line says how."""
    if _has_nvml():
        pytest.skip("this host has an NVIDIA driver library; the no-GPU verdict is for hosts without one")
    _absent(docker_client)
    code, doc = _check(tmp_path, "--image", ABSENT)
    checks = _checks(doc)
    info = docker_client.info()
    assert (doc["backend"], doc["target"], code) == ("docker", "gpu", 6)
    engine = checks["docker engine"]
    assert engine["status"] == "ok" and engine["detail"].startswith(docker_client.version()["Version"])
    assert ("rootless" in engine["detail"]) == any("rootless" in s for s in info.get("SecurityOptions") or [])
    runtime_ok = "nvidia" in (info.get("Runtimes") or {})
    assert checks["gpu runtime"]["status"] == ("ok" if runtime_ok else "missing")
    nvml = checks["nvml"]
    assert nvml["status"] == "missing" and "libnvidia-ml.so.1 was not found" in nvml["detail"]
    assert "install the NVIDIA driver" in nvml["next_step"] and "nvml" in doc["blocking"]
    assert checks["gpus in a container"]["status"] == "skipped"
    assert checks["gpus in a container"]["detail"] == f"not started: the image {ABSENT} is not on the engine"
    assert checks["results dir"]["status"] == "ok" and checks["python"]["status"] == "ok"


def test_an_image_the_engine_does_not_have(docker_client: Any, tmp_path: Path) -> None:
    """A CPU run in containers with an image that is not there: `up` would build it, so the verdict follows the
    build path this host has (asked here directly, the way `up` asks)."""
    _absent(docker_client)
    code, doc = _check(tmp_path, "--cpu", "--image", ABSENT)
    image = _checks(doc)["image"]
    assert image["status"] == "missing" and image["detail"].startswith(f"{ABSENT} is not on the engine")
    try:
        path = choose_build_path("auto", BuildOptions(tag=ABSENT, flavour=Flavour.CPU), docker_client)
    except LauncherError:
        assert (code, doc["blocking"]) == (6, ["image"]) and "--image NAME" in image["next_step"]
    else:
        assert code == 0 and image["needed_for"] == [] and path.why in image["detail"]
        assert image["next_step"] == f"build it ahead: `launcher build --tag {ABSENT}`"


def test_a_gpu_container_the_engine_cannot_start_is_broken(docker_client: Any, pause_image: str) -> None:
    """The engine is told to hand a GPU to a container (as when the toolkit is registered but broken): the engine's
    refusal becomes a broken line with the toolkit's next step, and no container is left behind."""
    if "nvidia" in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("this engine has the NVIDIA runtime; the refusal needs an engine without it")
    engine = Engine()
    try:
        gpu = GpuInfo(0, "GPU-00000000-1111-2222-3333-000000000000", "stand-in", "", 1, 0, 1, 0, 0)
        probe = probe_gpu_container(engine, ImageProbe(pause_image, present=True),
                                    DockerProbe(server_version="x", runtimes=("nvidia", "runc")),
                                    Inventory(gpus=(gpu,)))
        assert probe is not None and probe.given == (gpu.uuid,) and probe.error, probe
        line = gpu_container_lines(probe)[0]
        assert line.status is Status.BROKEN and "nvidia-ctk runtime configure" in str(line.next_step)
        assert "could not select device driver" in line.detail, line.detail  # the engine's own words
        assert not docker_client.containers.list(all=True, filters={"label": CHECK_LABEL})
    finally:
        engine.close()


def test_swarm_as_the_backend_on_an_engine_outside_a_swarm(docker_client: Any, tmp_path: Path) -> None:
    state = (docker_client.info().get("Swarm") or {}).get("LocalNodeState")
    if state == "active":
        pytest.skip("this engine is in a swarm; the test bed's swarm tests cover a manager")
    code, doc = _check(tmp_path, "--cpu", "--backend", "swarm", "--image", ABSENT)
    line = _checks(doc)["swarm"]
    assert code == 6 and "swarm" in doc["blocking"] and line["status"] == "missing"
    assert line["detail"] == f"this engine is not in a swarm (state {state})"
    assert "docker swarm init" in line["next_step"]


@pytest.mark.testbed
def test_an_engine_with_no_images_at_all(fresh_engine: Any, tmp_path: Path) -> None:
    """A fresh machine's engine (the test bed's: empty data root, no route out): the engine answers, the image is
    missing, and whether a CPU run can start is whether the build path `up` would choose exists there."""
    node = fresh_engine.nodes[0]
    env = {"DOCKER_HOST": node.docker_host}
    code, doc = _check(tmp_path, "--cpu", **env)
    checks = _checks(doc)
    assert doc["backend"] == "docker" and checks["docker engine"]["status"] == "ok"
    image = checks["image"]
    assert image["status"] == "missing" and re.match(r"launcher:\S+-cpu is not on the engine", image["detail"])
    client = connect_client(30, docker_host_url=node.docker_host)
    try:
        assert client.images.list(all=True) == []
        try:
            path = choose_build_path("auto", BuildOptions(tag="launcher:x-cpu", flavour=Flavour.CPU), client)
        except LauncherError:
            assert (code, doc["blocking"]) == (6, ["image"])
        else:
            assert code == 0 and path.offline and "building offline" in image["detail"]
    finally:
        client.close()
    code, doc = _check(tmp_path, **env)  # a GPU run there: the container check is skipped, saying why
    assert code == 6 and _checks(doc)["gpus in a container"]["detail"].endswith("is not on the engine")


@pytest.mark.testbed
def test_gpus_given_to_a_container_on_an_engine_with_the_stand_in_toolkit(nvidia_engine: Any, nvml_stub: NvmlStub,
                                                                          tmp_path: Path) -> None:
    """The whole GPU path short of a real driver: the stand-in NVML lists two GPUs, the test bed's engine has the
    nvidia runtime and the stand-in hook (which mounts nothing, as a broken toolkit would), and the image is
    there. The engine runs the hook for the check's container; the container sees 0 of its 2 GPUs: broken.
    The bed is the session's (shared with test_gpu_detached.py); its image is ``$LAUNCHER_TEST_IMAGE``."""
    image = os.environ.get("LAUNCHER_TEST_IMAGE", default_tag(Flavour.CPU))  # what nvidia_engine copied
    node = nvidia_engine.manager
    before = node.hook_log.read_text() if node.hook_log.exists() else ""
    nvml_stub.configure(machine(2))
    out = subprocess.run([sys.executable, "-m", "launcher", "check", "--json", "--backend", "docker", "--image", image,
                          "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180,
                         env=nvml_stub.env(DOCKER_HOST=node.docker_host))
    doc = json.loads(out.stdout)
    checks = _checks(doc)
    client = connect_client(30, docker_host_url=node.docker_host)
    try:
        labels = client.api.inspect_image(image)["Config"].get("Labels") or {}
    finally:
        client.close()
    cpu_only = labels.get("launcher.tf-package") == "tensorflow-cpu"  # the suite's worker image is the CPU one
    assert checks["gpu runtime"]["status"] == "ok" and checks["image"]["status"] == ("broken" if cpu_only else "ok")
    assert checks["nvml"]["detail"] == "driver 550.54.15, 2 GPU(s), 2 usable"
    line = checks["gpus in a container"]
    assert line["status"] == "broken" and line["detail"] == f"a container of {image} was given 2 GPU(s) and saw 0 " \
                                                            "device node(s)", line
    assert out.returncode == 6 and "gpus in a container" in doc["blocking"] and "nvidia-smi -L" in line["next_step"]
    after = node.hook_log.read_text() if node.hook_log.exists() else ""
    assert len(after) > len(before), "the engine did not run the nvidia hook for the check's container"
    client = connect_client(30, docker_host_url=node.docker_host)
    try:
        assert not client.containers.list(all=True, filters={"label": CHECK_LABEL})
    finally:
        client.close()


@pytest.mark.testbed
def test_a_swarm_manager_and_the_gpus_its_nodes_advertise(bed_factory: Any, tmp_path: Path) -> None:
    """A two-node swarm of the test bed (no registry): the manager advertises no GPU, the worker two made-up
    ones. On the manager the check counts two; on the worker it says to run on a manager."""
    bed = bed_factory(BedSpec(nodes=2, swarm=True, registry=False, gpus=(0, 2)))
    code, doc = _check(tmp_path, "--backend", "swarm", "--image", ABSENT, DOCKER_HOST=bed.manager.docker_host)
    line = _checks(doc)["swarm"]
    assert line["status"] == "ok" and line["detail"] == "this engine is a swarm manager; its ready nodes advertise " \
                                                        "2 GPU(s)", line
    assert "swarm gpus" not in _checks(doc) and "nvml" not in doc["blocking"]  # the nodes' GPUs count, not ours
    worker = next(n for n in bed.nodes if n.name != bed.manager.name)
    code, doc = _check(tmp_path, "--cpu", "--backend", "swarm", "--image", ABSENT, DOCKER_HOST=worker.docker_host)
    line = _checks(doc)["swarm"]
    assert code == 6 and doc["blocking"] == ["swarm"] and "docker node promote" in line["next_step"]
