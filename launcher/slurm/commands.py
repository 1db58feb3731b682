"""The one module that asks Slurm anything: ``sbatch``, ``scontrol``, ``scancel`` (and finds ``srun``), each
run with a deadline, each failure turned into a :class:`~launcher.errors.LauncherError` that says what was
asked, what Slurm answered and what to do.

Every call reads the cluster named by ``SLURM_CONF`` (or ``/etc/slurm/slurm.conf``, or a configless
cluster's DNS record), as Slurm's own commands do. The deadline is ``LAUNCHER_SLURM_TIMEOUT`` seconds (20):
Slurm's clients retry an unreachable controller for a long time, and a launcher must never hang on one.

The long-lived ``srun`` of each step is not run here: it is a child process of the backend for as long as
its step lives (:mod:`launcher.backends.slurm`), like the process backend's children; this module only finds
it (:func:`require`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources, RunFailed
from launcher.slurm.model import ClusterView, JobInfo, StepInfo, parse_records

log = logging.getLogger(__name__)

TIMEOUT_ENV = "LAUNCHER_SLURM_TIMEOUT"
DEFAULT_TIMEOUT_S = 20.0
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")
CLIENT_HINT = ("install Slurm's client commands (Debian: `apt-get install slurm-client`) or load the site's "
               "module (`module load slurm`); SLURM_CONF names the cluster's slurm.conf when it is not in /etc/slurm")
# What Slurm's clients print when slurmctld does not answer.
_UNREACHABLE = ("Unable to contact slurm controller", "Zero Bytes were transmitted", "Socket timed out",
                "Connection refused", "Communication connection failure", "Unable to establish controller",
                "authentication", "Munge", "munge")


def timeout_s(environ: dict[str, str] | None = None) -> float:
    """The deadline of one Slurm command, from ``LAUNCHER_SLURM_TIMEOUT``.

    Raises:
        BadInput: not a positive number.
    """
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BadInput(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds", hint=f"unset it for {DEFAULT_TIMEOUT_S:g}")
    return value


def conf_where() -> str:
    """Which slurm.conf the clients read, for messages."""
    conf = os.environ.get("SLURM_CONF")
    return f"SLURM_CONF={conf}" if conf else f"{DEFAULT_CONF} (SLURM_CONF unset)"


def require(command: str) -> str:
    """The path of Slurm client ``command``.

    Raises:
        MissingDependency: it is not on PATH, or SLURM_CONF names no file.
    """
    path = shutil.which(command)
    if path is None:
        raise MissingDependency(f"--backend slurm needs Slurm's `{command}`, which is not on PATH "
                                f"({os.environ.get('PATH', '')})", hint=CLIENT_HINT)
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise MissingDependency(f"SLURM_CONF={conf} names no file, so Slurm's commands cannot find the cluster",
                                hint="point SLURM_CONF at the cluster's slurm.conf, or unset it to use /etc/slurm")
    return path


def run(argv: Sequence[str], *, what: str, deadline_s: float | None = None, ok: tuple[int, ...] = (0,)) -> str:
    """Run Slurm command ``argv`` (its first word found by :func:`require`) and return its stdout.

    Args:
        what: what is being done, for the error message (``submitting the run's job``).
        ok: exit statuses that are not failures.

    Raises:
        MissingDependency: the command is missing, did not answer within its deadline, or slurmctld is not
            reachable (exit 6).
        RunFailed: Slurm refused (the message carries its words).
    """
    argv = [require(argv[0]), *argv[1:]]
    limit = deadline_s if deadline_s is not None else timeout_s()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise MissingDependency(
            f"Slurm did not answer {what} within {limit:g} s (`{' '.join(argv)}`, cluster from {conf_where()})",
            hint="check that slurmctld runs and this host reaches it (`scontrol ping`); raise "
                 f"{TIMEOUT_ENV} on a slow controller") from None
    except OSError as exc:
        raise MissingDependency(f"cannot run `{argv[0]}` for {what}: {exc.strerror or exc}", hint=CLIENT_HINT) from None
    if done.returncode in ok:
        return done.stdout
    err = (done.stderr or done.stdout).strip().splitlines()
    text = "; ".join(err[-3:]) or f"exit status {done.returncode}"
    if any(word in text for word in _UNREACHABLE):
        raise MissingDependency(f"Slurm's controller is not reachable for {what}: {text} (cluster from {conf_where()})",
                                hint="check that slurmctld and munged run and this host reaches the controller "
                                     "(`scontrol ping`); SLURM_CONF must name the cluster's slurm.conf")
    raise RunFailed(f"Slurm refused {what}: {text}", hint=f"`{' '.join(argv)}` shows the same")


# ------------------------------------------------------------------------------------------- reading
def cluster() -> ClusterView:
    """Partitions and nodes (with their GRES and states), from slurmctld."""
    parts = run(["scontrol", "-o", "show", "partition"], what="reading the cluster's partitions")
    nodes = run(["scontrol", "-o", "show", "node"], what="reading the cluster's nodes")
    return ClusterView.parse(parts, nodes)


def job(job_id: str) -> JobInfo | None:
    """Job ``job_id`` as slurmctld sees it; None once it has forgotten it (MinJobAge after its end)."""
    out = run(["scontrol", "-o", "show", "job", str(job_id)], what=f"reading job {job_id}", ok=(0, 1))
    records = parse_records(out)
    return JobInfo.from_record(records[0]) if records and records[0].get("JobId") else None


def steps(job_id: str) -> list[StepInfo]:
    """The job's steps that still run (the batch step included); none once the job ended."""
    out = run(["scontrol", "-o", "show", "step", str(job_id)], what=f"reading job {job_id}'s steps", ok=(0, 1))
    return [StepInfo.from_record(r) for r in parse_records(out) if r.get("StepId")]


# ------------------------------------------------------------------------------------------- changing
def submit(argv: Sequence[str]) -> str:
    """``sbatch --parsable ARGS``; returns the job id.

    Raises:
        NoResources: the cluster can never run it (no such node configuration, over a partition limit).
        RunFailed, MissingDependency: as :func:`run`.
    """
    try:
        out = run(["sbatch", "--parsable", *argv], what="submitting the run's job")
    except RunFailed as exc:
        if "node configuration is not available" in exc.message or "limit" in exc.message.lower():
            raise NoResources(exc.message, hint="ask for fewer nodes or GPUs (--slurm-nodes, --groups, --gpus none), "
                                                "or another partition (--slurm-partition); `sinfo -o '%P %D %G'` "
                                                "shows what each partition has") from None
        raise
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise LauncherError(f"sbatch printed {out.strip()!r}, not a job id", hint="run it by hand with --parsable")
    return job_id


# What scancel says about a job or step that is gone or going; not a failure of a cancel. Slurm 22.05 also says
# "Invalid job id specified" (exit status 225) after it delivered a signal to a step whose processes changed while
# slurmstepd walked them (seen on the test bed with every TensorFlow master step): the signal did arrive.
_GONE = ("Invalid job id specified", "already completing or completed", "Job/step already", "already done")


def cancel(target: str, *, signal: str | None = None) -> None:
    """``scancel [--signal SIG] TARGET`` (a job ``12`` or a step ``12.3``); a job or step already gone is fine."""
    argv = ["scancel", *([f"--signal={signal}"] if signal else []), str(target)]
    try:
        run(argv, what=f"{'signalling' if signal else 'cancelling'} {target}")
    except RunFailed as exc:
        if not any(word in exc.message for word in _GONE):
            raise


def in_allocation(environ: dict[str, str] | None = None) -> str | None:
    """The job id of the allocation this launcher runs in (``salloc``/``sbatch``), or None."""
    value = (os.environ if environ is None else environ).get("SLURM_JOB_ID", "").strip()
    return value if value.isdigit() else None
