"""`launcher check`'s verdicts (launcher/check.py) over made-up probe results: which line blocks which kind of
run, and the next step each problem names. The probes themselves run for real in test_check_machine.py
(this machine, the Docker engine) and tests/unit/gpu/test_check_nvml.py (the stand-in NVML)."""

from __future__ import annotations

from dataclasses import replace

import jsonschema

from launcher import schemas
from launcher.check import (CPU, GPU, DockerProbe, GpuContainerProbe, ImageProbe, Line, NvmlProbe, Probes,
                            PythonProbe, ResultsProbe, SlurmProbe, Status, StoreProbe, build_report, results_lines)
from launcher.gpu.snapshots import GpuError, GpuInfo, Inventory, MigDevice

GiB = 1024**3
PACKAGES = {"numpy": "2.0", "gymnasium": "1.0", "docker": "7.1", "nvidia-ml-py": "12.5", "matplotlib": "3.9",
            "rich": "13.0", "tensorflow": "2.20", "tensorflow-cpu": None}


def _gpu(index: int, **kw: object) -> GpuInfo:
    base = dict(index=index, uuid=f"GPU-{index}", name="NVIDIA A100-SXM4-80GB", pci_bus_id="", memory_total_bytes=80 * GiB,
                memory_used_bytes=0, memory_free_bytes=80 * GiB, gpu_utilization_pct=0, memory_utilization_pct=0,
                processes=(), mig_mode=False, mig_devices=())
    base.update(kw)
    return GpuInfo(**base)  # type: ignore[arg-type]


def _probes(**kw: object) -> Probes:
    """A machine where a GPU run on Docker can start; tests break one thing at a time."""
    base = dict(
        backend="docker", backend_why="test",
        python=PythonProbe((3, 11, 9), "/usr/bin/python3", PACKAGES),
        docker=DockerProbe(server_version="27.1", api_version="1.46", runtimes=("nvidia", "runc")),
        nvml=NvmlProbe(inventory=Inventory(gpus=(_gpu(0), _gpu(1)), driver_version="550.54.15")),
        store=StoreProbe(),
        results=ResultsProbe("/r", "/r", True, free_bytes=100 * GiB, fstype="ext4", mount_point="/"),
        image=ImageProbe("launcher:0.1.0-gpu", present=True, image_id="sha256:abc"),
        gpu_container=GpuContainerProbe("launcher:0.1.0-gpu", ("GPU-0", "GPU-1"), seen=2),
    )
    base.update(kw)
    return Probes(**base)  # type: ignore[arg-type]


def _line(lines: tuple[Line, ...], name: str) -> Line:
    return next(line for line in lines if line.name == name)


def test_a_healthy_gpu_machine_is_ready_and_its_document_is_valid() -> None:
    report = build_report(_probes())
    assert report.ready and report.target == GPU, [x for x in report.lines if x.status is not Status.OK]
    assert _line(report.lines, "nvml").detail == "driver 550.54.15, 2 GPU(s), 2 usable"
    doc = report.to_dict()
    jsonschema.validate(doc, schemas.load(schemas.CHECK_SCHEMA))
    assert doc["ready"] is True and doc["blocking"] == []


def test_no_driver_blocks_a_gpu_run_but_not_a_cpu_run() -> None:
    p = _probes(nvml=NvmlProbe(inventory=Inventory(unavailable_reason="no GPUs: the NVIDIA kernel driver is not loaded",
                                                    hint="load the module (`sudo modprobe nvidia`)")),
                gpu_container=GpuContainerProbe("x", skipped="not started: no GPUs"))
    gpu = build_report(p)
    assert [x.name for x in gpu.blocking] == ["nvml"]
    assert _line(gpu.lines, "nvml").next_step == "load the module (`sudo modprobe nvidia`)"
    cpu = build_report(p, cpu=True)
    assert cpu.ready and cpu.target == CPU and all(x.name != "nvml" for x in cpu.lines)


def test_a_hung_driver_is_broken_with_its_hint() -> None:
    p = _probes(nvml=NvmlProbe(error="the NVIDIA driver did not answer within 0.5 s", hint="check `dmesg`",
                               timed_out=True, timeout_s=0.5))
    line = _line(build_report(p).lines, "nvml (deadline)")
    assert (line.status, line.next_step, line.needed_for) == (Status.BROKEN, "check `dmesg`", (GPU,))


def test_mig_on_without_instances_is_unusable_and_a_lost_gpu_is_broken() -> None:
    mig = _gpu(0, mig_mode=True, mig_devices=())
    inv = Inventory(gpus=(mig,), errors=(GpuError(1, "GPU-1", "GPU is lost"),), driver_version="550")
    report = build_report(_probes(nvml=NvmlProbe(inventory=inv)))
    assert [x.name for x in report.blocking] == ["nvml"]  # no usable GPU at all
    assert _line(report.lines, "GPU 0").status is Status.MISSING and "-mig 0" in str(_line(report.lines, "GPU 0").next_step)
    lost = [x for x in report.lines if x.name == "GPU 1"][0]
    assert lost.status is Status.BROKEN and "nvidia-smi -r -i 1" in str(lost.next_step)
    with_instance = replace(mig, mig_devices=(MigDevice(0, "MIG-0", 10 * GiB, 0, 10 * GiB, 1, ()),))
    ok = build_report(_probes(nvml=NvmlProbe(inventory=Inventory(gpus=(with_instance,), driver_version="550"))))
    assert ok.ready and "MIG on, 1 instance(s)" in _line(ok.lines, "GPU 0").detail


def test_no_gpu_runtime_blocks_gpu_containers_only() -> None:
    p = _probes(docker=DockerProbe(server_version="27.1", api_version="1.46", runtimes=("runc",), rootless=True))
    line = _line(build_report(p).lines, "gpu runtime")
    assert line.blocks(GPU) and "nvidia-ctk runtime configure" in str(line.next_step) and "rootless" in str(line.next_step)
    assert build_report(p, cpu=True).ready
    cdi = _probes(docker=DockerProbe(server_version="27.1", api_version="1.46", runtimes=("runc",),
                                     cdi_spec_dirs=("/etc/cdi",)))
    cdi_line = _line(build_report(cdi).lines, "gpu runtime")  # `up` needs the nvidia runtime: CDI alone is not it
    assert cdi_line.blocks(GPU) and "CDI spec dirs /etc/cdi" in cdi_line.detail
    assert build_report(replace(p, backend="process")).ready  # the process backend needs no GPU runtime


def test_a_container_that_sees_fewer_gpus_than_given_is_broken() -> None:
    report = build_report(_probes(gpu_container=GpuContainerProbe("img", ("GPU-0", "GPU-1"), seen=1)))
    assert [x.name for x in report.blocking] == ["gpus in a container"]
    assert "given 2 GPU(s) and saw 1" in report.blocking[0].detail


def test_no_engine_blocks_docker_but_auto_falls_back_to_processes() -> None:
    down = DockerProbe(error="no Docker engine answers (DOCKER_HOST=unix:///nope)")
    docker = build_report(_probes(docker=down, image=None, gpu_container=None), cpu=True)
    assert [x.name for x in docker.blocking] == ["docker engine"]
    assert "systemctl start docker" in str(docker.blocking[0].next_step)
    process = build_report(_probes(backend="process", docker=down, image=None, gpu_container=None), cpu=True)
    assert process.ready and _line(process.lines, "docker engine").status is Status.MISSING


def test_tensorflow_on_the_host_matters_for_the_process_backend_only() -> None:
    cpu_tf = {**PACKAGES, "tensorflow": None, "tensorflow-cpu": "2.21"}
    p = _probes(backend="process", python=PythonProbe((3, 11, 9), "/v/bin/python", cpu_tf), image=None,
                gpu_container=None)
    gpu = build_report(p)
    assert [x.name for x in gpu.blocking] == ["tensorflow"] and ".[gpu]" in str(gpu.blocking[0].next_step)
    assert build_report(p, cpu=True).ready
    assert build_report(replace(p, backend="docker")).ready  # in containers the image carries TensorFlow
    none = replace(p, python=PythonProbe((3, 11, 9), "/v/bin/python", {**cpu_tf, "tensorflow-cpu": None}))
    assert [x.name for x in build_report(none, cpu=True).blocking] == ["tensorflow"]


def test_packages_outside_the_launchers_ranges_are_broken_with_a_pinned_install() -> None:
    wanted = {"numpy": "<3,>=1.26", "rich": "<16,>=13", "tensorflow-cpu": "<2.22,>=2.16"}
    old = {**PACKAGES, "numpy": "1.25.2", "rich": None, "tensorflow": None, "tensorflow-cpu": "2.15.1"}
    p = _probes(backend="process", python=PythonProbe((3, 11, 9), "/v/bin/python", old, wanted), image=None,
                gpu_container=None)
    report = build_report(p, cpu=True)
    packages = _line(report.lines, "packages")
    assert packages.status is Status.MISSING and packages.next_step == (
        "`/v/bin/python -m pip install 'rich<16,>=13' 'numpy<3,>=1.26'` (or `scripts/setup.sh`)")
    assert "numpy 1.25.2 (wants <3,>=1.26)" in packages.detail
    assert _line(report.lines, "tensorflow").status is Status.BROKEN
    assert [x.name for x in report.blocking] == ["packages", "tensorflow"]
    fine = replace(p, python=PythonProbe((3, 11, 9), "/v/bin/python", {**PACKAGES, "numpy": "2.0.1"}, wanted))
    assert _line(build_report(fine).lines, "packages").status is Status.OK


def test_a_missing_image_blocks_only_when_it_cannot_be_built() -> None:
    buildable = _probes(image=ImageProbe("launcher:0.1.0-gpu", build_why="the registry answers: building online"),
                        gpu_container=GpuContainerProbe("x", skipped="not started: no image"))
    report = build_report(buildable)
    step = _line(report.lines, "image").next_step
    assert report.ready and step == "build it ahead: `launcher build --tag launcher:0.1.0-gpu --gpu`"
    stuck = replace(buildable, image=ImageProbe("launcher:0.1.0-gpu", build_problem="online, no registry; offline, "
                                                                                   "no debootstrap"))
    assert [x.name for x in build_report(stuck).blocking] == ["image"]


def test_results_dir_full_unwritable_or_without_flock() -> None:
    base = ResultsProbe("/data/r", "/data", True, free_bytes=100 * GiB, fstype="nfs4", mount_point="/data")
    assert results_lines(base)[0].status is Status.OK and "network filesystem" in results_lines(base)[0].detail
    for probe, words in ((replace(base, free_bytes=GiB // 2), "larger disk"),
                         (replace(base, flock_error="OSError: No locks available"), "local disk"),
                         (replace(base, writable=False, write_error="Permission denied"), "--results DIR")):
        line = results_lines(probe)[0]
        assert line.status is Status.BROKEN and line.needed_for == (GPU, CPU) and words in str(line.next_step)


def test_store_policy_and_slurm() -> None:
    bad = build_report(_probes(store=StoreProbe(policy_error="/etc/launcher/policy.toml: max_gpus_per_user: -1")))
    assert [x.name for x in bad.blocking] == ["site policy"]
    insecure = build_report(_probes(store=StoreProbe(store_error="lease store /var/lib/launcher is group-writable")))
    assert [x.name for x in insecure.blocking] == ["lease store"] and "admin init" in str(insecure.blocking[0].next_step)
    slurm = SlurmProbe("--backend slurm", {"sinfo": "/usr/bin/sinfo", "sbatch": None, "srun": None, "scontrol": None})
    report = build_report(_probes(backend="slurm", slurm=slurm, image=None, gpu_container=None))
    assert [x.name for x in report.blocking] == ["slurm"] and "slurm-client" in str(report.blocking[0].next_step)
    advice = build_report(_probes(slurm=replace(slurm, why="sbatch is on PATH")))
    assert advice.ready and _line(advice.lines, "slurm").status is Status.MISSING


def test_swarm_backend_needs_a_manager() -> None:
    worker = DockerProbe(server_version="27", api_version="1.46", runtimes=("nvidia",), swarm_state="active")
    report = build_report(_probes(backend="swarm", docker=worker))
    assert [x.name for x in report.blocking] == ["swarm"] and "docker node promote" in str(report.blocking[0].next_step)
    assert build_report(_probes(backend="swarm", docker=replace(worker, swarm_manager=True))).ready


def test_on_slurm_and_swarm_the_gpus_are_the_nodes_not_this_hosts() -> None:
    no_driver = NvmlProbe(inventory=Inventory(unavailable_reason="no GPUs: no libnvidia-ml.so.1", hint="install it"))
    runc_only = DockerProbe(server_version="27", api_version="1.46", runtimes=("runc",), swarm_state="active",
                            swarm_manager=True, swarm_gpus=0)
    answered = SlurmProbe("--backend slurm", {c: f"/usr/bin/{c}" for c in ("sinfo", "sbatch", "srun", "scontrol")},
                          answer="1 partition(s): batch up 2 (null)", gpus=0)
    slurm = _probes(backend="slurm", nvml=no_driver, slurm=answered, image=None, gpu_container=None)
    report = build_report(slurm)
    assert [x.name for x in report.blocking] == ["slurm gpus"] and "--slurm-partition" in str(report.blocking[0].next_step)
    assert _line(report.lines, "nvml").status is Status.MISSING and _line(report.lines, "nvml").needed_for == ()
    assert build_report(replace(slurm, slurm=replace(answered, gpus=8))).ready
    assert build_report(slurm, cpu=True).ready
    swarm = _probes(backend="swarm", docker=runc_only, nvml=no_driver, gpu_container=None)
    report = build_report(swarm)
    assert [x.name for x in report.blocking] == ["swarm gpus"] and "node-generic-resources" in str(report.blocking[0].next_step)
    assert not _line(report.lines, "gpu runtime").needed_for  # this engine's runtime is not where tasks run
    assert build_report(replace(swarm, docker=replace(runc_only, swarm_gpus=3))).ready


def test_a_gpu_run_on_an_image_with_cpu_tensorflow_is_broken() -> None:
    cpu_image = ImageProbe("launcher:0.1.0-cpu", present=True, image_id="sha256:abc", tf_package="tensorflow-cpu")
    report = build_report(_probes(image=cpu_image))
    assert [x.name for x in report.blocking] == ["image"] and "launcher build --gpu" in str(report.blocking[0].next_step)
    assert build_report(_probes(image=cpu_image), cpu=True).ready
    gpu_image = replace(cpu_image, tf_package="tensorflow[and-cuda]")
    assert build_report(_probes(image=gpu_image)).ready
