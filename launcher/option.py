"""The :class:`Option` type: one ``launcher up`` option as flag, config-file key and environment variable.

Its own tiny module so that both sides can import it without a cycle: :mod:`launcher.config.options` (the
options every run has, and the typed :class:`~launcher.config.RunConfig`) and each backend's light options
module (``launcher.backends.<name>_options``, named in :data:`launcher.backends.BACKENDS`), which declares the
options only that backend reads. Nothing here imports the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One ``launcher up`` option: flag ``--<name>``, file key ``<name>``, variable ``LAUNCHER_<NAME>``.

    kind: how text and TOML values are read: ``int``, ``float``, ``str``, ``bool``, ``path``,
    ``duration`` (seconds, or text like ``15m``), ``size`` (``8GiB``), ``choice`` or ``list`` (of strings: a
    repeatable flag, a TOML array, whitespace-separated in a ``LAUNCHER_*`` variable).
    nullable: ``"none"`` means "no value" (no limit, no target).
    """

    name: str
    field: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    nullable: bool = False
    metavar: str | None = None
    const: str | None = None  # the value of the bare flag, which then takes an optional value (--wait)

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def env_var(self) -> str:
        return "LAUNCHER_" + self.name.upper().replace("-", "_")
