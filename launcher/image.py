"""The worker image: build it (online or with no registry at all), check it exists, push it.

One place talks to the Docker engine for images. Builds go through the low-level API
(``client.api.build(..., decode=True)``) so every build line reaches the caller's ``progress``
callback as it happens: a cold build takes minutes and must not look hung.

Two ways to build (docs/image.md has the details and measured times):

* online: ``FROM python:3.11-slim-bookworm`` and packages from the index, for hosts with a registry;
* offline: ``docker/build-base.sh`` makes ``launcher-base:bookworm`` with debootstrap and
  ``docker/fetch-wheels.sh`` downloads the wheels on the host; the build then runs with
  ``network_mode="none"``. Those two steps stay shell scripts run by ``subprocess``: debootstrap needs
  root and is a command-line tool with no library, and CI and air-gapped users run the scripts alone.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Callable, Iterable, Iterator

from launcher import __version__
from launcher.errors import BadInput, ExitCode, LauncherError, MissingDependency

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
"""Receives one human-readable line (no trailing newline) per build event."""

REPOSITORY = "launcher"
ONLINE_BASE_IMAGE = "python:3.11-slim-bookworm"
OFFLINE_BASE_IMAGE = "launcher-base:bookworm"
IMAGE_LABEL = "launcher.image"
VERSION_LABEL = "org.opencontainers.image.version"
BUILD_READ_TIMEOUT_S = 1800  # longest silence tolerated from the engine during a build step

# A Docker reference: [registry[:port]/]path[:tag][@digest]; lower-case path components.
_REFERENCE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"
)
_REGISTRY = re.compile(r"^[a-zA-Z0-9.-]+(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*$")


class Flavour(str, enum.Enum):
    """Which TensorFlow the image carries."""

    CPU = "cpu"
    GPU = "gpu"

    @property
    def tf_package(self) -> str:
        """The pip package (its version range comes from pyproject.toml's cpu/gpu extras)."""
        return "tensorflow-cpu" if self is Flavour.CPU else "tensorflow[and-cuda]"


class ImageBuildFailed(LauncherError):
    """``docker build`` ran and failed; the message carries the engine's error and the last lines."""

    exit_code = ExitCode.INTERNAL


def valid_reference(name: str) -> bool:
    """Whether ``name`` is a well-formed image reference (``[registry/]path[:tag]``, lower-case path)."""
    return bool(_REFERENCE.match(name))


def default_tag(flavour: Flavour = Flavour.CPU) -> str:
    """The tag ``launcher build`` and ``launcher up`` use unless told otherwise: ``launcher:0.1.0-cpu``."""
    return f"{REPOSITORY}:{__version__}-{flavour.value}"


def find_context() -> Path:
    """The directory holding the Dockerfile: the source tree this package was imported from.

    Raises:
        BadInput: the package is installed without its source tree (e.g. inside the image itself).
    """
    root = Path(__file__).resolve().parents[1]
    if (root / "Dockerfile").is_file() and (root / "pyproject.toml").is_file():
        return root
    raise BadInput(
        f"no Dockerfile next to the installed package (looked in {root})",
        hint="run from a clone of the launcher repository, or pass --context DIR",
    )


@dataclass(frozen=True)
class BuildOptions:
    """Everything one image build needs, checked once.

    Attributes:
        tag: the image reference to create, e.g. ``launcher:0.1.0-cpu``.
        flavour: CPU or GPU TensorFlow.
        offline: build with no registry and no package index (see the module docstring).
        base_image: the ``FROM`` image; None picks ``launcher-base:bookworm`` offline and
            ``python:3.11-slim-bookworm`` online.
        context: the directory with the Dockerfile (the repository root).
        no_cache: rebuild every layer (``docker build --no-cache``).
    """

    tag: str
    flavour: Flavour = Flavour.CPU
    offline: bool = False
    base_image: str | None = None
    context: Path = dataclasses.field(default_factory=find_context)
    no_cache: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not _REFERENCE.match(self.tag):
            problems.append(f"tag {self.tag!r} is not a valid image reference (e.g. launcher:0.1.0-cpu)")
        if self.base_image is not None and not _REFERENCE.match(self.base_image):
            problems.append(f"base image {self.base_image!r} is not a valid image reference")
        if not (Path(self.context) / "Dockerfile").is_file():
            problems.append(f"no Dockerfile in the build context {self.context}")
        if problems:
            raise BadInput("; ".join(problems), hint="see `launcher build --help`")

    @property
    def base(self) -> str:
        """The ``FROM`` image this build uses."""
        if self.base_image:
            return self.base_image
        return OFFLINE_BASE_IMAGE if self.offline else ONLINE_BASE_IMAGE

    @property
    def wheels_dir(self) -> str:
        """The wheel directory, relative to the context, that the Dockerfile's WHEELS_DIR names."""
        return f"docker/wheels/{self.flavour.value}"

    def buildargs(self) -> dict[str, str]:
        """The Dockerfile's build arguments for this build."""
        return {
            "BASE_IMAGE": self.base,
            "TF_PACKAGE": self.flavour.tf_package,
            "OFFLINE": "1" if self.offline else "0",
            "WHEELS_DIR": self.wheels_dir,
            "VERSION": __version__,
            "REVISION": _git_revision(Path(self.context)),
        }


@dataclass(frozen=True)
class BuildResult:
    """What a build produced: the tag, the image id, its size and how long it took."""

    tag: str
    image_id: str
    size_bytes: int
    seconds: float


def connect(timeout_s: int = 60) -> "DockerClient":
    """A Docker client that has answered a ping (like ``docker version``).

    Raises:
        MissingDependency: no Docker engine answers; the message names the DOCKER_HOST value seen.
    """
    import docker  # imported here: `launcher --help` must not pay for it
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
    except DockerException as exc:
        host = os.environ.get("DOCKER_HOST", "unset, so unix:///var/run/docker.sock")
        raise MissingDependency(
            f"no Docker engine answers (DOCKER_HOST={host}): {exc}",
            hint="start the engine (`sudo systemctl start docker` or dockerd), or point DOCKER_HOST at one; "
            "your user needs access to its socket (the docker group)",
        ) from exc
    return client


def image_exists(name: str, client: "DockerClient | None" = None) -> bool:
    """Whether the engine has an image called ``name`` (like ``docker image inspect NAME``).

    Raises:
        MissingDependency: no Docker engine answers.
    """
    from docker.errors import ImageNotFound

    client = client or connect()
    try:
        client.api.inspect_image(name)
    except ImageNotFound:
        return False
    return True


def build_image(
    options: BuildOptions,
    progress: Progress = lambda line: None,
    client: "DockerClient | None" = None,
) -> BuildResult:
    """Build the worker image (like ``docker build -t TAG .``), streaming each line to ``progress``.

    Offline, first makes the base image and the wheel directory (both skipped when already there),
    then builds with no network, so the build proves it needs none.

    Raises:
        MissingDependency: no Docker engine answers; the base image cannot be pulled (online);
            debootstrap or the wheel download is unavailable (offline).
        ImageBuildFailed: the Dockerfile failed; the message has the engine's error.
    """
    from docker.errors import APIError

    client = client or connect()
    start = time.monotonic()
    if options.offline:
        prepare_offline(options, progress, client)
    progress(f"building {options.tag} from {options.base} ({options.flavour.tf_package}, "
             f"{'offline, no network' if options.offline else 'online'})")
    with build_context(options) as context:
        try:
            stream = client.api.build(
                fileobj=context,
                custom_context=True,
                tag=options.tag,
                buildargs=options.buildargs(),
                network_mode="none" if options.offline else None,
                nocache=options.no_cache,
                rm=True,
                forcerm=True,
                decode=True,
                timeout=BUILD_READ_TIMEOUT_S,
            )
            _follow(stream, options, progress)
        except APIError as exc:
            raise _build_error(options, str(exc.explanation or exc), []) from exc
    info = client.api.inspect_image(options.tag)
    result = BuildResult(options.tag, info["Id"], int(info.get("Size", 0)), time.monotonic() - start)
    progress(f"built {result.tag} ({result.image_id[7:19]}, {result.size_bytes / 1e9:.2f} GB) "
             f"in {result.seconds:.0f} s")
    return result


def ensure_image(
    name: str,
    *,
    offline: bool,
    progress: Progress = lambda line: None,
    flavour: Flavour = Flavour.CPU,
    client: "DockerClient | None" = None,
    context: Path | None = None,
) -> str:
    """Return ``name`` once the engine has it, building it first when it is missing (and saying so).

    Args:
        name: the image reference, e.g. :func:`default_tag`.
        offline: build with no registry and no index (see :class:`BuildOptions`).
        progress: receives the build's lines.
        flavour: CPU or GPU TensorFlow, for a build.
        context: the directory with the Dockerfile (default: this source tree).

    Raises:
        MissingDependency, ImageBuildFailed: as :func:`build_image`.
    """
    client = client or connect()
    if image_exists(name, client):
        return name
    progress(f"image {name} not found; building it {'offline' if offline else 'online'} (takes minutes)")
    options = BuildOptions(tag=name, flavour=flavour, offline=offline, context=context or find_context())
    return build_image(options, progress, client).tag


def push_image(
    tag: str,
    registry: str,
    progress: Progress = lambda line: None,
    client: "DockerClient | None" = None,
) -> str:
    """Tag ``tag`` as ``REGISTRY/tag`` and push it (like ``docker tag`` + ``docker push``).

    Args:
        tag: a local image, e.g. ``launcher:0.1.0-cpu``.
        registry: registry host with optional port and path, e.g. ``registry.example.com:5000/rl``.

    Returns:
        The pushed reference, e.g. ``registry.example.com:5000/rl/launcher:0.1.0-cpu``.

    Raises:
        BadInput: ``registry`` is not a registry address.
        LauncherError: the engine refused the push (credentials, unreachable registry).
    """
    from docker.errors import APIError

    registry = registry.rstrip("/")
    if not _REGISTRY.match(registry):
        raise BadInput(f"--push {registry!r} is not a registry address",
                       hint="give HOST[:PORT][/PATH], e.g. registry.example.com:5000/rl")
    client = client or connect()
    repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
    target = f"{registry}/{repository.split('/')[-1]}"
    try:
        client.api.tag(tag, target, version)
        for event in client.api.push(target, tag=version, stream=True, decode=True):
            if "error" in event:
                raise LauncherError(f"push of {target}:{version} failed: {event['error']}",
                                    hint=f"check `docker login {registry.split('/')[0]}` and that the "
                                    "registry is reachable from this host")
            line = " ".join(str(event[k]) for k in ("id", "status", "progress") if event.get(k))
            if line and "progress" not in event:
                progress(line)
    except APIError as exc:
        raise LauncherError(f"push of {target}:{version} failed: {exc.explanation or exc}",
                            hint=f"check `docker login {registry.split('/')[0]}`") from exc
    progress(f"pushed {target}:{version}")
    return f"{target}:{version}"


def prepare_offline(
    options: BuildOptions,
    progress: Progress = lambda line: None,
    client: "DockerClient | None" = None,
) -> None:
    """Make the base image (debootstrap, needs root or sudo) and the wheel directory for ``options``.

    Both scripts return at once when their output is already there. A base image other than
    ``launcher-base:bookworm`` must already be on the engine: an offline build cannot pull it.

    Raises:
        MissingDependency: a script failed (no debootstrap, no root, no mirror, no index), or a custom
            base image is missing.
    """
    scripts = Path(options.context) / "docker"
    env = {
        **os.environ,
        "BASE_IMAGE": options.base,
        "FLAVOUR": options.flavour.value,
        "TF_PACKAGE": options.flavour.tf_package,
        "WHEELS": str(Path(options.context) / options.wheels_dir),
    }
    if options.base == OFFLINE_BASE_IMAGE:
        _run_script(["bash", str(scripts / "build-base.sh")], env, progress,
                    hint="run `sudo bash docker/build-base.sh` once (debootstrap needs root), "
                    "or build online with a registry (--online)")
    elif not image_exists(options.base, client):
        raise MissingDependency(
            f"base image {options.base} is not on this Docker engine, and an offline build cannot pull it",
            hint=f"`docker load` it first, or leave out --base-image to use {OFFLINE_BASE_IMAGE}",
        )
    # This interpreter's pip downloads the wheels (the host's index settings apply to it).
    env.setdefault("PYTHON", sys.executable)
    _run_script(["bash", str(scripts / "fetch-wheels.sh")], env, progress,
                hint="the host needs a package index it can reach (pip download); "
                "or copy a docker/wheels/ directory from a machine that has one")


@contextmanager
def build_context(options: BuildOptions) -> Iterator[IO[bytes]]:
    """The build context as an uncompressed tar file (what ``docker build`` uploads).

    It holds what .dockerignore's allow-list lets through, minus the wheel directories of the other
    flavour: a CPU build must not upload gigabytes of CUDA wheels.
    """
    from docker.utils.build import exclude_paths

    root = Path(options.context)
    patterns = _dockerignore(root)
    patterns += [f"docker/wheels/{f.value}" for f in Flavour if f is not options.flavour]
    with tempfile.TemporaryFile() as fileobj:
        with tarfile.open(fileobj=fileobj, mode="w") as tar:
            for rel in sorted(exclude_paths(str(root), patterns, dockerfile="Dockerfile")):
                tar.add(root / rel, arcname=rel, recursive=False, filter=_normalize)
        fileobj.seek(0)
        yield fileobj


def _normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Who checked the files out must not change the layer cache key (the legacy builder hashes headers).
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _dockerignore(root: Path) -> list[str]:
    path = root / ".dockerignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _follow(stream: Iterable[dict], options: BuildOptions, progress: Progress) -> None:
    """Pass the engine's build events on as lines; raise on its error event."""
    tail: list[str] = []
    for event in stream:
        if "error" in event:
            raise _build_error(options, str(event["error"]).strip(), tail)
        text = event.get("stream") or event.get("status")
        if not text:
            continue
        for line in str(text).splitlines():
            line = line.rstrip()
            if line:
                tail = (tail + [line])[-20:]
                progress(line)


def _build_error(options: BuildOptions, error: str, tail: list[str]) -> LauncherError:
    pull_failure = any(s in error for s in ("pull access denied", "manifest unknown", "no such host",
                                            "dial tcp", "TLS handshake", "connection refused"))
    if pull_failure or (f"{options.base}" in error and "not found" in error):
        return MissingDependency(
            f"base image {options.base} is not available and cannot be pulled: {error}",
            hint="build with no registry: `launcher build --offline` (debootstraps launcher-base:bookworm)",
        )
    detail = "\n".join(f"    {line}" for line in tail[-10:])
    return ImageBuildFailed(
        f"building {options.tag} failed: {error}" + (f"\n  last build output:\n{detail}" if detail else ""),
        hint="rerun with -v for the full log; `launcher build --no-cache` rules out a stale layer",
    )


def _run_script(argv: list[str], env: dict[str, str], progress: Progress, *, hint: str) -> None:
    name = Path(argv[-1]).name
    progress(f"running {name}")
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
    except OSError as exc:
        raise MissingDependency(f"cannot run {name}: {exc}", hint=hint) from exc
    tail: list[str] = []
    assert proc.stdout is not None
    for line in _lines(proc.stdout):
        tail = (tail + [line])[-10:]
        progress(line)
    if proc.wait() != 0:
        raise MissingDependency(f"{name} failed with exit status {proc.returncode}: "
                                + (tail[-1] if tail else "no output"), hint=hint)


def _lines(stream: io.TextIOBase | IO[str]) -> Iterator[str]:
    for line in stream:
        line = line.rstrip()
        if line:
            yield line


def _git_revision(root: Path) -> str:
    """The commit the context is at (``unknown`` outside git); marks the image, never fails a build."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
