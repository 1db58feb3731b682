"""Swarm placement across nodes, as pure functions over made-up nodes and tasks (issue 16): where the groups
go beside the master, which lost node a part's earlier task ran on, and what a task rejected by Docker
20.10's generic-resource defect says. The same code runs for real in tests/docker/test_multinode.py.
"""

from __future__ import annotations

import pytest

from launcher.backends.base import Part, PartState
from launcher.backends.swarm_run import lost_node
from launcher.backends.swarm_specs import group_placement, master_placement, start_problem
from launcher.engine.swarm import NodeInfo, TaskInfo
from launcher.errors import BadInput


def _node(nid: str, gpus: int = 0, storage: bool = False, ready: bool = True) -> NodeInfo:
    return NodeInfo(nid, f"host-{nid}", "worker", ready, {"launcher.storage": "true"} if storage else {}, 2 * 10**9,
                    gpus)


def test_groups_spread_off_the_masters_node_when_other_nodes_can_hold_them() -> None:
    nodes = [_node("a"), _node("b"), _node("c")]
    local = master_placement("local", nodes, "a")
    assert group_placement("spread", nodes, local) == (("node.id!=a",), "groups spread over host-b, host-c")
    assert group_placement("any", nodes, local)[0] == ()
    assert group_placement("spread", [_node("a"), _node("b", ready=False)], local)[0] == (), \
        "a down node holds nothing: the groups stay with the master"
    assert group_placement("spread", [_node("a", gpus=4), _node("b")], local, [1, 1])[0] == (), \
        "the other nodes lack the GPUs the groups reserve"
    assert group_placement("spread", [_node("a", gpus=1), _node("b", gpus=2)], local, [1, 1])[0] == ("node.id!=a",)
    storage_nodes = [_node("a"), _node("s", storage=True)]
    on_storage = master_placement("auto", storage_nodes, "a")
    assert group_placement("spread", storage_nodes, on_storage)[0] == ("node.labels.launcher.storage!=true",)
    assert group_placement("spread", nodes, master_placement("any", nodes, "a"))[0] == ()
    with pytest.raises(BadInput, match="--swarm-groups 'pack'"):
        group_placement("pack", nodes, local)


def test_a_part_names_the_lost_node_an_earlier_task_ran_on() -> None:
    def task(tid: str, node: str, at: int, state: str = "running") -> TaskInfo:
        return TaskInfo(tid, "svc", node, state, "running", None, "", "c" * 64, (1_000 + at, 0))

    nodes = {"a": NodeInfo("a", "host-a", "worker", True, {}, state="ready"),
             "b": NodeInfo("b", "host-b", "worker", False, {}, state="down", updated_at="2026-11-22T18:01:02")}
    assert lost_node([task("t1", "b", 0), task("t2", "a", 1)], nodes) == "node host-b lost at 2026-11-22T18:01:02Z"
    assert lost_node([task("t2", "a", 1)], nodes) == ""
    part = Part("group-1", PartState.RUNNING, node="host-a", lost="node host-b lost at 2026-11-22T18:01:02Z")
    assert part.to_dict()["node"] == "host-a" and "host-b" in part.to_dict()["lost"]
    assert "node" not in Part("group-1", PartState.RUNNING).to_dict(), "other backends' parts are unchanged"
    n = NodeInfo.from_attrs({"ID": "x", "UpdatedAt": "2026-11-22T18:01:02.123456Z", "Status": {"State": "down"},
                             "Spec": {"Role": "worker"}, "Description": {"Hostname": "gone"}})
    assert (n.state, n.updated_at, n.ready) == ("down", "2026-11-22T18:01:02", False)


def test_a_task_rejected_by_the_generic_resource_defect_says_so() -> None:
    t = TaskInfo("t", "svc", "n", "rejected", "running", None, "assigned node no longer meets constraints", "",
                 (1, 0))
    err = start_problem("launcher-x-master", [t], 1.0, 0.0, "img")
    assert err is not None and "no longer meets constraints" in err.message and "20.10" in (err.hint or "")


def test_a_followed_service_removed_between_two_polls_goes_on_from_the_saved_log() -> None:
    from launcher.backends.swarm_run import _after_last

    saved = b"listening on\ngroup 0 joined\nreceived SIGTERM; stopping\nrun finished\n"
    assert _after_last(saved, b"group 0 joined\n") == b"received SIGTERM; stopping\nrun finished\n"
    assert _after_last(saved, None) == saved, "nothing printed yet: all of it"
    assert _after_last(saved, b"run finished\n") == b"", "all printed already"
    assert _after_last(saved, b"a line the copy does not have\n") == b"", "never print a line twice"
    assert _after_last(b"tick\nx\ntick\ny\n", b"tick\n") == b"y\n", "from the last occurrence"
