"""Backends turn a prepared run (spec + plan + secret) into running things: local processes
(:mod:`launcher.backends.process`), Docker containers (:mod:`launcher.backends.docker`), or Swarm
services. They share one interface, :class:`launcher.backends.base.Backend`, and the supervisor
(:mod:`launcher.supervisor`) drives any of them the same way.
"""
