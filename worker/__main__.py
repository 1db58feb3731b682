"""``python -m worker master|group --index N``: the entry point of a run's processes and containers.

The run spec comes from ``--spec FILE`` or the ``LAUNCHER_SPEC`` environment variable (JSON); the secret
from ``LAUNCHER_SECRET`` / ``LAUNCHER_SECRET_FILE``. ``LAUNCHER_MASTER_ADDR`` (host:port) overrides where
a group dials. Exit codes (named in :mod:`worker.contract`): 0 finished/stopped, 1 failed, 2 bad spec, 3 master
unreachable, 4 the master refused the group's secret, 5 the algorithm's code raised in the group (the supervisor
restarts neither 4 nor 5, and neither spends the restart budget), 75 a GPU lease was taken by another run.
A master whose run's ``summary.json`` already records an end exits 0 at once, touching nothing: the engine's
``on-failure`` policy of a detached Docker run restarted it after it failed (:func:`ended_already`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from worker.contract import EXIT_BAD_SPEC, EXIT_FAILED, EXIT_OK, LOG_LEVEL_ENV, MASTER_ADDR_ENV, parse_addr


def _load_spec(path: str | None):  # -> RunSpec
    from worker.contract import SPEC_ENV, RunSpec

    if path:
        with open(path) as fh:
            return RunSpec.from_json(fh.read())
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise ValueError(f"no run spec: pass --spec FILE or set {SPEC_ENV}")
    return RunSpec.from_json(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description="Run a launcher master or worker group.")
    parser.add_argument("role", choices=("master", "group"))
    parser.add_argument("--index", type=int, default=None, help="worker group index (role group)")
    parser.add_argument("--spec", default=None, help="run spec JSON file (default: $LAUNCHER_SPEC)")
    parser.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV, "INFO"))
    args = parser.parse_args(argv)
    if args.role == "master" and (ended := ended_already(args.spec)) is not None:
        sys.stderr.write(ended + "\n")
        return EXIT_OK  # 0: the engine's on-failure policy stops restarting it
    # Before any heavy import: the run's GPU leases live as long as this process (the master's; an elastic run's
    # groups hold those of the GPUs the master does not use, launcher.backends.docker_elastic).
    from worker.lease import hold_from_env

    hold_from_env()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.role}{'' if args.index is None else args.index} %(levelname)s %(message)s")
    for noisy in ("absl", "tensorflow", "h5py", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from worker.gpu_setup import adopt_swarm_gpus
    from worker.contract import take_secret

    adopt_swarm_gpus()  # on a swarm the engine picked this task's GPUs; before anything loads CUDA

    try:
        spec = _load_spec(args.spec)
        secret = take_secret()
    except (ValueError, OSError, RuntimeError) as exc:
        logging.getLogger("worker").error("cannot start: %s", exc)
        return EXIT_BAD_SPEC
    if args.role == "master":
        from worker.contract import hold_live

        hold_live(spec.results_dir)  # the run is live while this process is: `up --resume` refuses it
        master = None
        try:
            from worker.master import Master, install_signal_handlers

            master = Master(spec, secret)
            install_signal_handlers(master)
            return master.run()
        except Exception as exc:  # noqa: BLE001 - whatever ended the master, the launcher must learn what
            return master_crashed(spec, exc, summary_written=master is not None and master.outcome is not None)
    if args.index is None:
        parser.error("group needs --index")
    from worker.algorithms import UserCodeError
    from worker.group import EXIT_USER_CODE, WorkerGroup, install_signal_handlers as group_signals

    where = f"group {args.index}"
    try:
        addr = parse_addr(os.environ.get(MASTER_ADDR_ENV, f"{spec.connect_host}:{spec.master_port}"))
        group = WorkerGroup(spec, args.index, secret, addr)
    except UserCodeError as exc:  # the pre-flight check passed, yet here the algorithm cannot be loaded
        logging.getLogger("worker").error("cannot start: %s", exc)
        say_fatal(exc, f"{where}: loading the algorithm")
        return EXIT_USER_CODE
    except Exception as exc:  # noqa: BLE001 - its envs or its setup: the launcher must learn what
        logging.getLogger("worker").exception("cannot start")
        say_fatal(exc, f"{where}: starting")
        return EXIT_FAILED
    group_signals(group)
    try:
        return group.run()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("worker").exception("group %d failed", args.index)
        say_fatal(exc, where)
        return EXIT_FAILED


def ended_already(spec_path: str | None) -> str | None:
    """Why this master must not start: its run's ``summary.json`` already records an end (the engine restarted a
    detached run's master that raised and exited 1: :func:`worker.recovery.recorded_end`), or None. Checked before
    the leases are taken and anything is read or written: the checkpoints and ``summary.json`` stay as they are.
    A spec that cannot be read is left to the normal start, which reports it."""
    from pathlib import Path

    from worker.contract import RunFiles
    from worker.recovery import recorded_end

    try:
        spec = _load_spec(spec_path)
    except (ValueError, OSError, RuntimeError):
        return None
    outcome = recorded_end(RunFiles(Path(spec.results_dir)).summary, spec.run_id)
    if outcome is None:
        return None
    return (f"master: run {spec.run_id} already ended (summary.json: outcome {outcome}); not training it again "
            f"(a restart after its end, by the engine's restart policy); `launcher status {spec.run_id}` says how it "
            f"ended, `launcher down {spec.run_id}` then `launcher up --resume {spec.run_id}` continues it")


def say_fatal(exc: BaseException, where: str) -> None:
    """The last line on stderr (the part's log): what killed this process (:func:`worker.ending.fatal_line`)."""
    from worker.ending import error_doc, fatal_line

    sys.stderr.write(fatal_line(error_doc(exc, where)) + "\n")
    sys.stderr.flush()


def master_crashed(spec, exc: BaseException, *, summary_written: bool) -> int:  # spec: RunSpec
    """An exception escaped the master (its imports, its construction, its shutdown): log the traceback and, unless
    the master wrote its summary already, write one that names the exception, so ``launcher status``, ``--json``
    and the live view say what happened rather than only an exit code. Returns the exit code."""
    from pathlib import Path

    from worker.contract import RunFiles
    from worker.ending import Outcome, error_doc
    from worker.results import atomic_write_json

    logging.getLogger("worker.master").exception("master failed")
    say_fatal(exc, "the master")
    if not summary_written:
        try:
            atomic_write_json(RunFiles(Path(spec.results_dir)).summary, {
                "schema": "launcher.summary/v1", "run_id": spec.run_id, "outcome": Outcome.FAILED.value,
                "target_reached": False, "error": error_doc(exc, "the master")})
        except OSError as write_error:
            logging.getLogger("worker.master").error("cannot write summary.json: %s", write_error)
    return EXIT_FAILED


def exit_now(code: int) -> NoReturn:
    """End the process without Python's finalisation. By now everything the run writes is flushed and closed
    (metrics, summary and status are written atomically, TensorBoard events are flushed per write, leases are
    flocks the kernel drops), and tearing TensorFlow's runtime down took ~0.7 s of every run's wall time on
    this kind of machine (measured after a PPOLearner was built: 0.68 s from the last line to the exit)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
