"""Site policy: limits an administrator sets for every run on a machine, and the pure functions that apply them.

The policy file is TOML at ``$LAUNCHER_POLICY`` or ``/etc/launcher/policy.toml`` (a missing default file
means "no policy")::

    max_gpus_per_user = 2            # GPUs one user's runs may hold at once (across their runs)
    min_free_memory = "8GiB"         # floor under --min-free-memory
    reserved_gpus = [0, "GPU-8f3a"]  # indices or UUIDs no run may touch
    max_workers_per_gpu = 32         # workers placed on one GPU

``launcher up`` and ``launcher plan`` obey it where the plan is made: :func:`floor_min_free_memory` raises the
memory threshold, :func:`filter_gpus` drops reserved GPUs and caps the count (selection already ordered
them least loaded first), :func:`check_plan` refuses a plan with too many workers on a GPU. Each returns
the sentences that go into ``plan.reasons``, so the user sees when the policy limited them.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from launcher.errors import BadInput, ConfigErrors
from launcher.units import format_size, parse_size

POLICY_ENV = "LAUNCHER_POLICY"
DEFAULT_POLICY_PATH = Path("/etc/launcher/policy.toml")
KEYS = ("max_gpus_per_user", "min_free_memory", "reserved_gpus", "max_workers_per_gpu", "elastic")
# ``elastic``: whether runs may be elastic (``launcher up --elastic``). "allow" (no policy), "default" (a run that
# does not say is elastic down to half its groups), "forbid" (``--elastic`` is refused). Narrowing: forbid wins.
ELASTIC = ("allow", "default", "forbid")


class PolicyViolation(BadInput):
    """The request cannot be met within the site policy (exit 2: change the request, not the timing)."""


@dataclass(frozen=True)
class SitePolicy:
    """The admin's limits; None (or empty) means "no limit"."""

    source: str | None = None  # the file it came from
    max_gpus_per_user: int | None = None
    min_free_memory_bytes: int | None = None
    reserved_gpus: tuple[str, ...] = ()  # NVML indices (as text) or UUIDs
    max_workers_per_gpu: int | None = None
    elastic: str = "allow"

    @property
    def empty(self) -> bool:
        return (self.max_gpus_per_user is None and self.min_free_memory_bytes is None and not self.reserved_gpus
                and self.max_workers_per_gpu is None and self.elastic == "allow")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reserved_gpus"] = list(self.reserved_gpus)
        return d

    @property
    def label(self) -> str:
        return f"site policy {self.source}" if self.source else "site policy"


def policy_path(environ: Mapping[str, str] | None = None) -> tuple[Path, bool]:
    """(path, whether it was named explicitly through ``$LAUNCHER_POLICY``)."""
    env = os.environ if environ is None else environ
    if env.get(POLICY_ENV):
        return Path(env[POLICY_ENV]).expanduser(), True
    return DEFAULT_POLICY_PATH, False


def narrow(site: SitePolicy, user: SitePolicy) -> SitePolicy:
    """The stricter of two policies, limit by limit (pure): a user's own policy can narrow the site's, never
    widen it (smaller caps, a higher memory floor, more reserved GPUs)."""
    def low(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else min(a, b)

    floor = [v for v in (site.min_free_memory_bytes, user.min_free_memory_bytes) if v is not None]
    sources = [s for s in (site.source, user.source) if s]
    return SitePolicy(source=" narrowed by ".join(sources) or None,
                      max_gpus_per_user=low(site.max_gpus_per_user, user.max_gpus_per_user),
                      min_free_memory_bytes=max(floor) if floor else None,
                      reserved_gpus=tuple(dict.fromkeys((*site.reserved_gpus, *user.reserved_gpus))),
                      max_workers_per_gpu=low(site.max_workers_per_gpu, user.max_workers_per_gpu),
                      elastic=max(site.elastic, user.elastic, key=ELASTIC.index))


def load_policy(path: Path | None = None, *, environ: Mapping[str, str] | None = None) -> SitePolicy:
    """The policy runs obey: the administrator's (the admin store's site file names it, else
    ``/etc/launcher/policy.toml``), narrowed by ``$LAUNCHER_POLICY`` or ``path`` if given.

    Raises:
        ConfigErrors: unreadable file, bad TOML, unknown keys or wrong values, each naming file, key and value.
    """
    from launcher.gpu.store import find_site

    site = find_site(dict(os.environ if environ is None else environ))
    admin = _load_file(site.policy if site else DEFAULT_POLICY_PATH, named=False)
    named_path, named = (path, True) if path is not None else policy_path(environ)
    if not named:
        return admin
    return narrow(admin, _load_file(named_path, named=True))


def load_site_file(path: Path) -> SitePolicy:
    """The administrator's policy file alone (absent: no policy), as the lease broker reads it: never the
    caller's ``$LAUNCHER_POLICY``. Raises ConfigErrors as :func:`load_policy`."""
    return _load_file(path, named=False)


def _load_file(path: Path, *, named: bool) -> SitePolicy:
    """One policy file; the admin's may be absent (no policy), a named one must exist."""
    if not path.exists():
        if named:
            raise ConfigErrors([f"{path}: policy file not found"],
                               hint=f"fix ${POLICY_ENV}, or unset it to use {DEFAULT_POLICY_PATH} when present")
        return SitePolicy()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigErrors([f"{path}: cannot read the policy file: {exc}"],
                           hint="ask the administrator to fix it") from None
    return parse_policy(data, source=str(path))


def parse_policy(data: Mapping[str, Any], *, source: str | None = None) -> SitePolicy:
    """A :class:`SitePolicy` from parsed TOML (keys with ``-`` or ``_``). Raises ConfigErrors with every problem."""
    where = source or "policy"
    problems: list[str] = []
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        shown = f"{where}: {raw_key} = {value!r}"
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            problems.append(f"{where}: unknown key {raw_key!r}" + (f" (did you mean {close[0]!r}?)" if close
                                                                   else f"; known keys: {', '.join(KEYS)}"))
        elif key in ("max_gpus_per_user", "max_workers_per_gpu"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "max_gpus_per_user" else 1):
                problems.append(f"{shown}: expected a whole number >= {0 if key == 'max_gpus_per_user' else 1}")
            else:
                values[key] = value
        elif key == "elastic":
            if value not in ELASTIC:
                problems.append(f"{shown}: expected one of {', '.join(repr(v) for v in ELASTIC)}")
            else:
                values[key] = value
        elif key == "min_free_memory":
            try:
                values["min_free_memory_bytes"] = parse_size(value, what=raw_key)
            except BadInput:
                problems.append(f"{shown}: expected a memory size such as \"8GiB\"")
        elif key == "reserved_gpus":
            items = value if isinstance(value, list) else None
            bad = [v for v in items or [] if isinstance(v, bool) or not isinstance(v, (int, str))
                   or (isinstance(v, int) and v < 0) or (isinstance(v, str) and not v.strip())]
            if items is None or bad:
                problems.append(f"{shown}: expected a list of GPU indices or UUIDs, e.g. [0, \"GPU-8f3a...\"]")
            else:
                values["reserved_gpus"] = tuple(str(v).strip() for v in items)
    if problems:
        raise ConfigErrors(problems, hint="the site policy is set by the administrator; ask them to fix it")
    return SitePolicy(source=source, **values)


# ------------------------------------------------------------------------------------- pure application
def elastic_minimum(requested: str | None, groups: int, policy: SitePolicy) -> int | None:
    """The fewest groups an elastic run may shrink to, or None when the run is not elastic: ``--elastic``
    (``requested``: a number, ``off``, or None for the policy's default) against the plan's ``groups``.

    Raises:
        PolicyViolation: ``--elastic N`` where the site policy forbids elastic runs.
        BadInput: N above the plan's number of groups.
    """
    if requested == "off":
        return None
    if requested is None:
        return max(1, -(-groups // 2)) if policy.elastic == "default" and groups > 1 else None
    if policy.elastic == "forbid":
        raise PolicyViolation(f"--elastic {requested}: the {policy.label} forbids elastic runs",
                              hint="leave out --elastic (the administrator decides; see docs/gpus.md)")
    if int(requested) > groups:
        raise BadInput(f"--elastic {requested}: the plan has {groups} worker group(s); an elastic run keeps at least "
                       f"MIN_GROUPS of them", hint=f"give --elastic {groups} or less, or more groups (--groups N)")
    return int(requested)


def floor_min_free_memory(requested_bytes: int, policy: SitePolicy) -> tuple[int, list[str]]:
    """Raise the requested free-memory threshold to the policy's floor. Returns (bytes, reasons)."""
    floor = policy.min_free_memory_bytes
    if floor is None or requested_bytes >= floor:
        return requested_bytes, []
    return floor, [f"{policy.label} raises --min-free-memory from {format_size(requested_bytes)} to "
                   f"{format_size(floor)}"]


def is_reserved(gpu: Any, policy: SitePolicy) -> bool:
    wanted = {r.lower() for r in policy.reserved_gpus}
    return str(gpu.index) in wanted or gpu.uuid.lower() in wanted


def filter_gpus(gpus: Sequence[Any], policy: SitePolicy, *, explicit: bool, held_by_user: int = 0,
                user: str | None = None) -> tuple[list[Any], list[str]]:
    """Apply the GPU limits to selected GPUs (least loaded first). Returns (GPUs kept, reasons).

    Args:
        gpus: what selection returned (``--gpus auto``: the free ones; explicit: the ones named, in order).
        explicit: the user named these GPUs; then a GPU the policy forbids is an error, not a silent drop.
        held_by_user: GPUs this user's other runs hold now (their lock files).
        user: for the messages.

    Raises:
        PolicyViolation: explicit GPUs that are reserved, below the memory floor, or more than allowed.
    """
    kept: list[Any] = []
    reasons: list[str] = []
    for g in gpus:
        if is_reserved(g, policy):
            if explicit:
                raise PolicyViolation(f"--gpus names GPU {g.index} ({g.uuid}), which {policy.label} reserves",
                                      hint="choose other GPUs (`launcher gpus`), or --gpus auto")
            reasons.append(f"GPU {g.index} ({g.uuid}) not used: reserved by {policy.label}")
            continue
        floor = policy.min_free_memory_bytes
        if floor is not None and g.memory_free_bytes < floor:
            if explicit:
                raise PolicyViolation(f"--gpus names GPU {g.index}, which has {format_size(g.memory_free_bytes)} "
                                      f"free; {policy.label} requires {format_size(floor)}",
                                      hint="choose a GPU with more free memory (`launcher gpus`)")
            reasons.append(f"GPU {g.index} ({g.uuid}) not used: {format_size(g.memory_free_bytes)} free < "
                           f"{policy.label} min_free_memory {format_size(floor)}")
            continue
        kept.append(g)
    cap = policy.max_gpus_per_user
    if cap is not None:
        allowed = max(0, cap - held_by_user)
        who = f"user {user}" if user else "a user"
        held = f" ({held_by_user} held by your other runs)" if held_by_user else ""
        if len(kept) > allowed:
            if explicit:
                raise PolicyViolation(f"--gpus names {len(kept)} GPU(s) but {policy.label} allows {who} "
                                      f"{cap} at once{held}",
                                      hint=f"name at most {allowed} GPU(s), or wait for your other runs to end")
            dropped = kept[allowed:]
            kept = kept[:allowed]
            reasons.append(f"{policy.label} allows {who} {cap} GPU(s) at once{held}: using {len(kept)}, "
                           f"not GPU(s) {', '.join(str(g.index) for g in dropped)}")
    return kept, reasons


def check_plan(plan: Any, policy: SitePolicy) -> list[str]:
    """Refuse a plan that puts more than ``max_workers_per_gpu`` workers on one GPU. Returns reasons.

    Raises:
        PolicyViolation: naming the GPU, the count and how many workers would fit within the policy.
    """
    limit = policy.max_workers_per_gpu
    if limit is None or plan.kind != "gpu":
        return []
    per_gpu: dict[int, int] = {}
    for g in plan.groups:
        for index in g.share.gpu_indices:
            per_gpu[index] = per_gpu.get(index, 0) + g.workers
    over = {i: n for i, n in per_gpu.items() if n > limit}
    if over:
        worst = max(over, key=lambda i: over[i])
        fits = limit * len(per_gpu)
        raise PolicyViolation(
            f"the plan puts {over[worst]} workers on GPU {worst}; {policy.label} allows {limit} per GPU "
            f"(at most {fits} workers on the {len(per_gpu)} GPU(s) this plan uses)",
            hint=f"use --workers {fits} or fewer, or more GPUs if the policy allows")
    return [f"{policy.label}: at most {limit} workers per GPU (this plan: "
            + ", ".join(f"GPU {i}: {n}" for i, n in sorted(per_gpu.items())) + ")"]


# ------------------------------------------------------------------------------- the hook where plans are made
def plan_obeying(make: Callable[[Any], tuple[Any, Any]], request: Any, policy: SitePolicy
                 ) -> tuple[Any, Any, list[str]]:
    """Plan with ``make(request) -> (plan, reservation or None)`` within ``max_workers_per_gpu``.

    Placement gives the master a GPU of its own when the workers fit on the others (by memory); with a
    per-GPU worker cap that can crowd them, so when the request left that choice open, a refused plan is
    made again with the master sharing a GPU and the workers spread over every GPU. A refused plan's
    reservation is released. Returns (plan, reservation, reasons).

    Raises:
        PolicyViolation: no plan fits the cap.
    """
    plan, reservation = make(request)
    try:
        return plan, reservation, check_plan(plan, policy)
    except PolicyViolation:
        if reservation is not None:
            reservation.release()
        if request.isolate_master is not None:
            raise
    plan, reservation = make(replace(request, isolate_master=False))
    try:
        reasons = check_plan(plan, policy)
    except PolicyViolation:
        if reservation is not None:
            reservation.release()
        raise
    return plan, reservation, [*reasons, f"the master shares a GPU so the workers spread over every GPU "
                                         f"({policy.label}: at most {policy.max_workers_per_gpu} per GPU)"]


def held_by_user(user: str, lock_dir: str | Path | None, *, exclude_run: str | None = None) -> int:
    """GPUs that ``user``'s launcher runs (other than ``exclude_run``) hold now, from the lock files."""
    from launcher.gpu import leaseholders

    return len({h.uuid for h in leaseholders.list_holders(lock_dir)
                if h.user == user and (exclude_run is None or h.run_id != exclude_run)})


def gpu_filter_for(policy: SitePolicy, *, explicit: bool, lock_dir: str | Path | None = None,
                   run_id: str | None = None) -> Any:
    """The ``gpu_filter`` that :func:`launcher.gpu.planner.plan_and_reserve` applies after each selection
    (None when the policy limits nothing about GPUs). Counts the user's held GPUs at each call.

    Args:
        explicit: the user named GPUs (``--gpus 0,2``): a GPU the policy forbids is then an error.
    """
    if policy.max_gpus_per_user is None and not policy.reserved_gpus and policy.min_free_memory_bytes is None:
        return None
    from launcher.gpu import nvml

    def apply(gpus: list[Any]) -> tuple[list[Any], list[str]]:
        user = nvml.current_user()
        held = held_by_user(user, lock_dir, exclude_run=run_id) if policy.max_gpus_per_user is not None else 0
        return filter_gpus(gpus, policy, explicit=explicit, held_by_user=held, user=user)

    return apply
