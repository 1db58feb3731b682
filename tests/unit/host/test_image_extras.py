"""The derived image's recipe (launcher/image.py): ``--with`` values, its hash and its tag. Pure; the builds
themselves run against a real engine in tests/docker/test_env_packages.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import BadInput
from launcher.image import Extra, extras_hash, extras_tag, parse_extras, valid_reference


def test_with_values_are_requirements_or_wheel_files(tmp_path: Path) -> None:
    wheel = tmp_path / "lab_env-0.1-py3-none-any.whl"
    wheel.write_bytes(b"zip")
    req, whl = parse_extras(["ale-py>=0.10", str(wheel)])
    assert req == Extra("ale-py>=0.10") and req.key == "ale-py>=0.10"
    assert whl.wheel == wheel.resolve() and len(whl.sha256) == 64
    assert whl.key == f"{wheel.name}@sha256:{whl.sha256}"
    with pytest.raises(BadInput) as err:
        parse_extras([str(tmp_path / "gone.whl"), "--index-url=http://x", ""])
    assert f"--with {tmp_path / 'gone.whl'}: no such wheel file" in err.value.message
    assert "--with '--index-url=http://x': not a pip requirement" in err.value.message


def test_the_tag_names_the_base_and_a_hash_of_base_and_extras(tmp_path: Path) -> None:
    wheel = tmp_path / "x-1-py3-none-any.whl"
    wheel.write_bytes(b"one")
    extras = parse_extras(["ale-py", str(wheel)])
    h = extras_hash("sha256:base1", extras)
    assert len(h) == 12 and h == extras_hash("sha256:base1", parse_extras(["ale-py", str(wheel)]))
    assert h != extras_hash("sha256:base2", extras), "a rebuilt base makes a new derived image"
    assert h != extras_hash("sha256:base1", parse_extras(["ale-py"]))
    wheel.write_bytes(b"two")
    assert h != extras_hash("sha256:base1", parse_extras(["ale-py", str(wheel)])), "a rebuilt wheel too"
    assert extras_tag("launcher:0.1.0-cpu", h) == f"launcher:0.1.0-cpu-with-{h}"
    assert extras_tag("registry.local:5000/rl/launcher:0.1.0-gpu", h) == \
        f"registry.local:5000/rl/launcher:0.1.0-gpu-with-{h}"
    assert extras_tag("myimage", h) == f"myimage:latest-with-{h}"
    assert all(valid_reference(extras_tag(b, h)) for b in ("launcher:0.1.0-cpu", "myimage", "a.b:5000/c:d"))
