"""The worker image: unit tests of launcher.image (the Docker API faked at its lowest layer) and, marked
``docker``, tests of the real image built once per session through the offline path."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Iterable

import pytest

from launcher import __version__
from launcher.cli.main import main
from launcher.errors import BadInput, ExitCode, LauncherError, MissingDependency
from launcher.image import (
    BuildOptions,
    Flavour,
    ImageBuildFailed,
    build_context,
    build_image,
    connect,
    default_tag,
    ensure_image,
    push_image,
)

ROOT = Path(__file__).resolve().parents[1]


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
        self.images = set(images)
        self.builds: list[dict[str, Any]] = []
        self.pushed: list[tuple[str, str]] = []

    def build(self, **kwargs: Any) -> Iterable[dict[str, Any]]:
        self.builds.append({k: v for k, v in kwargs.items() if k != "fileobj"})
        if not any("error" in e for e in self.events):
            self.images.add(kwargs["tag"])
        return iter(self.events)

    def inspect_image(self, name: str) -> dict[str, Any]:
        from docker.errors import ImageNotFound

        if name not in self.images:
            raise ImageNotFound(f"no such image: {name}")
        return {"Id": "sha256:" + "ab" * 32, "Size": 1_500_000_000}

    def tag(self, image: str, repository: str, tag: str) -> bool:
        self.images.add(f"{repository}:{tag}")
        return True

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
    monkeypatch.setattr("launcher.image.prepare_offline", lambda options, progress, client: None)
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
    monkeypatch.setattr("launcher.image.prepare_offline", lambda options, progress, client: None)
    api = FakeAPI(images={"launcher:present"})
    lines: list[str] = []
    assert ensure_image("launcher:present", offline=True, progress=lines.append, client=FakeClient(api)) \
        == "launcher:present"
    assert not api.builds and not lines
    assert ensure_image("launcher:missing", offline=True, progress=lines.append, client=FakeClient(api),
                        context=context) == "launcher:missing"
    assert len(api.builds) == 1 and "not found; building it offline" in lines[0]


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
