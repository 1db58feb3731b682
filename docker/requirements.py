"""Print the image's pip requirements, one per line, read from pyproject.toml.

pyproject.toml stays the one place that lists dependencies: the host-side wheel download
(docker/fetch-wheels.sh) and the Dockerfile's dependency layer both call this script, so they cannot
drift apart. Standard library only (tomllib, Python 3.11): it runs inside a bare base image.

Usage:
    python3 docker/requirements.py [--pyproject FILE] [--tf SPEC] [--build-system]

``--tf`` names the TensorFlow package (``tensorflow-cpu``, ``tensorflow[and-cuda]``). A bare name is
given the version range of the optional-dependency entry in pyproject.toml with the same name and extras
(the ``cpu``/``gpu`` extras), so the range is written once. A spec with its own version is used as is.
``--build-system`` adds ``[build-system].requires`` so the project itself can be installed offline with
``--no-build-isolation``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


def _key(requirement: str) -> tuple[str, frozenset[str]] | None:
    """(normalized name, extras) of a requirement string, or None if it has no leading name."""
    m = _NAME.match(requirement)
    if not m:
        return None
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    extras = frozenset(e.strip().lower() for e in (m.group(2) or "[]")[1:-1].split(",") if e.strip())
    return name, extras


def tf_requirement(spec: str, optional: dict[str, list[str]]) -> str:
    """Resolve ``spec`` to a requirement with a version range, from pyproject's optional deps if bare."""
    m = _NAME.match(spec)
    if not m:
        raise ValueError(f"--tf: not a package name: {spec!r} (expected e.g. tensorflow-cpu)")
    if spec[m.end():].strip():  # it carries its own version or marker
        return spec.strip()
    want = _key(spec)
    for reqs in optional.values():
        for req in reqs:
            if _key(req) == want:
                return req
    return spec.strip()


def requirements(pyproject: str, tf: str | None, build_system: bool) -> list[str]:
    """The requirement lines for ``pip install -r``: runtime deps, TensorFlow, build requirements."""
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    project = data["project"]
    lines = list(project.get("dependencies", []))
    if tf:
        lines.append(tf_requirement(tf, project.get("optional-dependencies", {})))
    if build_system:
        lines.extend(data.get("build-system", {}).get("requires", []))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", default="pyproject.toml", help="path to pyproject.toml")
    parser.add_argument("--tf", default=None, help="TensorFlow package, e.g. tensorflow-cpu")
    parser.add_argument("--build-system", action="store_true", help="add [build-system].requires")
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.pyproject, args.tf, args.build_system)
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"requirements.py: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
