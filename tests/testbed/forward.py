"""A TCP forwarder that makes ``localhost:PORT`` inside each node's namespace reach a port on the host.

Why: the local registry runs on the host's 127.0.0.1, and Docker trusts plain HTTP only for
registries on 127.0.0.0/8. With a listener on 127.0.0.1:PORT inside every node's namespace, the name
``localhost:5000/launcher:…`` means the same image on every daemon, as a real registry's name would.

One process serves every namespace: it enters each namespace just long enough to create a listening
socket there (a socket stays in the namespace it was made in), comes back, and dials the target from
the host's namespace. Run as ``python -m tests.testbed.forward --listen-port 5000 --target-port 5000
/run/netns/A /run/netns/B``; it prints ``ready`` once every listener is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import socket
import sys

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listen_in(ns_path: str, port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` inside the namespace at ``ns_path``; this thread returns to
    its own namespace before the call ends, whatever happens."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(ns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(64)
            sock.setblocking(False)
        finally:
            _setns(home)
    finally:
        os.close(home)
        os.close(target)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(sockets: list[socket.socket], target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    servers = [await asyncio.start_server(handle, sock=s) for s in sockets]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("namespaces", nargs="+", help="paths such as /run/netns/NAME")
    args = parser.parse_args(argv)
    sockets = [listen_in(p, args.listen_port) for p in args.namespaces]
    try:
        asyncio.run(serve(sockets, args.target_port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
