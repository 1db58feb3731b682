"""``launcher build``: build the worker image, optionally push it. Build lines go to stderr; the tag
(or the pushed reference) is the only thing printed on stdout, so scripts can capture it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher.config.layers import build_with_from_file
from launcher.image import BuildOptions, Flavour, choose_build_path, default_tag, find_context, parse_extras
from launcher.image_build import build_extras_image, build_image, push_image


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "build",
        help="build the worker image (TensorFlow + this project)",
        description="Build the worker image. --online uses python:3.11-slim-bookworm and the package index; "
        "--offline needs neither a registry nor PyPI inside the build: it debootstraps a base image "
        "(root or sudo) and downloads wheels on the host first. With neither, the path that can work here is "
        "picked in seconds (online when a registry answers). See docs/image.md.",
    )
    parser.add_argument("--tag", help="image reference to create (default: launcher:VERSION-cpu or -gpu)")
    flavour = parser.add_mutually_exclusive_group()
    flavour.add_argument("--cpu", dest="flavour", action="store_const", const=Flavour.CPU,
                         help="tensorflow-cpu (default)")
    flavour.add_argument("--gpu", dest="flavour", action="store_const", const=Flavour.GPU,
                         help="tensorflow[and-cuda]: CUDA and cuDNN as pip wheels; hosts need the NVIDIA "
                         "driver and container toolkit")
    parser.add_argument("--base-image", metavar="IMG",
                        help="FROM image (default: python:3.11-slim-bookworm online, launcher-base:bookworm "
                        "offline)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--offline", dest="offline", action="store_true",
                      help="no registry, no index inside the build (needs debootstrap and root/sudo once)")
    mode.add_argument("--online", dest="offline", action="store_false", help="pull the base, use PyPI")
    parser.add_argument("--push", metavar="REGISTRY",
                        help="after building, tag as REGISTRY/launcher:TAG and push (e.g. registry.local:5000)")
    parser.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    parser.add_argument("--context", type=Path, metavar="DIR",
                        help="directory with the Dockerfile (default: this source tree)")
    parser.add_argument("--with", dest="with_packages", action="append", default=None, metavar="PKG",
                        help="also build an image FROM the base with PKG added: a pip requirement (ale-py, "
                        "'flappy-bird-gymnasium==0.4.0') or a wheel file (repeatable; file: [build] with = [...]). "
                        "Wheels are downloaded on this host; the build has no network. Prints that image's tag "
                        "(BASE-with-HASH); `launcher up --with PKG` picks the same image")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML config file for [build] with [./launcher.toml if present; env LAUNCHER_CONFIG]")
    parser.set_defaults(func=run, flavour=Flavour.CPU, offline=None)


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    """The one place `launcher build` arguments become a checked :class:`BuildOptions`."""
    flavour: Flavour = args.flavour
    return BuildOptions(
        tag=args.tag or default_tag(flavour),
        flavour=flavour,
        offline=bool(args.offline),
        base_image=args.base_image,
        context=args.context if args.context is not None else find_context(),
        no_cache=args.no_cache,
    )


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    if args.offline is None:  # neither flag: the path that can work on this host
        from dataclasses import replace

        from launcher.engine import connect_client

        client = connect_client()
        path = choose_build_path("auto", options, client)
        _progress(f"building {'offline' if path.offline else 'online'}: {path.why}")
        options = replace(options, offline=path.offline)
    with_packages = tuple(args.with_packages or ()) or build_with_from_file(args.config)[0]
    extras = parse_extras(with_packages)  # a wrong --with fails before minutes of base build
    result = build_image(options, _progress)
    if extras:
        result = build_extras_image(result.tag, extras, progress=_progress, context=options.context,
                                    no_cache=options.no_cache)
    reference = push_image(result.tag, args.push, _progress) if args.push else result.tag
    sys.stdout.write(reference + "\n")
    return 0
