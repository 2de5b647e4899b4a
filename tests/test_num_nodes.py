"""``num_nodes`` meets each of its bounds through one function (spec/nodes.py), with the messages users
saw before: each names the field (or the cluster) and the fix."""

from __future__ import annotations

import pytest

from airflow_provider_sky.backends.base import BackendError, check_reusable
from airflow_provider_sky.operators._capacity import check_airflow_room
from airflow_provider_sky.spec import SpecError, parse_task, spec_problems
from airflow_provider_sky.spec.capabilities import BackendCapabilities
from airflow_provider_sky.spec.nodes import (
    airflow_map_length,
    airflow_triggers,
    backend_max,
    connection_hosts,
    existing_cluster,
    fitting_hosts,
    job_cluster,
    num_nodes_problem,
)


@pytest.mark.parametrize(
    ("bound", "fits", "misfits", "message"),
    [
        (
            backend_max("local", 64),
            64,
            65,
            "the local backend runs at most 64 node(s), got 65; lower num_nodes or give the backend more nodes",
        ),
        (
            connection_hosts(4),
            4,
            5,
            "the task asks for 5 nodes but the SSH connection has 4 hosts; add hosts or lower num_nodes",
        ),
        (
            fitting_hosts(2, 5, "H100:8", "a:22: fits (x)"),
            2,
            3,
            "the task asks for 3 node(s) with H100:8; 2 of 5 hosts have it, so nothing was started: a:22: fits (x)",
        ),
        (
            existing_cluster("c{1}", 4),
            4,
            2,
            "cluster 'c{1}' exists with 4 nodes but the task asks for 2: tear it down first or use another "
            "cluster name",
        ),
        (
            existing_cluster("c", 4, "instances"),
            4,
            5,
            "cluster 'c' exists with 4 instances but the task asks for 5: tear it down first or use another "
            "cluster name",
        ),
        (
            job_cluster("c", 4),
            4,
            3,
            "the task asks for 3 nodes but cluster c has 4; give the cluster and job tasks the same task spec",
        ),
        (
            airflow_map_length(3),
            3,
            4,
            "4 rank tasks are more than Airflow maps ([core] max_map_length = 3): set "
            "AIRFLOW__CORE__MAX_MAP_LENGTH=4 (or more) for the scheduler and the workers, or ask for fewer nodes",
        ),
        (
            airflow_triggers(4, 1),
            3,
            4,
            "a gang of 4 nodes is watched by 5 triggers (one per rank task and the gang sensor) and the "
            "triggerers hold 4 ([triggerer] capacity = 4 x 1 triggerer(s)): set AIRFLOW__TRIGGERER__CAPACITY "
            "to at least 5 (more if other DAGs defer at the same time), or run more triggerers and pass "
            "triggerers=<how many>",
        ),
    ],
    ids=["backend", "ssh-hosts", "fitting-hosts", "cluster", "instances", "job", "map", "triggers"],
)
def test_each_bound_passes_or_says_field_and_fix(
    bound: object, fits: int, misfits: int, message: str
) -> None:
    from airflow_provider_sky.spec.nodes import NodeBound

    assert isinstance(bound, NodeBound)
    assert num_nodes_problem(fits, bound) is None
    assert num_nodes_problem(misfits, bound) == message


def test_an_existing_cluster_must_match_exactly() -> None:
    assert num_nodes_problem(3, existing_cluster("c", 4)) is not None  # fewer is no more a match than more


def test_the_callers_use_it() -> None:
    caps = BackendCapabilities(name="ssh", max_nodes=2, supported_resources=frozenset(), clouds=frozenset())
    spec = parse_task({"num_nodes": 3, "run": "true"})
    assert ("num_nodes", num_nodes_problem(3, backend_max("ssh", 2))) in spec_problems(spec, caps)
    with pytest.raises(BackendError) as err:
        check_reusable({"nodes": [{}, {}]}, "c", 3)
    assert str(err.value) == num_nodes_problem(3, existing_cluster("c", 2))


def test_airflow_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "3")
    with pytest.raises(SpecError) as err:
        check_airflow_room(4)
    assert (err.value.field, err.value.message) == ("num_nodes", num_nodes_problem(4, airflow_map_length(3)))
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "1024")
    monkeypatch.setenv("AIRFLOW__TRIGGERER__CAPACITY", "4")
    check_airflow_room(3)
    check_airflow_room(7, triggerers=2)
    with pytest.raises(SpecError, match=r"capacity = 4 x 2 triggerer\(s\)"):
        check_airflow_room(8, triggerers=2)
