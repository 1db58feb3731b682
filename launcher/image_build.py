"""Building the worker image (online or with no registry at all), pushing it, and stopping a build promptly.

Build events reach the caller as they happen: a cold build takes minutes and must not look hung. Lines go to
``progress``; with ``on_build`` the build's own output goes there instead, as :class:`BuildStatus` records
(phase, ``docker build`` step, elapsed time), which ``launcher up``'s live view and plain lines show.

The offline preparation stays two shell scripts run by ``subprocess`` (``docker/build-base.sh``: debootstrap
needs root and is a command-line tool with no library; ``docker/fetch-wheels.sh``), each in its own process
group. SIGINT/SIGTERM during a build raise :class:`BuildInterrupted` at once (exit 130): the script's process
group is killed, the engine's build is cancelled by dropping its connection, and the steps it had finished
(untagged images) are removed, so nothing is left behind.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

from launcher.engine.client import connect_client
from launcher.engine.images import (build_events, context_files, image_exists, inspect_image, push_events,
                                    remove_untagged)
from launcher.errors import BadInput, ExitCode, LauncherError, MissingDependency
from launcher.image import (OFFLINE_BASE_IMAGE, REGISTRY_RE, BuildOptions, BuildResult, Flavour, choose_build_path,
                            find_context)

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient
    from launcher.image import Extra

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
"""Receives one human-readable line (no trailing newline) per build event."""
_STEP = re.compile(r"^Step (\d+)/(\d+) :")
_LAYER = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
KILL_GRACE_S = 5.0
TICK_S = 1.0  # how often a silent build's elapsed time is reported again


class ImageBuildFailed(LauncherError):
    """``docker build`` ran and failed; the message carries the engine's error and the last lines."""

    exit_code = ExitCode.INTERNAL


class BuildInterrupted(LauncherError):
    """SIGINT or SIGTERM arrived during an image build; the build was stopped and cleaned up."""

    exit_code = ExitCode.INTERRUPTED


@dataclass(frozen=True)
class BuildStatus:
    """Where an image build is: ``phase`` (``base rootfs``, ``wheels``, ``docker build``), the Dockerfile
    step (``step`` of ``steps``) in the last phase, seconds since the build began, and its latest line."""

    tag: str
    phase: str
    elapsed_s: float
    line: str = ""
    step: int | None = None
    steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Reporter:
    """Turns the build's output into ``progress`` lines or, with ``on_build``, :class:`BuildStatus` records.

    With ``on_build``, a ticker thread also repeats the latest record every ``TICK_S`` with the time grown:
    debootstrap and a long ``RUN pip install`` print nothing for minutes, and the view must not look hung.
    A lock keeps the ticker's records and the build's own in order.
    """

    def __init__(self, tag: str, progress: Progress, on_build: Callable[[BuildStatus], None] | None) -> None:
        self.tag, self.progress, self.on_build = tag, progress, on_build
        self.t0 = time.monotonic()
        self.phase, self.step, self.steps, self.line = "", None, None, ""  # type: str, int | None, int | None, str
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def enter(self, phase: str) -> None:
        self.phase, self.step, self.steps = phase, None, None
        self.output(f"{phase}: started")

    def say(self, line: str) -> None:
        """A line that is not the build's output (what is being built, from what) to ``progress``."""
        with self._lock:
            self.progress(line)

    def output(self, line: str) -> None:
        with self._lock:
            if (m := _STEP.match(line)) is not None:
                self.step, self.steps = int(m.group(1)), int(m.group(2))
            self.line = line
            if self.on_build is None:
                self.progress(line)
            else:
                self.on_build(BuildStatus(self.tag, self.phase, time.monotonic() - self.t0, line, self.step,
                                          self.steps))

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Within: the latest record again every ``TICK_S`` seconds (only with ``on_build``)."""
        if self.on_build is None:
            yield
            return
        on_build = self.on_build

        def tick() -> None:
            while not self._stop.wait(TICK_S):
                with self._lock:
                    if self.phase:
                        on_build(BuildStatus(self.tag, self.phase, time.monotonic() - self.t0, self.line, self.step,
                                             self.steps))

        ticker = threading.Thread(target=tick, name="build-ticker", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            self._stop.set()
            ticker.join(timeout=2 * TICK_S)


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`BuildInterrupted` in the main thread, even while it waits on
    the engine or a script (Python retries a waiting system call only when the handler returns)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise BuildInterrupted(f"image build interrupted by {signal.Signals(signum).name}; it was stopped and "
                               "its half-built layers removed")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def build_image(options: BuildOptions, progress: Progress = lambda line: None, client: "DockerClient | None" = None,
                *, on_build: Callable[[BuildStatus], None] | None = None) -> BuildResult:
    """Build the worker image (like ``docker build -t TAG .``), streaming its output as it comes.

    Offline, first makes the base image and the wheel directory (both skipped when already there), then
    builds with no network, so the build proves it needs none.

    Raises:
        MissingDependency: no Docker engine answers; the base image cannot be pulled (online);
            debootstrap or the wheel download is unavailable (offline).
        ImageBuildFailed: the Dockerfile failed; the message has the engine's error.
        BuildInterrupted: SIGINT/SIGTERM; nothing of the build is left.
    """
    client = client or connect_client()
    report = _Reporter(options.tag, progress, on_build)
    layers: list[str] = []
    with interruptible(), report.ticking():
        try:
            if options.offline:
                prepare_offline(options, report, client)
            report.enter("docker build")
            report.say(f"building {options.tag} from {options.base} ({options.flavour.tf_package}, "
                       f"{'offline, no network' if options.offline else 'online'})")
            with build_context(options) as context:
                try:
                    events = build_events(client, context, tag=options.tag, buildargs=options.buildargs(),
                                          network_none=options.offline, no_cache=options.no_cache)
                    _follow(events, options, report, layers)
                except (BuildInterrupted, ImageBuildFailed, MissingDependency):
                    raise
                except LauncherError as exc:  # the engine refused the build itself
                    raise _build_error(options, exc.message, []) from exc
        except BuildInterrupted:
            gone = remove_untagged(layers, client)
            log.info("build of %s interrupted; removed %d half-built layer(s)", options.tag, gone)
            raise
    info = inspect_image(options.tag, client)
    result = BuildResult(options.tag, info["Id"], int(info.get("Size", 0)), time.monotonic() - report.t0)
    progress(f"built {result.tag} ({result.image_id[7:19]}, {result.size_bytes / 1e9:.2f} GB) "
             f"in {result.seconds:.0f} s")
    return result


def ensure_image(name: str, *, mode: str = "auto", progress: Progress = lambda line: None,
                 flavour: Flavour = Flavour.CPU, client: "DockerClient | None" = None, context: Path | None = None,
                 on_build: Callable[[BuildStatus], None] | None = None) -> str:
    """Return ``name`` once the engine has it, building it first when it is missing (and saying how, in one
    line: the path :func:`launcher.image.choose_build_path` picked for ``mode``).

    Raises:
        MissingDependency, ImageBuildFailed, BuildInterrupted: as :func:`build_image` and the path choice.
    """
    client = client or connect_client()
    if image_exists(name, client):
        return name
    options = BuildOptions(tag=name, flavour=flavour, context=context or find_context())
    path = choose_build_path(mode, options, client)
    progress(f"image {name} not found; building it {'offline' if path.offline else 'online'} (takes minutes): "
             f"{path.why}")
    options = BuildOptions(tag=name, flavour=flavour, offline=path.offline, context=options.context)
    return build_image(options, progress, client, on_build=on_build).tag


def push_image(tag: str, registry: str, progress: Progress = lambda line: None,
               client: "DockerClient | None" = None) -> str:
    """Tag ``tag`` as ``REGISTRY/tag`` and push it (like ``docker tag`` + ``docker push``).

    Returns:
        The pushed reference, e.g. ``registry.example.com:5000/rl/launcher:0.1.0-cpu``.

    Raises:
        BadInput: ``registry`` is not a registry address.
        LauncherError: the engine refused the push (credentials, unreachable registry).
    """
    registry = registry.rstrip("/")
    if not REGISTRY_RE.match(registry):
        raise BadInput(f"--push {registry!r} is not a registry address",
                       hint="give HOST[:PORT][/PATH], e.g. registry.example.com:5000/rl")
    client = client or connect_client()
    repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
    target = f"{registry}/{repository.split('/')[-1]}"
    hint = f"check `docker login {registry.split('/')[0]}` and that the registry is reachable from this host"
    try:
        for event in push_events(client, tag, target, version):
            if "error" in event:
                raise LauncherError(f"push of {target}:{version} failed: {event['error']}", hint=hint)
            line = " ".join(str(event[k]) for k in ("id", "status", "progress") if event.get(k))
            if line and "progress" not in event:
                progress(line)
    except LauncherError as exc:
        raise LauncherError(exc.message if exc.message.startswith("push of") else
                            f"push of {target}:{version} failed: {exc.message}", hint=hint) from exc
    progress(f"pushed {target}:{version}")
    return f"{target}:{version}"


def prepare_offline(options: BuildOptions, report: _Reporter | Progress = lambda line: None,
                    client: "DockerClient | None" = None) -> None:
    """Make the base image (debootstrap, needs root or sudo) and the wheel directory for ``options``.

    Both scripts return at once when their output is already there. A base image other than
    ``launcher-base:bookworm`` must already be on the engine: an offline build cannot pull it.

    Raises:
        MissingDependency: a script failed (no debootstrap, no root, no mirror, no index), or a custom
            base image is missing.
    """
    rep = report if isinstance(report, _Reporter) else _Reporter(options.tag, report, None)
    scripts = Path(options.context) / "docker"
    env = {**os.environ, "BASE_IMAGE": options.base, "FLAVOUR": options.flavour.value,
           "TF_PACKAGE": options.flavour.tf_package, "WHEELS": str(Path(options.context) / options.wheels_dir)}
    if options.base == OFFLINE_BASE_IMAGE:
        rep.enter("base rootfs")
        _run_script(["bash", str(scripts / "build-base.sh")], env, rep,
                    hint="run `sudo bash docker/build-base.sh` once (debootstrap needs root), "
                    "or build online with a registry (--online)")
    elif not image_exists(options.base, client):
        raise MissingDependency(
            f"base image {options.base} is not on this Docker engine, and an offline build cannot pull it",
            hint=f"`docker load` it first, or leave out --base-image to use {OFFLINE_BASE_IMAGE}")
    # This interpreter's pip downloads the wheels (the host's index settings apply to it).
    env.setdefault("PYTHON", sys.executable)
    rep.enter("wheels")
    _run_script(["bash", str(scripts / "fetch-wheels.sh")], env, rep,
                hint="the host needs a package index it can reach (pip download); "
                "or copy a docker/wheels/ directory from a machine that has one")


@contextmanager
def build_context(options: BuildOptions) -> Iterator[IO[bytes]]:
    """The build context as an uncompressed tar file (what ``docker build`` uploads).

    It holds what .dockerignore's allow-list lets through, minus the wheel directories of the other
    flavour: a CPU build must not upload gigabytes of CUDA wheels.
    """
    root = Path(options.context)
    patterns = _dockerignore(root)
    patterns += [f"docker/wheels/{f.value}" for f in Flavour if f is not options.flavour]
    with tempfile.TemporaryFile() as fileobj:
        with tarfile.open(fileobj=fileobj, mode="w") as tar:
            for rel in context_files(root, patterns):
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


def _follow(stream: Iterable[dict[str, Any]], options: BuildOptions, report: _Reporter, layers: list[str]) -> None:
    """Pass the engine's build events on; note each image a step made (``layers``: not those taken from the
    cache, which other images may be); raise on an error."""
    tail: list[str] = []
    cached = False
    for event in stream:
        if "error" in event:
            raise _build_error(options, str(event["error"]).strip(), tail)
        text = event.get("stream") or event.get("status")
        if not text:
            continue
        for line in str(text).splitlines():
            line = line.rstrip()
            if line:
                if (m := _LAYER.match(line)) is not None and not cached:
                    layers.append(m.group(1))
                cached = line.strip() == "---> Using cache"
                tail = (tail + [line])[-20:]
                report.output(line)


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


def _run_script(argv: list[str], env: dict[str, str], report: _Reporter, *, hint: str) -> None:
    """Run a preparation script in its own process group, its output as build lines; on any exception
    (a signal's :class:`BuildInterrupted` included) the whole group is stopped before it propagates."""
    name = Path(argv[-1]).name
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
    except OSError as exc:
        raise MissingDependency(f"cannot run {name}: {exc}", hint=hint) from exc
    tail: list[str] = []
    assert proc.stdout is not None
    try:
        for line in _lines(proc.stdout):
            tail = (tail + [line])[-10:]
            report.output(line)
        code = proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    if code != 0:
        raise MissingDependency(f"{name} failed with exit status {code}: " + (tail[-1] if tail else "no output"),
                                hint=hint)


def _stop_group(proc: "subprocess.Popen[str]") -> None:
    """SIGTERM the script's process group (sudo passes it on to debootstrap), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _lines(stream: io.TextIOBase | IO[str]) -> Iterator[str]:
    for line in stream:
        line = line.rstrip()
        if line:
            yield line


# ----------------------------------------------------------------------------- extras: a derived image
EXTRAS_CACHE = "docker/wheels/extras"  # under the context: wheels pip downloaded for --with, kept between builds
_SAVED = re.compile(r"^\s*(?:Saved|File was already downloaded)\s+(\S+\.whl)\s*$")


def download_extras(extras: tuple["Extra", ...], dest: Path, report: "_Reporter | Progress", *,
                    find_links: tuple[Path, ...] = ()) -> list[Path]:
    """Download wheels for ``extras`` and what they depend on into ``dest`` on this host, for the image's
    platform (CPython 3.11, manylinux x86_64), like ``docker/fetch-wheels.sh`` (``pip download
    --only-binary=:all:``). Files already in ``dest`` are not downloaded again; ``find_links`` (the base
    image's wheel directory) lets pip take dependencies from there with no index.

    Returns the wheel files the extras need (their dependencies included).

    Raises:
        MissingDependency: pip could not get them (no index, no wheel for the platform), with pip's last lines.
    """
    rep = report if isinstance(report, _Reporter) else _Reporter("extras", report, None)
    dest.mkdir(parents=True, exist_ok=True)
    platforms = ["--platform", "manylinux2014_x86_64"]
    for minor in range(5, 37):
        platforms += ["--platform", f"manylinux_2_{minor}_x86_64"]
    argv = [sys.executable, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:", "--implementation",
            "cp", "--python-version", "3.11", "--abi", "cp311", "--abi", "abi3", "--abi", "none", *platforms,
            "--progress-bar", "off", "--retries", "1", "--timeout", "15"]
    for d in find_links:
        if d.is_dir():
            argv += ["--find-links", str(d)]
    argv += [str(e.wheel) if e.wheel is not None else e.spec for e in extras]
    # A host's own wheel directories hold wheels for the host, not the image (as in fetch-wheels.sh).
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_NO_INDEX")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    rep.say(f"downloading wheels for {' '.join(e.spec for e in extras)} (cp311, manylinux x86_64) into {dest}")
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        raise MissingDependency(f"cannot run pip download for --with: {exc}") from exc
    lines = [line.rstrip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    for line in lines:
        rep.output(line)
    if proc.returncode != 0:
        tail = "\n".join(f"    {line}" for line in lines[-8:])
        raise MissingDependency(
            f"pip could not download wheels for --with {' '.join(e.spec for e in extras)} (CPython 3.11, manylinux "
            f"x86_64, wheels only):\n{tail}",
            hint="check the name and version (`pip index versions NAME`); a package with no wheel for Linux "
                 "x86_64 must be built into a wheel first (`pip wheel --no-deps -w dist .`) and given as --with "
                 "dist/<file>.whl; with no index here, put every wheel it needs in docker/wheels/extras/")
    files = [Path(m.group(1)) for line in lines if (m := _SAVED.match(line))]
    return sorted({f.resolve() for f in files})  # pip prints them relative to its working directory (ours)


def build_extras_image(base: str, extras: tuple["Extra", ...], *, client: "DockerClient | None" = None,
                       progress: Progress = lambda line: None, on_build: Callable[[BuildStatus], None] | None = None,
                       context: Path | None = None, no_cache: bool = False) -> BuildResult:
    """Build (or find) the image ``base`` plus ``extras``: ``FROM base``, the extras installed from wheels
    downloaded on this host, no network in the build (``docker/Dockerfile.extras``). Tagged
    :func:`launcher.image.extras_tag` (the base's tag with ``-with-<hash>``), labelled ``launcher.extras``.
    An image with that tag on the engine is taken as it is (seconds).

    Raises:
        MissingDependency: the base is not on the engine, or the wheels cannot be downloaded.
        ImageBuildFailed: pip inside the build failed (the message has its output).
        BuildInterrupted: SIGINT/SIGTERM; the build's layers are removed.
    """
    import json

    from launcher.image import (EXTRAS_BASE_LABEL, EXTRAS_DOCKERFILE, EXTRAS_LABEL, EXTRAS_PACKAGES_LABEL, extras_hash,
                                extras_tag)

    client = client or connect_client()
    root = context or find_context()
    if not image_exists(base, client):
        raise MissingDependency(f"base image {base} is not on this Docker engine; --with builds on top of it",
                                hint="`launcher build` makes it first (--offline without a registry)")
    base_id = str(inspect_image(base, client)["Id"])
    digest = extras_hash(base_id, extras)
    tag = extras_tag(base, digest)
    t0 = time.monotonic()
    if image_exists(tag, client) and not no_cache:
        progress(f"image {tag} (with {' '.join(e.spec for e in extras)}) is on the engine already")
        info = inspect_image(tag, client)
        return BuildResult(tag, str(info["Id"]), int(info.get("Size", 0)), 0.0)
    report = _Reporter(tag, progress, on_build)
    layers: list[str] = []
    with interruptible(), report.ticking():
        try:
            report.enter("wheels")
            files = download_extras(extras, root / EXTRAS_CACHE, report,
                                    find_links=(root / "docker" / "wheels" / "cpu",))
            requirements = [f"/wheels/{e.wheel.name}" if e.wheel is not None else e.spec for e in extras]
            report.enter("docker build")
            report.say(f"building {tag} FROM {base} with {' '.join(e.spec for e in extras)} (no network)")
            with tempfile.TemporaryFile() as fileobj:
                with tarfile.open(fileobj=fileobj, mode="w") as tar:
                    tar.add(root / EXTRAS_DOCKERFILE, arcname="Dockerfile", filter=_normalize)
                    for f in files:
                        tar.add(f, arcname=f"wheels/{f.name}", filter=_normalize)
                    data = ("\n".join(requirements) + "\n").encode()
                    member = tarfile.TarInfo("requirements.txt")
                    member.size = len(data)
                    tar.addfile(_normalize(member), io.BytesIO(data))
                fileobj.seek(0)
                options = BuildOptions(tag=tag, base_image=base, context=root)
                labels = {EXTRAS_LABEL: digest, EXTRAS_PACKAGES_LABEL: json.dumps([e.key for e in extras]),
                          EXTRAS_BASE_LABEL: base}
                try:
                    _follow(build_events(client, fileobj, tag=tag, buildargs={"BASE_IMAGE": base}, network_none=True,
                                         no_cache=no_cache, labels=labels), options, report, layers)
                except (BuildInterrupted, ImageBuildFailed, MissingDependency):
                    raise
                except LauncherError as exc:
                    raise _build_error(options, exc.message, []) from exc
        except BuildInterrupted:
            remove_untagged(layers, client)
            raise
    # The extras stage (wheels inside) is no use once the tagged image exists: that tag is the cache.
    remove_untagged(layers, client)
    info = inspect_image(tag, client)
    result = BuildResult(tag, str(info["Id"]), int(info.get("Size", 0)), time.monotonic() - t0)
    progress(f"built {tag} ({result.image_id[7:19]}, FROM {base} with {' '.join(e.spec for e in extras)}) "
             f"in {result.seconds:.0f} s")
    return result


def ensure_run_image(base: str, with_packages: tuple[str, ...] = (), *, mode: str = "auto",
                     flavour: Flavour = Flavour.CPU, client: "DockerClient | None" = None,
                     progress: Progress = lambda line: None, on_build: Callable[[BuildStatus], None] | None = None,
                     context: Path | None = None) -> str:
    """The image a run uses: ``base`` (built when missing, :func:`ensure_image`), and with ``with_packages``
    the image derived from it with them (:func:`build_extras_image`, reused while it is on the engine).

    Raises:
        BadInput: a ``--with`` value that is neither a requirement nor an existing wheel file.
        MissingDependency, ImageBuildFailed, BuildInterrupted: as the builds.
    """
    from launcher.image import parse_extras

    extras = parse_extras(with_packages)  # bad values fail before a base build of minutes
    client = client or connect_client()
    image = ensure_image(base, mode=mode, progress=progress, flavour=flavour, client=client, context=context,
                         on_build=on_build)
    if not extras:
        return image
    return build_extras_image(image, extras, client=client, progress=progress, on_build=on_build,
                              context=context).tag
