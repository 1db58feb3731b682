"""``--with`` extras: the worker image plus a few packages, as a small derived image.

The extras' wheels are downloaded on this host, then pip installs them into the base image's venv in a throw-away
container with no network, and that container is committed as the derived image (one layer, the base's own
configuration, the labels below): one commit, not a ``docker build`` of several steps, each of which costs a
commit. Tagged :func:`launcher.image.extras_tag` (the base's tag with ``-with-<hash>``); an image with that tag on
the engine is taken as it is. The recipe (values, hash, tag) is in :mod:`launcher.image`.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from launcher.engine.client import connect_client, remove_container
from launcher.engine.images import commit_layer, find_image, inspect_image, labelled_containers, remove_untagged
from launcher.errors import MissingDependency
from launcher.procs import proc_info
from launcher.image import (EXTRAS_BASE_LABEL, EXTRAS_LABEL, EXTRAS_PACKAGES_LABEL, BuildResult, extras_hash,
                            extras_tag, find_context)
from launcher.image_cancel import stoppable
from launcher.image_engine_build import ImageBuildFailed, normalize
from launcher.image_progress import BuildReporter, BuildStatus, Progress, as_reporter

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient
    from launcher.image import Extra

EXTRAS_CACHE = "docker/wheels/extras"  # under the context: wheels pip downloaded for --with, kept between builds
STAGE = "launcher-extras"  # the wheels and requirements.txt, under /tmp in the build container (gone before the commit)
# Into the base's venv itself: what it has already is "already satisfied"; what an extra needs newer replaces the
# old version cleanly. The staged wheels are removed in the same container, so the layer never holds them.
INSTALL = ["sh", "-c", f"/opt/venv/bin/pip install --no-index --find-links /tmp/{STAGE}/wheels --no-warn-script-location "
           f"-r /tmp/{STAGE}/requirements.txt; status=$?; rm -rf /tmp/{STAGE}; exit $status"]
INSTALL_TIMEOUT_S = 1800
_SAVED = re.compile(r"^\s*(?:Saved|File was already downloaded)\s+(\S+\.whl)\s*$")
# The build container's name says which launcher made it, on which host (the engine may be shared or remote):
# launcher-extras-<hash>-<host>-<pid>-<start ticks>. Its labels cannot: the engine copies a container's labels
# into the image committed from it.
_BUILD_NAME = re.compile(r"^launcher-extras-[0-9a-f]{12}-(?P<host>[a-zA-Z0-9_.-]+)-(?P<pid>\d+)-(?P<start>\d+)$")


def this_host() -> str:
    """This host's name as it goes into a build container's name (characters a name cannot hold as -)."""
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", socket.gethostname()) or "host"


def build_container_name(digest: str) -> str:
    """The name of this process's build container for the derived image ``digest``."""
    info = proc_info(os.getpid())
    return f"launcher-extras-{digest}-{this_host()}-{os.getpid()}-{info.start_ticks if info else 0}"


def abandoned_build(name: str) -> bool:
    """Whether ``name`` is a build container whose launcher, on this host, is gone (SIGKILL, a crash, a power
    cut): its own ``finally`` removes it otherwise. Another host's, or one whose launcher runs, is not."""
    m = _BUILD_NAME.match(name)
    if m is None or m["host"] != this_host():
        return False
    info = proc_info(int(m["pid"]))
    return info is None or info.start_ticks != int(m["start"])


def remove_abandoned_builds(client: "DockerClient", progress: Progress) -> list[str]:
    """Remove the build containers that launchers killed on this host left on the engine; their names."""
    gone = []
    for container_id, name in labelled_containers(EXTRAS_LABEL, client):
        if abandoned_build(name):
            remove_container(container_id, client)
            progress(f"removed build container {name}: the launcher that made it is gone")
            gone.append(name)
    return gone


def download_extras(extras: tuple["Extra", ...], dest: Path, report: BuildReporter | Progress, *,
                    find_links: tuple[Path, ...] = ()) -> list[Path]:
    """Download wheels for ``extras`` and what they depend on into ``dest`` on this host, for the image's
    platform (CPython 3.11, manylinux x86_64), like ``docker/fetch-wheels.sh`` (``pip download
    --only-binary=:all:``). Files already in ``dest`` are not downloaded again; ``find_links`` (the base
    image's wheel directory) lets pip take dependencies from there with no index.

    Returns the wheel files the extras need (their dependencies included).

    Raises:
        MissingDependency: pip could not get them (no index, no wheel for the platform), with pip's last lines.
    """
    rep = as_reporter(report, "extras")
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
    """Build (or find) the image ``base`` plus ``extras``: the extras installed from wheels downloaded on this
    host into ``base``'s venv, in a container with no network, committed as one layer. Tagged
    :func:`launcher.image.extras_tag` (the base's tag with ``-with-<hash>``), labelled ``launcher.extras``.
    An image with that tag on the engine is taken as it is (seconds).

    Raises:
        MissingDependency: the base is not on the engine, or the wheels cannot be downloaded.
        ImageBuildFailed: pip inside the container failed (the message has its output).
        BuildInterrupted: SIGINT/SIGTERM; the build container is removed and nothing is tagged.
    """
    client = client or connect_client()
    root = context or find_context()
    found = find_image(base, client)
    if found is None:
        raise MissingDependency(f"base image {base} is not on this Docker engine; --with builds on top of it",
                                hint="`launcher build` makes it first (--offline without a registry)")
    base_id = str(found["Id"])
    digest = extras_hash(base_id, extras)
    tag = extras_tag(base, digest)
    t0 = time.monotonic()
    old = find_image(tag, client)
    if old is not None and not no_cache:
        progress(f"image {tag} (with {' '.join(e.spec for e in extras)}) is on the engine already")
        return BuildResult(tag, str(old["Id"]), int(old.get("Size", 0)), 0.0)
    report = BuildReporter(tag, progress, on_build)
    remove_abandoned_builds(client, progress)
    with stoppable(report, client):
        report.enter("wheels")
        files = download_extras(extras, root / EXTRAS_CACHE, report, find_links=(root / "docker" / "wheels" / "cpu",))
        requirements = [f"/tmp/{STAGE}/wheels/{e.wheel.name}" if e.wheel is not None else e.spec for e in extras]
        report.enter("install")
        report.say(f"installing {' '.join(e.spec for e in extras)} into {base} (no network), committed as {tag}")
        with tempfile.TemporaryFile() as fileobj:
            with tarfile.open(fileobj=fileobj, mode="w") as tar:
                for f in files:
                    tar.add(f, arcname=f"{STAGE}/wheels/{f.name}", filter=normalize)
                data = ("\n".join(requirements) + "\n").encode()
                member = tarfile.TarInfo(f"{STAGE}/requirements.txt")
                member.size = len(data)
                tar.addfile(normalize(member), io.BytesIO(data))
            fileobj.seek(0)
            labels = {EXTRAS_LABEL: digest, EXTRAS_PACKAGES_LABEL: json.dumps([e.key for e in extras]),
                      EXTRAS_BASE_LABEL: base}
            status, output, image_id = commit_layer(
                client, base, fileobj, command=INSTALL, tag=tag, labels=labels,
                comment=f"launcher build --with {' '.join(e.key for e in extras)}", timeout_s=INSTALL_TIMEOUT_S,
                name=build_container_name(digest))
        lines = [line.rstrip() for line in output.splitlines() if line.strip()]
        for line in lines:
            report.output(line)
        if image_id is None:
            detail = "\n".join(f"    {line}" for line in lines[-10:])
            raise ImageBuildFailed(
                f"installing {' '.join(e.spec for e in extras)} into {base} failed: pip exited with status {status}"
                + (f"\n  last output:\n{detail}" if detail else ""),
                hint="pip's output is above (`launcher build --with ...` prints it): check that the package "
                     "installs on CPython 3.11 beside what the base image has")
    # Rebuilt over an existing tag (--no-cache): the image it named is no use any more.
    if old is not None and str(old["Id"]) != image_id:
        remove_untagged([str(old["Id"])], client)
    info = inspect_image(tag, client)
    result = BuildResult(tag, str(info["Id"]), int(info.get("Size", 0)), time.monotonic() - t0)
    progress(f"built {tag} ({result.image_id[7:19]}, FROM {base} with {' '.join(e.spec for e in extras)}) "
             f"in {result.seconds:.0f} s")
    return result
