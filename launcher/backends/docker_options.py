"""The Docker backend's own ``launcher up`` options (read by :mod:`launcher.backends.docker`). Light: the
registry (:data:`launcher.backends.BACKENDS`) names this module, and the CLI imports it to build its parser,
so it imports nothing but :class:`launcher.option.Option` (never the Docker SDK). :data:`IMAGE` and
:data:`WITH` are the container image options; the Swarm and Slurm backends declare them too."""

from __future__ import annotations

from launcher.option import Option

BUILD_MODES = ("auto", "online", "offline")  # --build (launcher.image.choose_build_path)

IMAGE = Option("image", "image", "str", "container image (docker/swarm backends; slurm with --slurm-runtime docker)",
               nullable=True, metavar="IMAGE")
WITH = Option("with", "with_packages", "list", "docker/swarm: run on the image with this package added (a pip "
              "requirement or a wheel file; repeatable; built FROM the base image as by `launcher build --with`; "
              "file: [up] with = [...] or [build] with = [...])", metavar="PKG")
BUILD = Option("build", "build", "choice", "docker backend: how a missing image is built; auto: online when a "
               "registry answers, else offline (debootstrap base + host-side wheels)", choices=BUILD_MODES)

OPTIONS: tuple[Option, ...] = (IMAGE, WITH, BUILD)
