"""Gang policy without I/O: rank order, the env contract, classification and the root cause."""

from __future__ import annotations

import json

import pytest

from airflow_provider_sky.model.gang import (
    BAD,
    FAILED,
    GangStatus,
    RankState,
    RankStatus,
    classify,
    gpus_per_node,
    job_id_for,
    rank_order,
    run_env,
    setup_env,
)
from airflow_provider_sky.node.runtime import JOB_ID_RE, RawRankStatus


def test_head_first_then_workers_sorted_numerically() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "10.0.0.2", "10.0.0.100"]
    assert rank_order(ips, head="10.0.0.10") == ["10.0.0.10", "10.0.0.2", "10.0.0.9", "10.0.0.100"]


def test_rank_order_is_stable_whatever_the_input_order() -> None:
    a = rank_order(["10.0.0.5", "10.0.0.3", "10.0.0.4"], head="10.0.0.5")
    b = rank_order(["10.0.0.4", "10.0.0.5", "10.0.0.3"], head="10.0.0.5")
    assert a == b == ["10.0.0.5", "10.0.0.3", "10.0.0.4"]


def test_hosts_sharing_an_ip_are_ordered_by_port() -> None:
    nodes = [("127.0.0.10", 2201), ("127.0.0.9", 2203), ("127.0.0.9", 2202), ("127.0.0.2", 2299)]
    assert rank_order(nodes, head=("127.0.0.10", 2201)) == [
        ("127.0.0.10", 2201),
        ("127.0.0.2", 2299),
        ("127.0.0.9", 2202),
        ("127.0.0.9", 2203),
    ]


def test_unknown_head_is_an_error() -> None:
    with pytest.raises(ValueError, match="head"):
        rank_order(["10.0.0.1"], head="10.0.0.2")


def _run_env(rank: int, **kw: object) -> dict[str, str]:
    args: dict = {
        "rank": rank,
        "ips": ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        "task_id": "job-1",
        "cluster_info": '{"cluster_name": "c"}',
        "gpus_per_node": 1,
        "user_envs": {},
    }
    args.update(kw)
    return run_env(**args)


def test_run_env_contract() -> None:
    env = _run_env(1)
    assert env["SKYPILOT_NODE_RANK"] == "1"
    assert env["SKYPILOT_NODE_IPS"] == "127.0.0.2\n127.0.0.3\n127.0.0.4"
    assert env["SKYPILOT_NUM_NODES"] == "3"
    assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "1"
    assert env["SKYPILOT_TASK_ID"] == "job-1"
    assert env["MASTER_ADDR"] == "127.0.0.2"
    assert env["MASTER_PORT"] == "29500"
    assert env["WORLD_SIZE"] == env["NNODES"] == "3"
    assert env["NODE_RANK"] == env["RANK"] == "1"
    # NODE_RANK and NODE_IPS come from the same list
    assert env["SKYPILOT_NODE_IPS"].split("\n")[int(env["SKYPILOT_NODE_RANK"])] == "127.0.0.3"


def test_user_master_port_is_kept() -> None:
    assert _run_env(0, user_envs={"MASTER_PORT": "1234", "FOO": "bar"})["MASTER_PORT"] == "1234"


def test_setup_env_uses_setup_names() -> None:
    env = setup_env(rank=2, ips=["a", "b", "c"], task_id="t", cluster_info="{}", user_envs={"X": "1"})
    assert env["SKYPILOT_SETUP_NODE_RANK"] == "2"
    assert env["SKYPILOT_SETUP_NODE_IPS"] == "a\nb\nc"
    assert env["SKYPILOT_NUM_NODES"] == "3"
    assert "SKYPILOT_NODE_RANK" not in env and env["X"] == "1"


def test_gpu_contract_in_run_and_setup() -> None:
    """SkyPilot's names: SKYPILOT_NUM_GPUS_PER_NODE (run), SKYPILOT_SETUP_NUM_GPUS_PER_NODE (setup), and
    CUDA_VISIBLE_DEVICES only where the backend hands the node its devices."""
    env = _run_env(1, gpus_per_node=4, devices=[4, 5, 6, 7])
    assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "4" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert "CUDA_VISIBLE_DEVICES" not in _run_env(
        1, gpus_per_node=4
    )  # e.g. Kubernetes' device plugin sets it
    assert "SKYPILOT_SETUP_NUM_GPUS_PER_NODE" not in env
    setup = setup_env(
        rank=0, ips=["a", "b"], task_id="t", cluster_info="{}", user_envs={}, gpus_per_node=2, devices=[0, 1]
    )
    assert setup["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] == "2" and setup["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "SKYPILOT_NUM_GPUS_PER_NODE" not in setup
    plain = setup_env(rank=0, ips=["a"], task_id="t", cluster_info="{}", user_envs={})
    assert plain["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] == "0" and "CUDA_VISIBLE_DEVICES" not in plain


def test_fractional_gpu_rounds_up() -> None:
    assert gpus_per_node(0.5) == 1
    assert gpus_per_node(8) == 8
    assert gpus_per_node(None) == 0


def _raw(rank: int, state: str, code: int | None = None, end: float | None = None, cancel: bool = False):
    return RawRankStatus("j", rank, state, code, 1.0, end, 0, cancel, 0, b"")


def test_classify_cancelled_is_never_a_bare_137() -> None:
    st = classify(_raw(0, "exited", 143, 5.0, cancel=True), "ip", 9.0)
    assert st.state == "cancelled"
    st = classify(_raw(0, "exited", 137, 5.0, cancel=True), "ip", 9.0)
    assert st.state == "cancelled"
    st = classify(_raw(0, "exited", 137, 5.0), "ip", 9.0)
    assert st.state == "failed" and "SIGKILL" in st.reason


def test_classify_lost_and_segfault() -> None:
    assert classify(_raw(0, "lost"), "10.1.1.1", 9.0).state == "lost"
    assert "10.1.1.1" in classify(_raw(0, "missing"), "10.1.1.1", 9.0).reason
    seg = classify(_raw(1, "exited", 139, 3.0), "ip", 9.0)
    assert seg.state == "failed" and seg.reason == "segmentation fault (SIGSEGV)"


def test_root_cause_is_first_failure_by_time() -> None:
    g = GangStatus(
        "job",
        [
            RankStatus(0, "a", "failed", 1, 0.0, 12.0, "exited with code 1"),
            RankStatus(1, "b", "failed", 139, 0.0, 10.5, "segmentation fault (SIGSEGV)"),
            RankStatus(2, "c", "cancelled", 143, 0.0, 12.1, "cancelled"),
        ],
    )
    cause = g.root_cause()
    assert cause is not None and cause.rank == 1
    msg = g.failure_message()
    assert msg.startswith("Job job failed: rank 1 (b) exited with code 139: segmentation fault (SIGSEGV)")
    assert "rank 2 cancelled" in msg and "rank 0 failed" in msg
    assert GangStatus.from_dict(json.loads(json.dumps(g.to_dict()))).root_cause() == cause


def test_rank_state_is_its_plain_string_on_the_wire() -> None:
    # a plain value (JSON, an older caller) is read as the member
    st = RankStatus(0, "a", "failed", 1, 0.0, 2.0, "exited with code 1")
    assert st.state is RankState.FAILED is FAILED and st.state == "failed" and st.state in BAD
    assert str(st.state) == f"{st.state}" == "failed" and {st.state} == {"failed"}
    wire = st.to_dict()
    assert type(wire["state"]) is str  # what trigger events and XComs carry: no enum
    text = json.dumps(GangStatus("job", [st]).to_dict())
    assert '"state": "failed"' in text
    back = GangStatus.from_dict(json.loads(text))
    assert back.ranks[0].state is RankState.FAILED and back.ranks[0] == st
    with pytest.raises(ValueError):
        RankStatus(0, "a", "exploded")


def test_job_ids_unique_and_path_safe() -> None:
    ids = {
        job_id_for("d", "run1", "t", -1, 1),
        job_id_for("d", "run2", "t", -1, 1),
        job_id_for("d", "run1", "t", 0, 1),
        job_id_for("d", "run1", "t", -1, 2),
        job_id_for("d", "run1", "u", -1, 1),
    }
    assert len(ids) == 5
    weird = job_id_for("dag with spaces/../x", "manual__2026-01-01T00:00:00+00:00", "g.t;rm -rf", 3, 1)
    assert JOB_ID_RE.fullmatch(weird) and "/" not in weird and ".." not in weird and " " not in weird
