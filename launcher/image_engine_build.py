"""One ``docker build`` on the engine, the step both builds end in: the worker image
(:mod:`launcher.image_build`) and the image derived from it with ``--with`` extras (:mod:`launcher.image_extras`).

The context goes up as an uncompressed tar; the engine's events become build lines; each image a step made is
noted (so an interrupted build can remove it); an error becomes :class:`ImageBuildFailed`, or
:class:`~launcher.errors.MissingDependency` when it is the base image that cannot be pulled.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.engine.images import build_events, context_files
from launcher.errors import ExitCode, LauncherError, MissingDependency
from launcher.image import BuildOptions, Flavour
from launcher.image_cancel import BuildInterrupted
from launcher.image_progress import BuildReporter

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient

_LAYER = re.compile(r"^ ---> ([0-9a-f]{12,64})$")


class ImageBuildFailed(LauncherError):
    """``docker build`` ran and failed; the message carries the engine's error and the last lines."""

    exit_code = ExitCode.INTERNAL


def docker_build(client: "DockerClient", context: IO[bytes], options: BuildOptions, report: BuildReporter,
                 layers: list[str], *, buildargs: Mapping[str, str], network_none: bool, no_cache: bool,
                 labels: Mapping[str, str] | None = None) -> None:
    """Build ``context`` (a tar file) as ``options.tag`` on the engine (like ``docker build -t TAG -``), its
    output to ``report`` and each image a step made appended to ``layers``.

    Raises:
        ImageBuildFailed: a step failed, or the engine refused the build; the message has the engine's error.
        MissingDependency: the base image is not there and cannot be pulled.
        BuildInterrupted: SIGINT/SIGTERM within :func:`launcher.image_cancel.interruptible`.
    """
    try:
        events = build_events(client, context, tag=options.tag, buildargs=buildargs, network_none=network_none,
                              no_cache=no_cache, labels=labels)
        _follow(events, options, report, layers)
    except (BuildInterrupted, ImageBuildFailed, MissingDependency):
        raise
    except LauncherError as exc:  # the engine refused the build itself
        raise _build_error(options, exc.message, []) from exc


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
                tar.add(root / rel, arcname=rel, recursive=False, filter=normalize)
        fileobj.seek(0)
        yield fileobj


SOURCE_LABEL = "launcher.source"  # the digest of what an image was built from (:func:`source_digest`)


def source_digest(options: BuildOptions) -> str:
    """What the worker image is built from, as one digest: each context file but the wheels (path, whether it is
    executable, its content), the build arguments but the revision, and the flavour. The wheels are what
    ``docker/requirements.py`` (in the digest) asks for; the revision only names the commit (a copy without
    ``.git`` builds the same image). ``launcher build`` skips a build whose tag already carries this digest."""
    import hashlib

    root = Path(options.context)
    patterns = _dockerignore(root) + ["docker/wheels"]
    h = hashlib.sha256()
    for rel in context_files(root, patterns):
        path = root / rel
        if not path.is_file():
            continue
        h.update(f"{rel}\0{int(bool(path.stat().st_mode & 0o111))}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    args = {k: v for k, v in options.buildargs().items() if k != "REVISION"}
    h.update(repr(sorted(args.items())).encode() + options.flavour.value.encode())
    return h.hexdigest()[:24]


def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A tar member with no owner: who checked the files out must not change the layer cache key (the legacy
    builder hashes headers)."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _dockerignore(root: Path) -> list[str]:
    path = root / ".dockerignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _follow(stream: Iterable[dict[str, Any]], options: BuildOptions, report: BuildReporter,
            layers: list[str]) -> None:
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
