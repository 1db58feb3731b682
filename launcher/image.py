"""The worker image's recipe: its tag, its two build paths, and which path can work on this host.

Two ways to build (docs/image.md has the details and measured times):

* online: ``FROM python:3.11-slim-bookworm`` and packages from the index, for hosts with a registry;
* offline: ``docker/build-base.sh`` makes ``launcher-base:bookworm`` with debootstrap (or mmdebstrap) and
  ``docker/fetch-wheels.sh`` downloads the wheels on the host; the build then runs with no network.

:func:`choose_build_path` picks one for ``--build auto`` in a few seconds, without a long failing attempt:
online when the base image is here or its registry answers, else offline when this host can debootstrap and
has (or can download) the wheels, else one :class:`~launcher.errors.MissingDependency` naming what is missing.
:mod:`launcher.image_build` runs the build.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from launcher import __version__
from launcher.errors import BadInput, MissingDependency

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient

REPOSITORY = "launcher"
ONLINE_BASE_IMAGE = "python:3.11-slim-bookworm"
OFFLINE_BASE_IMAGE = "launcher-base:bookworm"
IMAGE_LABEL = "launcher.image"
VERSION_LABEL = "org.opencontainers.image.version"
BUILD_MODES = ("auto", "online", "offline")
PROBE_TIMEOUT_S = 5.0

# A Docker reference: [registry[:port]/]path[:tag][@digest]; lower-case path components.
_REFERENCE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"
)
REGISTRY_RE = re.compile(r"^[a-zA-Z0-9.-]+(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*$")


class Flavour(str, enum.Enum):
    """Which TensorFlow the image carries."""

    CPU = "cpu"
    GPU = "gpu"

    @property
    def tf_package(self) -> str:
        """The pip package (its version range comes from pyproject.toml's cpu/gpu extras)."""
        return "tensorflow-cpu" if self is Flavour.CPU else "tensorflow[and-cuda]"


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


def flavour_for(gpu: bool) -> Flavour:
    """The flavour a plan needs: GPU TensorFlow when any process of it is on a GPU."""
    return Flavour.GPU if gpu else Flavour.CPU


def _git_revision(root: Path) -> str:
    """The commit the context is at (``unknown`` outside git); marks the image, never fails a build."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


# ---------------------------------------------------------------------------------- which path can work
@dataclass(frozen=True)
class BuildPath:
    """The build path chosen for this host and why (one progress line)."""

    offline: bool
    why: str


def wheels_ready(options: BuildOptions) -> bool:
    """Whether fetch-wheels.sh finished for this flavour before (its stamp file is there)."""
    d = Path(options.context) / options.wheels_dir
    return d.is_dir() and any(d.glob(".complete-*"))


def index_problem(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the package index pip would use answers (any HTTP status), else why not."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, timeout=timeout_s)
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            url = ""
    url = (url or "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as exc:
        return f"the package index {url} does not answer ({exc})"
    return None


def _can_be_root() -> bool:
    if os.geteuid() == 0:
        return True
    if shutil.which("sudo") is None:
        return False
    try:
        return subprocess.run(["sudo", "-n", "true"], capture_output=True, timeout=PROBE_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def offline_problems(options: BuildOptions, client: "DockerClient") -> list[str]:
    """What stops an offline build here (empty: nothing): a base image that cannot be made (no debootstrap
    or mmdebstrap, no root), and wheels that are neither here nor downloadable."""
    from launcher.engine.images import image_exists

    problems = []
    if not image_exists(OFFLINE_BASE_IMAGE, client):
        if not (shutil.which("debootstrap") or shutil.which("mmdebstrap")):
            problems.append(f"{OFFLINE_BASE_IMAGE} is not on the engine and neither debootstrap nor mmdebstrap is "
                            "installed to make it")
        elif not _can_be_root():
            problems.append(f"{OFFLINE_BASE_IMAGE} is not on the engine and debootstrap needs root: this user is "
                            "not root and sudo asks for a password")
    if not wheels_ready(options):
        problem = index_problem()
        if problem:
            problems.append(f"no wheels in {options.wheels_dir} and {problem}")
    return problems


def choose_build_path(mode: str, options: BuildOptions, client: "DockerClient", *,
                      registry_problem: Callable[[str], str | None] | None = None) -> BuildPath:
    """The build path for ``--build mode`` (``auto``, ``online``, ``offline``) on this host, in seconds.

    Args:
        options: the build (its flavour and context name the wheels).
        client: the engine that builds.
        registry_problem: asks whether the engine can reach the online base's registry (tests force "no").

    Raises:
        BadInput: an unknown mode.
        MissingDependency: ``auto`` and neither path can work; the message names what each one lacks.
    """
    from launcher.engine.images import image_exists
    from launcher.engine.images import registry_problem as probe

    if mode not in BUILD_MODES:
        raise BadInput(f"--build {mode!r} is not one of {', '.join(BUILD_MODES)}")
    if mode != "auto":
        return BuildPath(mode == "offline", f"--build {mode}")
    if image_exists(ONLINE_BASE_IMAGE, client):
        return BuildPath(False, f"{ONLINE_BASE_IMAGE} is on this engine: building online")
    online = (registry_problem or probe)(ONLINE_BASE_IMAGE)
    if online is None:
        return BuildPath(False, f"the registry of {ONLINE_BASE_IMAGE} answers: building online")
    offline = offline_problems(options, client)
    if not offline:
        return BuildPath(True, f"no registry answers for {ONLINE_BASE_IMAGE}, so building offline: "
                               f"{OFFLINE_BASE_IMAGE} by debootstrap + wheels downloaded on this host")
    raise MissingDependency(
        f"cannot build the image on this host: online, {online}; offline, {'; '.join(offline)}",
        hint="offline needs debootstrap or mmdebstrap (`sudo apt-get install mmdebstrap`), root or passwordless "
             "sudo once, and a package index or a copied docker/wheels/ directory; online needs a registry "
             "(`docker pull python:3.11-slim-bookworm` must work); or pass --image with an existing image")


# ----------------------------------------------------------------------------- extras: a derived image
EXTRAS_LABEL = "launcher.extras"  # hash of the base image and the extras: what the derived tag is named after
EXTRAS_PACKAGES_LABEL = "launcher.extras.packages"  # JSON list of what --with added
EXTRAS_BASE_LABEL = "launcher.extras.base"  # the base image's reference


@dataclass(frozen=True)
class Extra:
    """One ``--with`` entry: a pip requirement (``flappy-bird-gymnasium==0.4.0``) or a local wheel file.

    Attributes:
        spec: as the user gave it.
        wheel: the wheel file, resolved, when ``spec`` names one; None for a requirement.
        sha256: the wheel's content hash (a rebuilt wheel makes a new image); "" for a requirement.
    """

    spec: str
    wheel: Path | None = None
    sha256: str = ""

    @property
    def key(self) -> str:
        """What identifies it in the derived image's hash and label."""
        return f"{self.wheel.name}@sha256:{self.sha256}" if self.wheel is not None else self.spec


def parse_extras(specs: tuple[str, ...] | list[str]) -> tuple[Extra, ...]:
    """``--with`` values as :class:`Extra` entries: a value ending in ``.whl`` is a local wheel (hashed here),
    anything else a pip requirement.

    Raises:
        BadInput: a wheel file that is not there, or a requirement that cannot be one (empty, or an option).
    """
    import hashlib

    out, problems = [], []
    for spec in specs:
        spec = spec.strip()
        if spec.endswith(".whl"):
            path = Path(spec).expanduser().resolve()
            if not path.is_file():
                problems.append(f"--with {spec}: no such wheel file")
                continue
            out.append(Extra(spec, path, hashlib.sha256(path.read_bytes()).hexdigest()))
        elif not spec or spec.startswith("-") or "\n" in spec:
            problems.append(f"--with {spec!r}: not a pip requirement (e.g. ale-py, 'gymnasium[other]', "
                            f"flappy-bird-gymnasium==0.4.0) or a .whl file")
        else:
            out.append(Extra(spec))
    if problems:
        raise BadInput("; ".join(problems), hint="--with takes a pip requirement or the path of a wheel file")
    return tuple(out)


def extras_hash(base_image_id: str, extras: tuple[Extra, ...]) -> str:
    """12 hex digits naming a derived image: the base image's id and the extras, in the order given."""
    import hashlib
    import json

    doc = json.dumps({"base": base_image_id, "with": [e.key for e in extras]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


def split_ref(ref: str) -> tuple[str, str]:
    """``[registry[:port]/]path[:tag]`` -> (everything before the tag, the tag; ``latest`` when there is none)."""
    name, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "latest")
    return name, tag


def extras_tag(base: str, digest: str) -> str:
    """The derived image's reference: the base's with ``-with-<hash>`` added to its tag
    (``launcher:0.1.0-cpu`` -> ``launcher:0.1.0-cpu-with-3fa2c1d9e0b4``), so it is never taken for the base."""
    name, tag = split_ref(base)
    return f"{name}:{tag[:100]}-with-{digest}"
