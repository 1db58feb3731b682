"""Images on the engine: does one exist, build one from a context (streamed), push, remove, and can the
engine pull from a registry at all.

The build goes through the low-level API (``client.api.build(..., decode=True)``) so every build event reaches
the caller as it happens; the recipe (which base, which build arguments, the offline preparation) is
:mod:`launcher.image`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.engine.client import connect_client, remove_container
from launcher.engine.errors import engine_call
from launcher.errors import LauncherError

if TYPE_CHECKING:
    from docker.client import DockerClient

log = logging.getLogger(__name__)

BUILD_READ_TIMEOUT_S = 1800  # longest silence tolerated from the engine during a build step
REGISTRY_PROBE_S = 5.0  # how long `up` waits for a registry before building offline


def image_exists(name: str, client: "DockerClient | None" = None) -> bool:
    """Whether the engine has an image called ``name`` (like ``docker image inspect NAME``).

    Raises:
        MissingDependency: no Docker engine answers.
    """
    return find_image(name, client or connect_client()) is not None


def find_image(name: str, client: "DockerClient") -> dict[str, Any] | None:
    """``docker image inspect NAME`` as a dict; None when the engine has no such image."""
    found = engine_call(f"inspect image {name}", lambda: client.api.inspect_image(name), gone=None)
    return None if found is None else dict(found)


def inspect_image(name: str, client: "DockerClient") -> dict[str, Any]:
    """``docker image inspect NAME`` as a dict."""
    return dict(engine_call(f"inspect image {name}", lambda: client.api.inspect_image(name)))


def remove_untagged(ids: list[str], client: "DockerClient", *, timeout_s: float = 15.0) -> int:
    """Remove untagged images by id, newest first (like ``docker rmi``); returns how many went. A cancelled
    build leaves its finished steps as untagged images: this takes them away. A tagged image, or one another
    image builds on, stays; one the engine still uses (the cancelled step's container is being removed) is
    tried again for up to ``timeout_s`` seconds."""
    pending, removed = list(reversed(ids)), 0
    deadline = time.monotonic() + timeout_s
    while pending:
        left = []
        for image_id in pending:
            attrs = engine_call(f"inspect image {image_id[:19]}", lambda: client.api.inspect_image(image_id),
                                gone=None)
            if attrs is None or attrs.get("RepoTags"):
                continue
            try:
                engine_call(f"remove image {image_id[:19]}", lambda: client.api.remove_image(image_id), gone=None)
                removed += 1
            except LauncherError as exc:
                log.debug("%s", exc)
                if "dependent child images" not in exc.message:
                    left.append(image_id)
        if not left or time.monotonic() > deadline:
            return removed
        pending = left
        time.sleep(0.5)
    return removed


def registry_problem(image: str, timeout_s: float = REGISTRY_PROBE_S) -> str | None:
    """None when the engine can reach the registry of ``image`` (a manifest lookup, like ``docker manifest
    inspect``, no download), else why not, within ``timeout_s`` seconds."""
    try:
        client = connect_client(timeout_s)
    except LauncherError as exc:
        return exc.message
    try:
        engine_call(f"look up {image} in its registry", lambda: client.api.inspect_distribution(image))
    except LauncherError as exc:
        return exc.message.splitlines()[0]
    finally:
        client.close()
    return None


def context_files(root: Path, patterns: list[str]) -> list[str]:
    """The files of ``root`` a build context holds under .dockerignore-style ``patterns``, relative, sorted
    (what ``docker build`` would upload)."""
    from docker.utils.build import exclude_paths

    return sorted(exclude_paths(str(root), patterns, dockerfile="Dockerfile"))


def build_events(client: "DockerClient", context: IO[bytes], *, tag: str, buildargs: Mapping[str, str],
                 network_none: bool, no_cache: bool, labels: Mapping[str, str] | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Build an image from a tar ``context`` (like ``docker build -t TAG -``), yielding the engine's events
    (``{"stream": ...}``, ``{"status": ...}``, ``{"error": ...}``) as they come. ``labels`` are set on the image
    (like ``docker build --label``) without a Dockerfile step.

    Closing the iterator (or an exception raised while it waits, e.g. on a signal) drops the connection, and
    the engine then cancels the build. Raises LauncherError when the engine refuses to start it.
    """
    stream = engine_call(f"build {tag}", lambda: client.api.build(
        fileobj=context, custom_context=True, tag=tag, buildargs=dict(buildargs),
        network_mode="none" if network_none else None, nocache=no_cache, rm=True, forcerm=True, decode=True,
        timeout=BUILD_READ_TIMEOUT_S, labels=dict(labels) if labels else None))
    it = iter(stream)
    while (event := engine_call(f"build {tag}", lambda: next(it, None))) is not None:
        yield event


def commit_layer(client: "DockerClient", base: str, archive: IO[bytes], *, command: list[str], tag: str,
                 labels: Mapping[str, str], comment: str, timeout_s: float,
                 name: str | None = None) -> tuple[int, str, str | None]:
    """One layer on top of ``base``, from a throw-away container: ``archive`` (a tar) unpacked at ``/tmp``,
    ``command`` run there as root with no network and no capabilities, and what it changed committed as ``tag``
    with ``base``'s own configuration (user, entrypoint, command, environment) plus ``labels`` (like ``docker
    create`` + ``docker cp`` + ``docker start -a`` + ``docker commit``).

    One commit where a ``docker build`` of the same takes one per step: on an engine whose storage driver
    compares whole trees to commit (fuse-overlayfs, vfs) each costs ~15 s for the 1.5 GB worker image.

    The container carries ``labels`` too: the engine merges a container's labels into the image it commits, so
    giving it the image's own keeps the image's labels exact, and a container a killed launcher left behind is
    found by them. It is removed whatever happens, a signal's exception included.

    Returns (exit status, its output, the new image's id; None when the command failed or ran past
    ``timeout_s``, and then nothing is committed). ``name`` names the container (a killed caller's is found by it).
    """
    config = dict(engine_call(f"inspect image {base}", lambda: client.api.inspect_image(base))["Config"] or {})
    config["Labels"] = {**(config.get("Labels") or {}), **labels}
    container = engine_call(f"create a build container of {base}", lambda: client.containers.create(
        base, entrypoint=command[:1], command=command[1:], user="0", network_disabled=True, name=name,
        labels=dict(labels), cap_drop=["ALL"], security_opt=["no-new-privileges"]))
    try:
        engine_call(f"copy the build's files into {container.short_id}", lambda: container.put_archive("/tmp", archive))
        engine_call(f"start build container {container.short_id}", container.start)
        try:
            status = int(container.wait(timeout=timeout_s).get("StatusCode", -1))
        except Exception:  # noqa: BLE001 - a read timeout: it ran too long
            engine_call(f"kill build container {container.short_id}", container.kill, gone=None)
            status = 137
        output = bytes(engine_call("read its output", lambda: container.logs(stdout=True, stderr=True),
                                   gone=b"")).decode(errors="replace")
        if status != 0:
            return status, output, None
        repository, _, version = tag.rpartition(":")
        image = engine_call(f"commit {tag}", lambda: container.commit(repository=repository, tag=version,
                                                                     message=comment, conf=config))
        return status, output, str(image.id)
    finally:
        remove_container(str(container.id), client)


def labelled_containers(label: str, client: "DockerClient") -> list[tuple[str, str]]:
    """(id, name) of every container, running or not, carrying ``label`` (like ``docker ps -a --filter label=L``)."""
    found = engine_call(f"list containers labelled {label}",
                        lambda: client.api.containers(all=True, filters={"label": label}))
    return [(str(c["Id"]), str((c.get("Names") or ["/"])[0]).lstrip("/")) for c in found]


def labelled_image(label: str, value: str, client: "DockerClient") -> dict[str, Any] | None:
    """One image carrying ``label=value`` (like ``docker images --filter label=L=V``): its ``Id`` and ``Size``;
    None when there is none."""
    found = engine_call(f"list images labelled {label}", lambda: client.api.images(filters={"label": f"{label}={value}"}))
    return dict(found[0]) if found else None


def tag_image(image_id: str, repository: str, version: str, client: "DockerClient") -> None:
    """``docker tag IMAGE REPOSITORY:VERSION``."""
    engine_call(f"tag {image_id[:19]} as {repository}:{version}", lambda: client.api.tag(image_id, repository, version))


def push_events(client: "DockerClient", source: str, target: str, version: str) -> Iterator[dict[str, Any]]:
    """Tag ``source`` as ``target:version`` and push it (like ``docker tag`` + ``docker push``), yielding the
    engine's events."""
    engine_call(f"tag {source} as {target}:{version}", lambda: client.api.tag(source, target, version))
    stream = engine_call(f"push {target}:{version}", lambda: client.api.push(target, tag=version, stream=True,
                                                                           decode=True))
    it = iter(stream)
    while (event := engine_call(f"push {target}:{version}", lambda: next(it, None))) is not None:
        yield event
