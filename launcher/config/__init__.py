"""Run configuration: every ``launcher up`` option as one typed, validated :class:`RunConfig`.

Each option is declared once in :data:`OPTIONS` (its flag, config-file key, environment variable, type and
help), so the parser, the TOML file, the environment and ``launcher config show`` cannot drift apart: the
options every run reads in :mod:`~launcher.config.options`, those only some backends read by each of those
backends (its options module, named in :data:`launcher.backends.BACKENDS`). Given where each value came
from, :func:`validate` refuses a backend option set for a backend the run does not use.
Modules: :mod:`~launcher.config.options` (the declarations and :class:`RunConfig`),
:mod:`~launcher.config.layers` (file, environment, flags) and :mod:`~launcher.config.checks` (validation).
Values are layered defaults < config file < ``LAUNCHER_*`` environment < flags by :func:`load_config` /
:func:`resolve_config`, which also say where each value came from; :func:`validate` then checks the whole
configuration and reports every problem at once (sample-factory's ``verify_cfg`` idea) before anything is
started.

The config file is TOML: ``launcher.toml`` in the working directory, or ``--config PATH`` /
``$LAUNCHER_CONFIG``. Table ``[up]`` takes any option by its flag name (``max-steps = 50000``; ``max_steps``
works too) and ``[up.hparams]`` the algorithm hyper-parameters (as ``--set`` does). docs/operator.md has an
example.
"""
from launcher.config.checks import check, gpu_request, port_free, validate
from launcher.config.layers import FileValues, find_config_file, load_config, read_config_file, resolve_config, show_rows
from launcher.backends.swarm_options import SWARM_GROUPS
from launcher.config.options import (BACKENDS, BY_FIELD, BY_NAME, DEFAULTS, FIELD_TYPES, OPTIONS, PLACEMENT_OPTIONS,
                                     PROGRESS_MODES, WAIT_FOREVER, RunConfig, coerce, parse_hparam)
from launcher.option import Option
from launcher.units import parse_duration, parse_size

__all__ = [
    "BACKENDS", "BY_FIELD", "BY_NAME", "DEFAULTS", "FIELD_TYPES", "OPTIONS", "PLACEMENT_OPTIONS", "PROGRESS_MODES",
    "SWARM_GROUPS", "WAIT_FOREVER", "FileValues", "Option", "RunConfig", "check", "coerce", "find_config_file",
    "gpu_request", "load_config", "parse_duration", "parse_hparam", "parse_size", "port_free", "read_config_file",
    "resolve_config", "show_rows", "validate",
]
