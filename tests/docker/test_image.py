"""The worker image: unit tests of launcher.image and launcher.image_build (the Docker API faked at its lowest
layer), the build path chosen on this host and a build stopped by a signal (real engine, no registry), and,
marked ``docker``, tests of the real image built once per session through the offline path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pytest

from launcher import __version__
from launcher.cli.main import main
from launcher.errors import BadInput, ExitCode, LauncherError, MissingDependency
from launcher.engine import connect_client as connect
from launcher.image import OFFLINE_BASE_IMAGE, ONLINE_BASE_IMAGE, BuildOptions, Flavour, choose_build_path, default_tag
from launcher.image_build import (BuildInterrupted, BuildStatus, ImageBuildFailed, build_context, build_image,
                                  ensure_image, push_image)

ROOT = Path(__file__).resolve().parents[2]


# --- unit tests: no engine --------------------------------------------------------------------------


def test_default_tag_carries_version_and_flavour() -> None:
    assert default_tag() == f"launcher:{__version__}-cpu"
    assert default_tag(Flavour.GPU) == f"launcher:{__version__}-gpu"


def test_options_report_every_bad_value_at_once(tmp_path: Path) -> None:
    with pytest.raises(BadInput) as info:
        BuildOptions(tag="Not A Tag", base_image="bad image", context=tmp_path)
    message = str(info.value)
    assert "'Not A Tag'" in message and "'bad image'" in message and "no Dockerfile" in message


def test_buildargs_pick_base_and_tensorflow_by_mode() -> None:
    offline = BuildOptions(tag="launcher:t", offline=True).buildargs()
    assert offline["BASE_IMAGE"] == "launcher-base:bookworm" and offline["OFFLINE"] == "1"
    assert offline["TF_PACKAGE"] == "tensorflow-cpu" and offline["WHEELS_DIR"] == "docker/wheels/cpu"
    online = BuildOptions(tag="launcher:t", flavour=Flavour.GPU).buildargs()
    assert online["BASE_IMAGE"] == "python:3.11-slim-bookworm" and online["OFFLINE"] == "0"
    assert online["TF_PACKAGE"] == "tensorflow[and-cuda]" and online["WHEELS_DIR"] == "docker/wheels/gpu"
    assert online["VERSION"] == __version__


@pytest.mark.parametrize(("tf", "expected"), [
    ("tensorflow-cpu", "tensorflow-cpu>="),
    ("tensorflow[and-cuda]", "tensorflow[and-cuda]>="),
    ("tensorflow-cpu==2.20.0", "tensorflow-cpu==2.20.0"),
])
def test_requirements_come_from_pyproject(tf: str, expected: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "docker/requirements.py"), "--pyproject",
                          str(ROOT / "pyproject.toml"), "--tf", tf, "--build-system"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert any(line.startswith(expected) for line in out), out
    assert any(line.startswith("numpy") for line in out) and any(line.startswith("setuptools") for line in out)


def test_build_context_is_the_allow_list_without_other_flavours_wheels(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    files = ["pyproject.toml", "launcher/__init__.py", "worker/__init__.py", "docker/requirements.py",
             "docker/wheels/cpu/a.whl", "docker/wheels/cpu/.complete-0123", "docker/wheels/gpu/b.whl",
             ".venv/bin/python", ".git/config",
             "launcher/__pycache__/x.pyc", "results/r.json", "docker/build/rootfs/etc/passwd"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    with build_context(BuildOptions(tag="launcher:t", context=tmp_path)) as fileobj:
        names = set(tarfile.open(fileobj=fileobj).getnames())
    assert {"Dockerfile", "pyproject.toml", "launcher/__init__.py", "worker/__init__.py",
            "docker/requirements.py", "docker/wheels/cpu/a.whl"} <= names
    assert not names & {"docker/wheels/gpu/b.whl", "docker/wheels/cpu/.complete-0123", ".venv/bin/python", ".git/config",
                        "launcher/__pycache__/x.pyc", "results/r.json", "docker/build/rootfs/etc/passwd"}


def test_no_engine_names_docker_host_and_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(MissingDependency) as info:
        connect(timeout_s=2)
    assert "DOCKER_HOST=tcp://127.0.0.1:9" in str(info.value) and info.value.hint


class FakeAPI:
    """Stands in for docker.APIClient: the lowest layer launcher.image talks to."""

    def __init__(self, events: Iterable[dict[str, Any]] = (), images: Iterable[str] = ()) -> None:
        self.events = list(events)
        self.present = set(images)
        self.builds: list[dict[str, Any]] = []
        self.pushed: list[tuple[str, str]] = []
        self.labels: dict[str, dict[str, str]] = {}

    def build(self, **kwargs: Any) -> Iterable[dict[str, Any]]:
        self.builds.append({k: v for k, v in kwargs.items() if k != "fileobj"})
        if not any("error" in e for e in self.events):
            self.present.add(kwargs["tag"])
            self.labels[kwargs["tag"]] = dict(kwargs.get("labels") or {})
        return iter(self.events)

    def inspect_image(self, name: str) -> dict[str, Any]:
        from docker.errors import ImageNotFound

        if name not in self.present:
            raise ImageNotFound(f"no such image: {name}")
        return {"Id": "sha256:" + "ab" * 32, "Size": 1_500_000_000, "Config": {"Labels": self.labels.get(name, {})}}

    def tag(self, image: str, repository: str, tag: str) -> bool:
        self.present.add(f"{repository}:{tag}")
        self.labels[f"{repository}:{tag}"] = next((v for k, v in self.labels.items() if k == image), {})
        return True

    def images(self, filters: dict[str, str]) -> list[dict[str, Any]]:
        key, _, value = filters["label"].partition("=")
        return [{"Id": name, "Size": 1} for name, labels in self.labels.items() if labels.get(key) == value]

    def push(self, repository: str, tag: str, stream: bool, decode: bool) -> Iterable[dict[str, Any]]:
        self.pushed.append((repository, tag))
        return iter([{"status": "Pushing", "id": "abc"}, {"status": "pushed"}])


class FakeClient:
    def __init__(self, api: FakeAPI) -> None:
        self.api = api


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """A tiny build context, so faked builds do not tar the real wheel directory."""
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return tmp_path


def test_build_streams_lines_and_builds_without_network_offline(monkeypatch: pytest.MonkeyPatch,
                                                                context: Path) -> None:
    monkeypatch.setattr("launcher.image_build.prepare_offline", lambda options, report, client: None)
    api = FakeAPI(events=[{"stream": "Step 1/2 : FROM x\n"}, {"stream": " ---> abc\n"}, {"aux": {"ID": "x"}}])
    lines: list[str] = []
    result = build_image(BuildOptions(tag="launcher:t", offline=True, context=context), lines.append,
                         FakeClient(api))
    assert result.tag == "launcher:t" and result.size_bytes == 1_500_000_000
    assert "Step 1/2 : FROM x" in lines and "---> abc" in [line.strip() for line in lines]
    assert api.builds[0]["network_mode"] == "none" and api.builds[0]["custom_context"] is True


def test_failed_step_raises_with_the_engines_error_and_last_lines(context: Path) -> None:
    api = FakeAPI(events=[{"stream": "Step 12/30 : RUN pip install\n"},
                          {"error": "The command '/bin/sh -c pip install' returned a non-zero code: 1"}])
    with pytest.raises(ImageBuildFailed) as info:
        build_image(BuildOptions(tag="launcher:t", context=context), client=FakeClient(api))
    assert "returned a non-zero code: 1" in str(info.value) and "Step 12/30" in str(info.value)


def test_unpullable_base_says_to_build_offline(context: Path) -> None:
    api = FakeAPI(events=[{"error": "Get https://registry-1.docker.io/v2/: dial tcp: lookup registry-1.docker.io: "
                                    "no such host"}])
    with pytest.raises(MissingDependency) as info:
        build_image(BuildOptions(tag="launcher:t", context=context), client=FakeClient(api))
    assert "python:3.11-slim-bookworm" in str(info.value) and "--offline" in (info.value.hint or "")


def test_ensure_image_builds_only_when_missing(monkeypatch: pytest.MonkeyPatch, context: Path) -> None:
    monkeypatch.setattr("launcher.image_build.prepare_offline", lambda options, report, client: None)
    api = FakeAPI(images={"launcher:present"})
    lines: list[str] = []
    assert ensure_image("launcher:present", mode="offline", progress=lines.append, client=FakeClient(api)) \
        == "launcher:present"
    assert not api.builds and not lines
    assert ensure_image("launcher:missing", mode="offline", progress=lines.append, client=FakeClient(api),
                        context=context) == "launcher:missing"
    assert len(api.builds) == 1 and "not found; building it offline" in lines[0] and "--build offline" in lines[0]


def test_build_records_carry_phase_and_step(monkeypatch: pytest.MonkeyPatch, context: Path) -> None:
    monkeypatch.setattr("launcher.image_build.prepare_offline", lambda options, report, client: None)
    monkeypatch.setattr("launcher.image_progress.TICK_S", 60.0)  # the ticker's repeats are tested below
    api = FakeAPI(events=[{"stream": "Step 1/2 : FROM x\n"}, {"stream": "Step 2/2 : RUN y\n"}, {"stream": "ok\n"}])
    records: list[BuildStatus] = []
    build_image(BuildOptions(tag="launcher:t", context=context), client=FakeClient(api), on_build=records.append)
    assert [r.phase for r in records] == ["docker build"] * 4
    assert (records[-1].step, records[-1].steps, records[-1].line) == (2, 2, "ok")


def test_a_silent_build_step_still_reports_its_time(context: Path) -> None:
    """A step that prints nothing for a while (a long pip install; debootstrap): its record is repeated every
    tick with the time grown, so the live view and the plain lines never look hung."""

    class SlowAPI(FakeAPI):
        def build(self, **kwargs: Any) -> Iterable[dict[str, Any]]:
            super().build(**kwargs)

            def events() -> Iterable[dict[str, Any]]:
                yield {"stream": "Step 1/1 : RUN pip install\n"}
                time.sleep(2.5)
                yield {"stream": "done\n"}
            return events()

    records: list[BuildStatus] = []
    build_image(BuildOptions(tag="launcher:t", context=context), client=FakeClient(SlowAPI()),
                on_build=records.append)
    repeats = [r for r in records if r.line == "Step 1/1 : RUN pip install"]
    assert len(repeats) >= 3 and repeats[-1].elapsed_s - repeats[0].elapsed_s >= 1.5
    assert records[-1].line == "done" or records[-2].line == "done"


def test_auto_builds_offline_without_a_registry_and_names_what_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                          context: Path) -> None:
    options = BuildOptions(tag="launcher:t", context=context)
    no_registry = lambda image: f"cannot look up {image} in its registry: no such host"  # noqa: E731
    online = choose_build_path("auto", options, FakeClient(FakeAPI(images={ONLINE_BASE_IMAGE})),
                               registry_problem=no_registry)
    assert not online.offline and "is on this engine" in online.why
    assert choose_build_path("offline", options, FakeClient(FakeAPI())).offline
    monkeypatch.setattr("launcher.image.index_problem", lambda: None)
    offline = choose_build_path("auto", options, FakeClient(FakeAPI(images={OFFLINE_BASE_IMAGE})),
                                registry_problem=no_registry)
    assert offline.offline and "no registry answers" in offline.why
    monkeypatch.setattr("launcher.image.shutil.which", lambda name: None)
    monkeypatch.setattr("launcher.image.index_problem", lambda: "the package index x does not answer")
    with pytest.raises(MissingDependency) as info:
        choose_build_path("auto", options, FakeClient(FakeAPI()), registry_problem=no_registry)
    assert info.value.exit_code is ExitCode.MISSING_DEPENDENCY and int(info.value.exit_code) == 6
    message = str(info.value)
    assert "no such host" in message and "debootstrap nor mmdebstrap" in message and "package index" in message
    with pytest.raises(BadInput):
        choose_build_path("sideways", options, FakeClient(FakeAPI()))


def test_push_tags_into_the_registry() -> None:
    api = FakeAPI(images={"launcher:0.1.0-cpu"})
    ref = push_image("launcher:0.1.0-cpu", "registry.example.com:5000/rl/", client=FakeClient(api))
    assert ref == "registry.example.com:5000/rl/launcher:0.1.0-cpu"
    assert api.pushed == [("registry.example.com:5000/rl/launcher", "0.1.0-cpu")]
    with pytest.raises(BadInput):
        push_image("launcher:0.1.0-cpu", "https://registry", client=FakeClient(api))


def test_cli_bad_tag_exits_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--tag", "Bad Tag"]) == ExitCode.BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and "'Bad Tag'" in captured.err and "HINT:" in captured.err


def test_cli_prints_only_the_tag_on_stdout(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from launcher.image import BuildResult

    def fake_build(options: BuildOptions, progress: Any) -> BuildResult:
        progress("Step 1/1 : FROM x")
        return BuildResult(options.tag, "sha256:1", 1, 0.1)

    monkeypatch.setattr("launcher.cli.build.build_image", fake_build)
    assert main(["build", "--gpu", "--offline"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"launcher:{__version__}-gpu\n" and "Step 1/1" in captured.err


def test_errors_are_one_family() -> None:
    assert issubclass(ImageBuildFailed, LauncherError)


def _sigterm_self_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_signal_kills_the_base_image_script_at_once(tmp_path: Path) -> None:
    """SIGTERM while docker/build-base.sh runs (debootstrap, for minutes): the script's whole process group
    goes at once and the build ends with BuildInterrupted (exit 130)."""
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "docker").mkdir()
    pidfile = tmp_path / "sleeper.pid"
    (tmp_path / "docker" / "build-base.sh").write_text(f"echo started; sleep 120 & echo $! > {pidfile}; wait\n")
    options = BuildOptions(tag="launcher:t", offline=True, context=tmp_path)
    timer = _sigterm_self_after(1.5)
    t0 = time.monotonic()
    with pytest.raises(BuildInterrupted) as info:
        build_image(options, client=FakeClient(FakeAPI()))
    timer.cancel()
    assert info.value.exit_code is ExitCode.INTERRUPTED and int(info.value.exit_code) == 130 and time.monotonic() - t0 < 10
    sleeper = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{sleeper}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{sleeper}").exists(), "the script's child outlived the interrupted build"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the build gives the signal handlers back"


def test_build_path_is_forced_by_flag_file_or_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--build` is declared once (config.OPTIONS): launcher.toml's [up] build, LAUNCHER_BUILD and the flag
    all reach the Docker backend; a bad value is bad input (exit 2) before anything runs."""
    from launcher.backends.docker import DockerBackend
    from launcher.config import load_config

    (tmp_path / "launcher.toml").write_text('[up]\nbuild = "offline"\n')
    cfg, origin = load_config({}, config_path=tmp_path / "launcher.toml", environ={})
    assert cfg.build == "offline" and origin["build"].startswith("file")
    assert DockerBackend.from_config(cfg).build == "offline"
    cfg, origin = load_config({}, config_path=tmp_path / "launcher.toml", environ={"LAUNCHER_BUILD": "online"})
    assert (cfg.build, origin["build"]) == ("online", "env LAUNCHER_BUILD")
    cfg, _ = load_config({"build": "auto"}, config_path=tmp_path / "launcher.toml", environ={})
    assert cfg.build == "auto" and load_config({}, environ={}, cwd=tmp_path / "nowhere")[0].build == "auto"
    with pytest.raises(SystemExit) as bad:
        main(["up", "--build", "sideways", "--results", str(tmp_path)])
    assert bad.value.code == ExitCode.BAD_INPUT and "sideways" in capsys.readouterr().err


@pytest.mark.docker
def test_cli_build_without_a_mode_goes_offline_here_and_says_so(docker_client: Any, launcher_image: str) -> None:
    """`launcher build` with neither --offline nor --online on this host (no registry): one line saying it
    builds offline and why, then the build (every layer from the cache), the tag alone on stdout."""
    from launcher.engine.images import registry_problem

    if registry_problem(ONLINE_BASE_IMAGE) is None:
        pytest.skip("a registry answers here: auto builds online")
    tag = f"launcher-test-auto:{os.urandom(4).hex()}"
    try:
        out = subprocess.run([sys.executable, "-m", "launcher", "build", "--tag", tag], cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout == f"{tag}\n"
        decided = [line for line in out.stderr.splitlines() if line.startswith("building offline: ")]
        assert len(decided) == 1 and "no registry answers" in decided[0], out.stderr[:2000]
    finally:
        try:
            docker_client.api.remove_image(tag)
        except Exception:  # noqa: BLE001 - the build may have failed before tagging
            pass


# --- the real engine, no registry -------------------------------------------------------------------

@pytest.mark.docker
def test_auto_picks_the_path_that_works_here_in_seconds(docker_client: Any) -> None:
    """On a host where no registry answers (this one), `--build auto` goes offline without a failing pull;
    where one answers, online. Either way it decides in seconds."""
    from launcher.engine.images import image_exists, registry_problem

    t0 = time.monotonic()
    problem = registry_problem(ONLINE_BASE_IMAGE)
    path = choose_build_path("auto", BuildOptions(tag="launcher:t", context=ROOT), docker_client)
    assert time.monotonic() - t0 < 30
    if image_exists(ONLINE_BASE_IMAGE, docker_client) or problem is None:
        assert not path.offline
    else:
        assert path.offline and "no registry answers" in path.why, (problem, path)


@pytest.mark.docker
def test_a_signal_stops_an_engine_build_and_leaves_no_layer(docker_client: Any, tmp_path: Path) -> None:
    """SIGTERM during a `docker build` step: BuildInterrupted within seconds, no tag, no new image layer,
    no build container left on the engine."""
    if not any(OFFLINE_BASE_IMAGE in (i.get("RepoTags") or []) for i in docker_client.api.images()):
        pytest.skip(f"{OFFLINE_BASE_IMAGE} is not on this engine")
    token = os.urandom(6).hex()
    (tmp_path / "Dockerfile").write_text(f"FROM {OFFLINE_BASE_IMAGE}\nRUN echo {token} > /token\nRUN sleep 300\n")
    tag = f"launcher-test-interrupt:{token}"
    before = {i["Id"] for i in docker_client.api.images(all=True)}
    containers_before = {c["Id"] for c in docker_client.api.containers(all=True)}
    timer: list[threading.Timer] = []

    def on_build(st: BuildStatus) -> None:
        if st.step == 3 and not timer:
            timer.append(_sigterm_self_after(1.0))

    t0 = time.monotonic()
    with pytest.raises(BuildInterrupted):
        build_image(BuildOptions(tag=tag, context=tmp_path), client=docker_client, on_build=on_build)
    assert timer and time.monotonic() - t0 < 60
    def ours(cmd: Any) -> bool:  # the engine is shared: only this build's steps count
        return token in str(cmd) or "sleep 300" in str(cmd)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the engine cancels the step and removes its container
        new_containers = {c["Id"] for c in docker_client.api.containers(all=True)
                          if c["Id"] not in containers_before and ours(c.get("Command"))}
        new_images = set()
        for image_id in {i["Id"] for i in docker_client.api.images(all=True)} - before:
            attrs = docker_client.api.inspect_image(image_id)
            if ours((attrs.get("ContainerConfig") or {}).get("Cmd")) or ours((attrs.get("Config") or {}).get("Cmd")):
                new_images.add(image_id)
        if not new_containers and not new_images:
            break
        time.sleep(0.5)
    assert not new_containers and not new_images, (new_containers, new_images)
    assert not any(tag in (i.get("RepoTags") or []) for i in docker_client.api.images())


# --- the real image ---------------------------------------------------------------------------------

IMPORT_CHECK = """
import json, os, sys, tempfile
import tensorflow, gymnasium, numpy, worker, launcher
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
plt.plot([1, 2]); plt.savefig(os.path.join(tempfile.mkdtemp(), "p.png"))  # MPLCONFIGDIR is writable
print(json.dumps({"uid": os.getuid(), "python": list(sys.version_info[:2]), "tf": tensorflow.__version__,
                  "home": os.environ["HOME"], "home_writable": os.access(os.environ["HOME"], os.W_OK),
                  "launcher": launcher.__file__, "worker": worker.__file__}))
"""

LEFTOVER_CHECK = r"""
set -u
for p in /wheels /build /src /opt/project /root/.cache/pip /tmp/.cache/pip /etc/pip.conf /etc/xdg/pip; do
  [ -e "$p" ] && echo "LEFTOVER $p"
done
# Wheels other than the system ones Debian/python ship for ensurepip.
find / -xdev -name '*.whl' -not -path '/usr/share/python-wheels/*' -not -path '*/ensurepip/_bundled/*' \
  2>/dev/null | sed 's/^/LEFTOVER /'
# Only Debian's own CA list: nothing added locally, and the bundle holds exactly the enabled entries.
[ -n "$(ls -A /usr/local/share/ca-certificates 2>/dev/null)" ] && echo "LEFTOVER local CA certificates"
enabled=$(grep -cv -e '^#' -e '^!' -e '^$' /etc/ca-certificates.conf)
foreign=$(grep -v -e '^#' -e '^!' -e '^$' -e '^mozilla/' /etc/ca-certificates.conf | wc -l)
bundled=$(grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt)
[ "$enabled" = "$bundled" ] || echo "LEFTOVER CA bundle has $bundled certificates, Debian lists $enabled"
[ "$foreign" = 0 ] || echo "LEFTOVER $foreign non-Debian entries in /etc/ca-certificates.conf"
echo "checked: $bundled CA certificates"
"""


@pytest.mark.docker
def test_image_imports_everything_as_an_arbitrary_uid(launcher_image: str, run_container: Any) -> None:
    status, out = run_container(launcher_image, ["-c", IMPORT_CHECK], entrypoint=["python"], user="54321:54321")
    assert status == 0, out
    info = json.loads(out.strip().splitlines()[-1])
    assert info["uid"] == 54321 and info["python"] == [3, 11] and info["home_writable"], info
    assert info["launcher"].startswith("/opt/venv/") and info["worker"].startswith("/opt/venv/"), info


@pytest.mark.docker
def test_image_runs_as_non_root_by_default(launcher_image: str, run_container: Any) -> None:
    status, out = run_container(launcher_image, ["-u"], entrypoint=["id"])
    assert status == 0 and out.strip() != "0" and int(out.strip()) > 0, out


@pytest.mark.docker
def test_image_has_no_setuid_or_setgid_programs(launcher_image: str, run_container: Any) -> None:
    # Swarm tasks on Docker 20.10 run without no-new-privileges: a setuid binary would be a way to root.
    status, out = run_container(launcher_image, ["-c", "find / -xdev -type f -perm /6000; echo checked"],
                                entrypoint=["sh"], user="0:0")  # root, so find can read every directory
    assert status == 0 and out.strip().splitlines()[-1] == "checked", out
    assert out.strip().splitlines() == ["checked"], f"setuid/setgid files in the image: {out}"


@pytest.mark.docker
def test_image_keeps_nothing_from_the_build_host(launcher_image: str, run_container: Any,
                                                 docker_client: Any) -> None:
    status, out = run_container(launcher_image, ["-c", LEFTOVER_CHECK], entrypoint=["sh"])
    assert status == 0 and "checked:" in out, out
    assert "LEFTOVER" not in out, out
    env = docker_client.api.inspect_image(launcher_image)["Config"]["Env"]
    host_settings = ("PIP_CERT=", "PIP_INDEX_URL=", "PIP_FIND_LINKS=", "PIP_EXTRA_INDEX_URL=", "SSL_CERT_FILE=",
                     "REQUESTS_CA_BUNDLE=", "CURL_CA_BUNDLE=")
    assert not [e for e in env if e.startswith(host_settings)], env
    history = docker_client.api.history(launcher_image)
    assert not [h for h in history if "/wheels/" in (h.get("CreatedBy") or "")], "wheels layer in final image"


@pytest.mark.docker
def test_image_labels_and_entrypoint(launcher_image: str, docker_client: Any) -> None:
    config = docker_client.api.inspect_image(launcher_image)["Config"]
    labels = config["Labels"]
    assert labels["launcher.image"] == "1"
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["launcher.tf-package"] == "tensorflow-cpu"
    assert {"org.opencontainers.image.title", "org.opencontainers.image.revision",
            "org.opencontainers.image.licenses", "org.opencontainers.image.base.name"} <= set(labels)
    assert config["Entrypoint"] == ["python", "-m", "worker"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "2" and env["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert env["PYTHONUNBUFFERED"] == "1" and env["HOME"] == "/tmp"


def test_a_build_of_the_same_source_is_skipped_and_a_change_rebuilds(monkeypatch: pytest.MonkeyPatch,
                                                                   context: Path) -> None:
    """The image carries the digest of what it was built from (launcher.source); building the same source again
    is a no-op (no engine build), a changed file or --no-cache builds again. The wheels are not in the digest
    (docker/requirements.py is), so a copy of the tree whose wheel directory differs builds the same image."""
    from launcher.image_engine_build import SOURCE_LABEL, source_digest

    monkeypatch.setattr("launcher.image_build.prepare_offline", lambda options, report, client: None)
    api = FakeAPI(events=[{"stream": "Step 1/1 : FROM scratch\n"}])
    options = BuildOptions(tag="launcher:t", offline=True, context=context)
    build_image(options, client=FakeClient(api))
    assert len(api.builds) == 1 and api.builds[0]["labels"] == {SOURCE_LABEL: source_digest(options)}
    lines: list[str] = []
    result = build_image(options, lines.append, client=FakeClient(api))
    assert len(api.builds) == 1 and result.seconds == 0.0, "the same source: nothing built"
    assert any("is up to date" in line for line in lines), lines
    (context / "docker" / "wheels" / "cpu").mkdir(parents=True)
    (context / "docker" / "wheels" / "cpu" / "x-1-py3-none-any.whl").write_bytes(b"other wheels")
    build_image(options, client=FakeClient(api))
    assert len(api.builds) == 1, "the wheel directory is not the source"
    (context / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    build_image(options, client=FakeClient(api))
    assert len(api.builds) == 2, "a changed file builds again"
    build_image(BuildOptions(tag="launcher:t", offline=True, context=context, no_cache=True), client=FakeClient(api))
    assert len(api.builds) == 3, "--no-cache always builds"
    lines.clear()
    build_image(BuildOptions(tag="launcher:other", offline=True, context=context), lines.append, client=FakeClient(api))
    assert len(api.builds) == 3 and "launcher:other" in api.present, "another tag of the same source: tagged"
    assert any("tagged" in line for line in lines), lines
