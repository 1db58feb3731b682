"""The multi-node test bed: extra Docker daemons in network namespaces, a swarm of them, a local registry.

Modules: ``netns`` (namespaces, veths, bridge), ``daemon`` (one extra dockerd and its cleanup),
``registry`` and ``forward`` (localhost:5000 on every node), ``bed`` (bring-up and teardown of a whole
bed from its record), ``fixtures`` (pytest fixtures), ``__main__`` (scripts/testbed.sh).
Needs root, iproute2, nsenter/unshare and dockerd; Debian's ``docker-registry`` for the registry.
"""
