"""One error family for everything the launcher refuses or cannot do.

Every error carries what was wrong, the value seen and what to do next (``hint``), and the exit code the
CLI maps it to. Library code raises these; only ``launcher.cli`` turns them into exit codes.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Documented process exit codes of ``launcher`` (README.md has the table)."""

    OK = 0  # the run finished: reached --until-return, or ran its --max-steps with no target set;
    # `launcher check`: a run of the kind asked (GPU, or CPU with --cpu) can start here
    INTERNAL = 1  # a bug or an unexpected failure; the message says where to look
    BAD_INPUT = 2  # a flag, config file or policy value was wrong; nothing was started
    TARGET_NOT_REACHED = 3  # --until-return was not reached within --max-steps
    TIMEOUT = 4  # --timeout elapsed; the run was torn down cleanly
    NO_RESOURCES = 5  # not enough free GPUs/CPUs, or they are held by other runs
    MISSING_DEPENDENCY = 6  # no Docker engine, NVIDIA runtime, Slurm client/controller or NVML driver where required;
    # `launcher check`: a line the run asked about needs is missing or broken
    RUN_FAILED = 7  # the master died or every worker group was lost
    INTERRUPTED = 130  # SIGINT or SIGTERM; everything was torn down


class LauncherError(Exception):
    """Base of every error the launcher raises on purpose.

    Args:
        message: what was wrong, including the value seen.
        hint: what the user can do about it (printed on its own ``HINT:`` line).
    """

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class BadInput(LauncherError):
    """A flag, config field or file the user gave is invalid."""

    exit_code = ExitCode.BAD_INPUT


class ConfigErrors(BadInput):
    """Several configuration problems, all reported at once."""

    def __init__(self, problems: list[str], *, hint: str | None = None) -> None:
        self.problems = list(problems)
        msg = "invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg, hint=hint)


class NoResources(LauncherError):
    """The request cannot be placed on what is free right now."""

    exit_code = ExitCode.NO_RESOURCES


class MissingDependency(LauncherError):
    """An outside system the run needs (Docker engine, NVIDIA runtime, Slurm, NVML driver) is not there."""

    exit_code = ExitCode.MISSING_DEPENDENCY


class RunFailed(LauncherError):
    """The run started but could not go on (master died, every group lost)."""

    exit_code = ExitCode.RUN_FAILED


class Interrupted(LauncherError):
    """The user (or the CI runner) sent SIGINT/SIGTERM; the run was torn down."""

    exit_code = ExitCode.INTERRUPTED
