"""``num_nodes`` against each bound it has, compared by one function with every message written here.

A gang's node count meets several bounds: what the backend runs at most, the hosts of an SSH
connection, the hosts that have the resources asked, an existing cluster's size (joined by a provision
or used by a job task), and what Airflow maps and its triggerers watch. Each place that knows a bound
builds it with the constructor below and asks :func:`num_nodes_problem`; the messages name the field
and the fix. No Airflow import: backends use this module too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: the field every message here is about
FIELD = "num_nodes"


@dataclass(frozen=True)
class NodeBound:
    """One bound on the node count: ``have`` (at most that many, or exactly, for an existing cluster) and
    the message for a count that does not meet it (given the count asked)."""

    have: int
    exact: bool
    message: Callable[[int], str]


def num_nodes_problem(asked: int, bound: NodeBound) -> str | None:
    """Why ``asked`` nodes do not meet ``bound`` (what is wrong and the fix); None when they do."""
    ok = asked == bound.have if bound.exact else asked <= bound.have
    return None if ok else bound.message(asked)


def backend_max(backend: str, max_nodes: int) -> NodeBound:
    """What a backend runs at most (its capabilities' ``max_nodes``)."""
    return NodeBound(
        max_nodes,
        False,
        lambda n: (
            f"the {backend} backend runs at most {max_nodes} node(s), got {n}; "
            "lower num_nodes or give the backend more nodes"
        ),
    )


def connection_hosts(hosts: int) -> NodeBound:
    """The hosts an SSH connection lists: one node each."""
    return NodeBound(
        hosts,
        False,
        lambda n: (
            f"the task asks for {n} nodes but the SSH connection has {hosts} hosts; add hosts or lower num_nodes"
        ),
    )


def fitting_hosts(fitting: int, hosts: int, asked_resources: str, detail: str) -> NodeBound:
    """The hosts that have the resources asked (``detail``: what each host has or lacks)."""
    return NodeBound(
        fitting,
        False,
        lambda n: (
            f"the task asks for {n} node(s) with {asked_resources}; {fitting} of "
            f"{hosts} hosts have it, so nothing was started: {detail}"
        ),
    )


def existing_cluster(name: str, count: int, unit: str = "nodes") -> NodeBound:
    """An existing cluster a provision would join: same size or nothing (``unit``: how the backend
    counts them, e.g. instances)."""
    return NodeBound(
        count,
        True,
        lambda n: (
            f"cluster {name!r} exists with {count} {unit} but the task asks for "
            f"{n}: tear it down first or use another cluster name"
        ),
    )


def job_cluster(name: str, count: int) -> NodeBound:
    """The cluster a job task runs on (made by a cluster task): one rank per node."""
    return NodeBound(
        count,
        True,
        lambda n: (
            f"the task asks for {n} nodes but cluster {name} has {count}; "
            "give the cluster and job tasks the same task spec"
        ),
    )


def airflow_map_length(max_map: int) -> NodeBound:
    """Airflow's ``[core] max_map_length``: one mapped rank task per node."""
    return NodeBound(
        max_map,
        False,
        lambda n: (
            f"{n} rank tasks are more than Airflow maps ([core] max_map_length = {max_map}): set "
            f"AIRFLOW__CORE__MAX_MAP_LENGTH={n} (or more) for the scheduler and the workers, or "
            "ask for fewer nodes"
        ),
    )


def airflow_triggers(per_triggerer: int, triggerers: int) -> NodeBound:
    """The triggerers' capacity: a gang of N is watched by N + 1 triggers (rank tasks and gang sensor)."""
    capacity = per_triggerer * triggerers
    return NodeBound(
        capacity - 1,
        False,
        lambda n: (
            f"a gang of {n} nodes is watched by {n + 1} triggers (one per rank task and the gang "
            f"sensor) and the triggerers hold {capacity} ([triggerer] capacity = "
            f"{per_triggerer} x {triggerers} "
            f"triggerer(s)): set AIRFLOW__TRIGGERER__CAPACITY to at least {n + 1} (more if other DAGs "
            "defer at the same time), or run more triggerers and pass triggerers=<how many>"
        ),
    )
