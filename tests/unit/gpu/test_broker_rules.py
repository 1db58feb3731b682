"""The lease broker's rules without sockets or root: the wire format's checks (launcher.gpu.broker_wire) and the
lease table's cap, ownership, all-or-count locking and ties (launcher.gpu.broker_leases), with a fake locker."""

from __future__ import annotations

import os

import pytest

from launcher.gpu.broker_leases import LeaseTable, check_tie_uid, lock_lease_file
from launcher.gpu.broker_wire import (SCHEMA, LeaseRequest, ListRequest, Refusal, ReleaseRequest, TieRequest,
                                      encode, parse_reply, parse_request, request_line)

A, B, C = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


def refused(fn, *args, **kw) -> Refusal:  # type: ignore[no-untyped-def]
    with pytest.raises(Refusal) as err:
        fn(*args, **kw)
    return err.value


@pytest.mark.parametrize("line,kind,needle", [
    (b"hello", "bad", "not JSON"),
    (b"[1]", "bad", "expected a JSON object"),
    (b'{"op": "list", "schema": "other/v9"}', "bad", "is not 'launcher.broker/v1'"),
    (b'{"op": "steal"}', "bad", "unknown op 'steal'"),
    (b'{"op": "lease", "run_id": "x", "uuids": "all"}', "bad", "uuids must be a list"),
    (b'{"op": "lease", "run_id": "x", "uuids": []}', "bad", "uuids must be a list"),
    (b'{"op": "lease", "run_id": "x", "uuids": ["../../etc/passwd"]}', "bad", "not a GPU UUID"),
    (b'{"op": "lease", "run_id": "", "uuids": ["GPU-a"]}', "bad", "run_id must be printable"),
    (b'{"op": "lease", "run_id": "a\\nb", "uuids": ["GPU-a"]}', "bad", "run_id must be printable"),
    (b'{"op": "lease", "run_id": "x", "uuids": ["GPU-a"], "count": 2}', "bad", "count must be null"),
    (b'{"op": "lease", "run_id": "x", "uuids": ["GPU-a"], "count": true}', "bad", "count must be null"),
    (b'{"op": "tie", "uuids": ["GPU-a"], "pid": 0}', "bad", "pid must be a positive"),
    (b'{"op": "tie", "uuids": ["GPU-a"], "pid": "1"}', "bad", "pid must be a positive"),
])
def test_bad_requests_are_refused_with_a_reason(line: bytes, kind: str, needle: str) -> None:
    r = refused(parse_request, line)
    assert r.kind == kind and needle in r.error, r.error
    assert r.reply()["ok"] is False and r.reply()["refusal"] == kind


def test_requests_parse_into_typed_data_and_round_trip() -> None:
    assert parse_request(request_line({"op": "lease", "run_id": "r", "uuids": [A, B, A], "count": 1})[:-1]) == \
        LeaseRequest("r", (A, B), 1)
    assert parse_request(b'{"op": "tie", "uuids": ["GPU-aaaa"], "pid": 7}') == TieRequest((A,), 7)
    assert parse_request(b'{"op": "release", "uuids": ["GPU-aaaa"]}') == ReleaseRequest((A,))
    assert parse_request(b'{"op": "list"}') == ListRequest()
    assert request_line({"op": "list"}) == encode({"schema": SCHEMA, "op": "list"}) and encode({}).endswith(b"\n")
    assert parse_reply(b'{"ok": true}') == {"ok": True} and parse_reply(b"[]") is None and parse_reply(b"x") is None


class FakeLocks:
    """Lease files as a set of UUIDs something outside the broker holds; each lock is a real descriptor."""

    def __init__(self, outside: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.outside, self.opened = set(outside), 0

    def __call__(self, uuid: str) -> int | None:
        if uuid in self.outside:
            return None
        self.opened += 1
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)


def close_all(table: LeaseTable) -> None:
    for lease in table:
        table.remove(lease)
        os.close(lease.fd)


def test_the_cap_counts_the_uids_leases_and_refuses_before_locking() -> None:
    table, locks = LeaseTable(), FakeLocks()
    try:
        got = table.grant(1000, "alice", LeaseRequest("r1", (A, B), 1), cap=1, cap_label="site policy", lock=locks)
        assert [x.uuid for x in got] == [A] and table.held_by(1000) == [A]
        r = refused(table.grant, 1000, "alice", LeaseRequest("r2", (B,), None), cap=1, cap_label="site policy",
                    lock=locks)
        assert r.kind == "cap" and "holds 1 GPU lease(s) (GPU-aaaa)" in r.error and "allows 1 at once" in r.error
        assert locks.opened == 1  # refused for the cap without touching a lease file
        # another uid has its own count: one GPU is within the cap, two are not; no cap, no limit
        r = refused(table.grant, 1001, "bob", LeaseRequest("r3", (B, C), None), cap=1, cap_label="p", lock=locks)
        assert r.kind == "cap" and "holds 0 GPU lease(s) and asks for 2 more" in r.error
        got = table.grant(1001, "bob", LeaseRequest("r3", (B, C), None), cap=None, cap_label="p", lock=locks)
        assert [x.uuid for x in got] == [B, C] and table.held_by(1001) == [B, C]
    finally:
        close_all(table)


def test_all_or_count_and_busy_names_the_holder() -> None:
    table, locks = LeaseTable(), FakeLocks({C})
    try:
        table.grant(1000, "alice", LeaseRequest("a", (A,), None), cap=None, cap_label="", lock=locks)
        r = refused(table.grant, 1001, "bob", LeaseRequest("b", (B, A), None), cap=None, cap_label="", lock=locks)
        assert r.kind == "busy" and "GPU-aaaa held by launcher run a (user alice" in r.error
        assert table.get(B) is None  # B was locked, then let go: nothing taken unless all is
        r = refused(table.grant, 1001, "bob", LeaseRequest("b", (C,), None), cap=None, cap_label="", lock=locks)
        assert "held by a process outside the broker" in r.error
        got = table.grant(1001, "bob", LeaseRequest("b", (A, C, B), 1), cap=None, cap_label="", lock=locks)
        assert [x.uuid for x in got] == [B] and got[0].pids == {}
    finally:
        close_all(table)


def test_only_the_leases_user_or_root_may_tie_or_release_it() -> None:
    table = LeaseTable()
    try:
        table.grant(1000, "alice", LeaseRequest("a", (A,), None), cap=None, cap_label="", lock=FakeLocks())
        r = refused(table.owned, 1001, [A], "release")
        assert r.kind == "denied" and "only its user may release it" in r.error
        assert [x.uuid for x in table.owned(0, [A, B], "release")] == [A]
        assert refused(table.tie_targets, 1000, [A, B]).error.startswith("GPU(s) GPU-bbbb are not leased")
        assert refused(check_tie_uid, 1000, 42, 1001).kind == "denied"
        check_tie_uid(1000, 42, 1000)
        check_tie_uid(0, 42, 1001)
        lease = table.get(A)
        assert lease is not None
        lease.pids.update({10: 100, 11: 101})
        assert table.untie(A, 10) == (lease, 100) and lease.pids == {11: 101}
        assert table.untie(A, 10) == (None, None) and table.untie(B, 11) == (None, None)
        note = lease.note_record("host")
        assert (note["pids"], note["pid"], note["broker"], note["user"]) == ([11], 11, True, "alice")
        lease.pids.clear()
    finally:
        close_all(table)


def test_lock_lease_file_refuses_a_missing_or_foreign_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = refused(lock_lease_file, tmp_path / "GPU-x.lock", "GPU-x")
    assert r.kind == "bad" and "has no lease file" in r.error
    path = tmp_path / "GPU-y.lock"
    path.write_text("")
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
    r = refused(lock_lease_file, path, "GPU-y")
    assert r.kind == "internal" and "not a regular file of root's" in r.error
