"""Airflow settings a gang of N ranks needs, checked before a node is provisioned.

A gang of N nodes maps N rank tasks and watches them with N + 1 triggers (the rank tasks and the
gang sensor). Past ``[core] max_map_length`` Airflow fails the mapping only after the cluster is up
and the job started; past the triggerers' capacity the rank tasks that found no slot stay deferred
without a watcher until others end. Both are cheap to know up front.
"""

from __future__ import annotations

from airflow.configuration import conf

from airflow_provider_sky.spec import SpecError


def check_airflow_room(num_nodes: int, triggerers: int = 1) -> None:
    """Raise :class:`SpecError` naming the setting when Airflow cannot run ``num_nodes`` rank tasks.

    ``triggerers``: how many triggerers share the watch (``[triggerer] capacity`` is per triggerer).
    Pools, ``[core] parallelism`` and ``max_active_tasks`` do not grow with N: rank tasks started in
    the triggerer never take a worker slot.
    """
    max_map = conf.getint("core", "max_map_length", fallback=1024)
    if num_nodes > max_map:
        raise SpecError(
            "num_nodes",
            f"{num_nodes} rank tasks are more than Airflow maps ([core] max_map_length = {max_map}): set "
            f"AIRFLOW__CORE__MAX_MAP_LENGTH={num_nodes} (or more) for the scheduler and the workers, or "
            "ask for fewer nodes",
        )
    capacity = conf.getint("triggerer", "capacity", fallback=1000) * max(1, int(triggerers))
    needed = num_nodes + 1
    if needed > capacity:
        raise SpecError(
            "num_nodes",
            f"a gang of {num_nodes} nodes is watched by {needed} triggers (one per rank task and the gang "
            f"sensor) and the triggerers hold {capacity} ([triggerer] capacity = "
            f"{conf.getint('triggerer', 'capacity', fallback=1000)} x {max(1, int(triggerers))} "
            f"triggerer(s)): set AIRFLOW__TRIGGERER__CAPACITY to at least {needed} (more if other DAGs "
            "defer at the same time), or run more triggerers and pass triggerers=<how many>",
        )
