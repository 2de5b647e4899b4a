"""Airflow settings a gang of N ranks needs, checked before a node is provisioned.

A gang of N nodes maps N rank tasks and watches them with N + 1 triggers (the rank tasks and the
gang sensor). Past ``[core] max_map_length`` Airflow fails the mapping only after the cluster is up
and the job started; past the triggerers' capacity the rank tasks that found no slot stay deferred
without a watcher until others end. Both are cheap to know up front.
"""

from __future__ import annotations

from airflow.configuration import conf

from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.spec.nodes import FIELD, airflow_map_length, airflow_triggers, num_nodes_problem


def check_airflow_room(num_nodes: int, triggerers: int = 1) -> None:
    """Raise :class:`SpecError` naming the setting when Airflow cannot run ``num_nodes`` rank tasks.

    ``triggerers``: how many triggerers share the watch (``[triggerer] capacity`` is per triggerer).
    Pools, ``[core] parallelism`` and ``max_active_tasks`` do not grow with N: rank tasks started in
    the triggerer never take a worker slot.
    """
    bounds = (
        airflow_map_length(conf.getint("core", "max_map_length", fallback=1024)),
        airflow_triggers(conf.getint("triggerer", "capacity", fallback=1000), max(1, int(triggerers))),
    )
    for bound in bounds:
        if (problem := num_nodes_problem(num_nodes, bound)) is not None:
            raise SpecError(FIELD, problem)
