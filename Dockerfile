# launcher worker image: Python 3.11 + TensorFlow + this project in /opt/venv; entrypoint `python -m worker`.
#
# Online (a registry and PyPI are reachable):
#   docker build -t launcher:0.1.0-cpu .
#   docker build -t launcher:0.1.0-gpu --build-arg TF_PACKAGE='tensorflow[and-cuda]' .
# Offline (no registry, no PyPI; what `launcher build --offline` and docker/build-image.sh do):
#   sudo bash docker/build-base.sh && bash docker/fetch-wheels.sh
#   docker build --network none -t launcher:0.1.0-cpu \
#     --build-arg BASE_IMAGE=launcher-base:bookworm --build-arg OFFLINE=1 .
# docs/image.md explains the choices, sizes and times.
#
# Stages keep TensorFlow out of the way of code changes: `sources` gathers the project and reduces
# pyproject.toml to the dependency list, `deps` installs that list (the slow layer; cached while the list
# and the wheels are unchanged), `project` installs launcher + worker with --no-deps into a separate
# prefix, and the final stage copies both; neither the wheels nor pip's cache reach the final image.
# Each instruction costs the legacy builder (the Docker SDK's) a container commit, several seconds on
# top of the 1.6 GB venv on fuse-overlayfs, so the small steps happen on the small base image.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS sources
# tensorflow-cpu for CPU hosts; tensorflow[and-cuda] brings CUDA/cuDNN as pip wheels for GPU hosts.
# A bare name takes its version range from pyproject.toml's cpu/gpu extras.
ARG TF_PACKAGE=tensorflow-cpu
COPY pyproject.toml README.md* docker/requirements.py /src/
COPY launcher /src/launcher
COPY worker /src/worker
RUN python3 /src/requirements.py --pyproject /src/pyproject.toml --tf "$TF_PACKAGE" --build-system \
      > /requirements.txt \
 && rm /src/requirements.py

FROM ${BASE_IMAGE} AS deps
# OFFLINE=1: install only from WHEELS_DIR (pip --no-index); the build then needs no network at all.
# OFFLINE=0: use WHEELS_DIR when it has wheels, and the package index for the rest.
ARG OFFLINE=0
ARG WHEELS_DIR=docker/wheels/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=sources /requirements.txt /build/requirements.txt
# The trailing * lets the build go on when WHEELS_DIR does not exist (online builds).
COPY docker/requirements.py ${WHEELS_DIR}* /wheels/
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then \
      ls /wheels/*.whl >/dev/null 2>&1 || { \
        echo "OFFLINE=1 but no wheels in $WHEELS_DIR; run docker/fetch-wheels.sh first" >&2; exit 2; }; \
      set -- --no-index --find-links /wheels; \
    elif ls /wheels/*.whl >/dev/null 2>&1; then \
      set -- --find-links /wheels; \
    else \
      set --; \
    fi; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install "$@" -r /build/requirements.txt; \
    # TensorFlow's C++ headers (~290 MB) only serve compiling custom ops, which a worker never does.
    rm -rf /opt/venv/lib/python3.*/site-packages/tensorflow/include; \
    TF_CPP_MIN_LOG_LEVEL=2 TF_ENABLE_ONEDNN_OPTS=0 \
      /opt/venv/bin/python -c "import tensorflow, gymnasium, numpy, matplotlib, docker, pynvml, rich"

FROM deps AS project
COPY --from=sources /src /src
# --prefix keeps the project's files apart so the final stage copies kilobytes, not the whole venv.
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation --no-index --prefix /opt/project /src

FROM ${BASE_IMAGE}
ARG UID=10001
# A named user for plain `docker run`; the launcher runs containers as the invoking host user instead
# (--user $(id -u):$(id -g)) so result files on bind mounts belong to that user. Any uid works: nothing
# outside /tmp is written, HOME and every cache point into /tmp, and the venv is world-readable.
# No setuid/setgid programs (su, passwd, mount, ...): nothing in a run needs them, and Docker 20.10 drops
# no-new-privileges on Swarm tasks, so a compromised env could otherwise use them to become root.
RUN echo "launcher:x:${UID}:${UID}:launcher:/tmp:/usr/sbin/nologin" >>/etc/passwd \
 && echo "launcher:x:${UID}:" >>/etc/group \
 && find / -xdev -type f -perm /6000 -exec chmod a-s {} +
# Declared after the last RUN: the legacy builder keys a RUN's cache on every ARG in scope, and
# REVISION changes with each commit.
ARG BASE_IMAGE
ARG TF_PACKAGE=tensorflow-cpu
ARG VERSION=0.1.0
ARG REVISION=unknown
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/.cache \
    KERAS_HOME=/tmp/.keras \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    TF_ENABLE_ONEDNN_OPTS=0
WORKDIR /tmp
USER ${UID}:${UID}
ENTRYPOINT ["python", "-m", "worker"]
CMD ["--help"]
# Everything above and the dependency copy stay cached across commits; the revision label and the
# project's own files come last because they change with every commit.
COPY --from=deps /opt/venv /opt/venv
LABEL org.opencontainers.image.title="launcher" \
      org.opencontainers.image.description="Worker image for launcher: distributed RL with TensorFlow (master and worker groups)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      launcher.image="1" \
      launcher.tf-package="${TF_PACKAGE}"
COPY --from=project /opt/project/ /opt/venv/
