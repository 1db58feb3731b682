"""Building the worker image (online or with no registry at all), pushing it, and the image a run uses.

Build events reach the caller as they happen (:mod:`launcher.image_progress`): a cold build takes minutes and
must not look hung. The offline preparation stays two shell scripts run by ``subprocess``
(``docker/build-base.sh``: debootstrap needs root and is a command-line tool with no library;
``docker/fetch-wheels.sh``), each in its own process group, so that SIGINT/SIGTERM stop a build at once and
leave nothing behind (:mod:`launcher.image_cancel`). Both the worker image and the ``--with`` image
(:mod:`launcher.image_extras`) end in the same ``docker build`` step (:mod:`launcher.image_engine_build`).

This module is the one the CLI and the backends import: it also gives the names of those modules that
callers use (:class:`BuildStatus`, :class:`BuildInterrupted`, :class:`ImageBuildFailed`, :func:`build_context`,
:func:`build_extras_image`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from launcher.engine.client import connect_client
from launcher.engine.images import find_image, image_exists, inspect_image, labelled_image, push_events, tag_image
from launcher.errors import BadInput, LauncherError, MissingDependency
from launcher.image import (OFFLINE_BASE_IMAGE, REGISTRY_RE, BuildOptions, BuildResult, Flavour, choose_build_path,
                            find_context, parse_extras, split_ref)
from launcher.image_cancel import BuildInterrupted, run_script, stoppable
from launcher.image_engine_build import SOURCE_LABEL, ImageBuildFailed, build_context, docker_build, source_digest
from launcher.image_extras import build_extras_image
from launcher.image_progress import BuildReporter, BuildStatus, Progress, as_reporter

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient

__all__ = ["BuildInterrupted", "BuildStatus", "ImageBuildFailed", "Progress", "build_context", "build_extras_image",
           "build_image", "ensure_image", "ensure_run_image", "prepare_offline", "push_image"]


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
    digest = source_digest(options)
    if not options.no_cache:
        built = _built_from(digest, options.tag, client, progress)
        if built is not None:
            return built
    report = BuildReporter(options.tag, progress, on_build)
    with stoppable(report, client) as layers:
        if options.offline:
            prepare_offline(options, report, client)
        report.enter("docker build")
        report.say(f"building {options.tag} from {options.base} ({options.flavour.tf_package}, "
                   f"{'offline, no network' if options.offline else 'online'})")
        with build_context(options) as context:
            docker_build(client, context, options, report, layers, buildargs=options.buildargs(),
                         network_none=options.offline, no_cache=options.no_cache, labels={SOURCE_LABEL: digest})
    info = inspect_image(options.tag, client)
    result = BuildResult(options.tag, info["Id"], int(info.get("Size", 0)), time.monotonic() - report.t0)
    progress(f"built {result.tag} ({result.image_id[7:19]}, {result.size_bytes / 1e9:.2f} GB) "
             f"in {result.seconds:.0f} s")
    return result


def _built_from(digest: str, tag: str, client: "DockerClient", progress: Progress) -> BuildResult | None:
    """``tag`` as an image already built from the source ``digest`` names: the tag itself when it carries the
    digest, else another image that does, tagged ``tag`` (a copy of it loaded without its layer cache, say);
    None when there is none and the build has to run."""
    current = find_image(tag, client)
    how = "built from this source"
    if current is None or ((current.get("Config") or {}).get("Labels") or {}).get(SOURCE_LABEL) != digest:
        current = labelled_image(SOURCE_LABEL, digest, client)
        if current is None:
            return None
        tag_image(current["Id"], *split_ref(tag), client)
        how = f"tagged {current['Id'][7:19]}, {how}"
    progress(f"{tag} is up to date: {how} ({SOURCE_LABEL}={digest}); nothing to build (--no-cache rebuilds it)")
    return BuildResult(tag, current["Id"], int(current.get("Size", 0)), 0.0)


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
    repository, version = split_ref(tag)
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


def prepare_offline(options: BuildOptions, report: BuildReporter | Progress = lambda line: None,
                    client: "DockerClient | None" = None) -> None:
    """Make the base image (debootstrap, needs root or sudo) and the wheel directory for ``options``.

    Both scripts return at once when their output is already there. A base image other than
    ``launcher-base:bookworm`` must already be on the engine: an offline build cannot pull it.

    Raises:
        MissingDependency: a script failed (no debootstrap, no root, no mirror, no index), or a custom
            base image is missing.
    """
    rep = as_reporter(report, options.tag)
    scripts = Path(options.context) / "docker"
    env = {**os.environ, "BASE_IMAGE": options.base, "FLAVOUR": options.flavour.value,
           "TF_PACKAGE": options.flavour.tf_package, "WHEELS": str(Path(options.context) / options.wheels_dir)}
    if options.base == OFFLINE_BASE_IMAGE:
        rep.enter("base rootfs")
        run_script(["bash", str(scripts / "build-base.sh")], env, rep,
                   hint="run `sudo bash docker/build-base.sh` once (debootstrap needs root), "
                   "or build online with a registry (--online)")
    elif not image_exists(options.base, client):
        raise MissingDependency(
            f"base image {options.base} is not on this Docker engine, and an offline build cannot pull it",
            hint=f"`docker load` it first, or leave out --base-image to use {OFFLINE_BASE_IMAGE}")
    # This interpreter's pip downloads the wheels (the host's index settings apply to it).
    env.setdefault("PYTHON", sys.executable)
    rep.enter("wheels")
    run_script(["bash", str(scripts / "fetch-wheels.sh")], env, rep,
               hint="the host needs a package index it can reach (pip download); "
               "or copy a docker/wheels/ directory from a machine that has one")


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
    extras = parse_extras(with_packages)  # bad values fail before a base build of minutes
    client = client or connect_client()
    image = ensure_image(base, mode=mode, progress=progress, flavour=flavour, client=client, context=context,
                         on_build=on_build)
    if not extras:
        return image
    return build_extras_image(image, extras, client=client, progress=progress, on_build=on_build,
                              context=context).tag
