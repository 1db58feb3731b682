"""``launcher build --with``: the derived image made by one commit (:mod:`launcher.image_extras`) against the
``docker build`` of the multi-stage Dockerfile it replaced, on this engine, interleaved in one script.

Both install the same wheel on the same base with no network and end in the same image (the base plus one layer,
the same labels); each pair builds with the old recipe and the new one in turn (the order alternates), and each
image is removed after it is timed, so neither finds the other's work. Needs the worker image on the engine
(``launcher build --offline``).
"""

from __future__ import annotations

import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT

# docker/Dockerfile.extras as it was before the commit path replaced it (git show 846250b:docker/Dockerfile.extras)
DOCKERFILE_BEFORE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE} AS extras
USER 0
COPY wheels/ /wheels/
COPY requirements.txt /requirements.txt
RUN /opt/venv/bin/pip install --no-index --find-links /wheels --no-warn-script-location --prefix /opt/extras \\
      -r /requirements.txt \\
 && mkdir -p /opt/extras

FROM ${BASE_IMAGE}
COPY --from=extras /opt/extras/ /opt/venv/
"""


def _wheel(dest: Path) -> Path:
    """The test suite's tiny env package (tests/data/envpkg) as a wheel: the smallest real ``--with``."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest),
                    str(ROOT / "tests" / "data" / "envpkg")], check=True, capture_output=True, timeout=300)
    (wheel,) = dest.glob("launcher_test_envpkg-*.whl")
    return wheel


def _docker_build(client: Any, base: str, wheel: Path, tag: str, labels: dict[str, str]) -> float:
    """The recipe before: ``docker build`` of :data:`DOCKERFILE_BEFORE` with the labels as build labels (as
    ``build_extras_image`` passed them), its intermediate images removed after, as it did."""
    from launcher.engine.images import remove_untagged
    from launcher.image import BuildOptions
    from launcher.image_engine_build import docker_build, normalize
    from launcher.image_progress import BuildReporter

    with tempfile.TemporaryFile() as fileobj:
        with tarfile.open(fileobj=fileobj, mode="w") as tar:
            for name, data in (("Dockerfile", DOCKERFILE_BEFORE.encode()),
                               ("requirements.txt", f"/wheels/{wheel.name}\n".encode()),
                               (f"wheels/{wheel.name}", wheel.read_bytes())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(normalize(member), io.BytesIO(data))
        fileobj.seek(0)
        layers: list[str] = []
        t0 = time.perf_counter()
        docker_build(client, fileobj, BuildOptions(tag=tag, base_image=base, context=ROOT),
                     BuildReporter(tag, lambda line: None, None), layers, buildargs={"BASE_IMAGE": base}, network_none=True,
                     no_cache=True, labels=labels)
        remove_untagged(layers, client)
        return time.perf_counter() - t0


def extras_build(reps: int = 3) -> dict[str, Any]:
    from launcher.engine.client import connect_client
    from launcher.image import EXTRAS_BASE_LABEL, EXTRAS_LABEL, EXTRAS_PACKAGES_LABEL, Flavour, default_tag, parse_extras
    from launcher.image_extras import build_extras_image

    client = connect_client()
    base = default_tag(Flavour.CPU)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _wheel(Path(tmp))
        extras = parse_extras([str(wheel)])
        runs: dict[str, list[float]] = {"docker build (before)": [], "one commit": []}
        for i in range(reps):
            for path in (("docker build (before)", "one commit") if i % 2 == 0 else ("one commit", "docker build (before)")):
                if path == "one commit":
                    t0 = time.perf_counter()
                    result = build_extras_image(base, extras, client=client, no_cache=True)
                    runs[path].append(time.perf_counter() - t0)
                    client.images.remove(result.tag, force=True)
                else:
                    tag = f"launcher-bench:extras-before-{i}"
                    # the three labels build_extras_image gave the build (the legacy builder adds a step for each)
                    labels = {EXTRAS_LABEL: f"bench-{i}", EXTRAS_PACKAGES_LABEL: f'["{wheel.name}"]', EXTRAS_BASE_LABEL: base}
                    runs[path].append(_docker_build(client, base, wheel, tag, labels))
                    client.images.remove(tag, force=True)
    driver = client.info().get("Driver", "?")
    before = statistics.median(runs["docker build (before)"])
    table = [{"path": p, "median_s": statistics.median(r), "ratio_vs_docker_build": statistics.median(r) / before,
              "runs": r} for p, r in runs.items()]
    return {"table": table, "reps": reps, "base": base, "storage_driver": driver, "wheel": wheel.name}
