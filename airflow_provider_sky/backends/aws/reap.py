"""Nothing of ours keeps billing: idle or orphaned clusters found by their tags alone and removed.

Kept apart from ``backend.py`` (a maintenance task's entry point, not the provisioning path).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from airflow_provider_sky.backends.aws import ec2 as api
from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.runners.base import RunnerError

if TYPE_CHECKING:
    from airflow_provider_sky.backends.aws.backend import AWSBackend

log = logging.getLogger(__name__)


def reap(backend: AWSBackend, min_age: float = 900.0) -> list[str]:
    """Terminate the clusters of this owner that nobody uses any more, found by their tags alone.

    A cluster is an orphan when all its instances run, they were launched over ``min_age`` seconds ago
    (a provision in progress has no record yet) and its head answers but holds no record of it: the
    nodes' ``idle_down`` removed it, or its provision died before writing it. A cluster whose head
    does not answer is left alone (it may be a network problem, not an orphan). Returns the names
    terminated. Meant for a periodic maintenance task (see docs/backends/aws.md), so nothing keeps billing.

    Also deleted: the security group and key pair of a cluster with no instance left, made over
    ``min_age`` seconds ago (its nodes powered themselves off at ``idle_down``, or a provision was killed
    before it launched); they cost nothing but would hold the next provision of that name off.
    """
    filters = [
        {"Name": f"tag:{api.TAG_OWNER}", "Values": [backend.owner]},
        {"Name": "instance-state-name", "Values": list(api.LIVE_STATES)},
    ]
    try:
        pages = backend.ec2.get_paginator("describe_instances").paginate(Filters=filters)
        found = [i for p in pages for r in p["Reservations"] for i in r["Instances"]]
    except Exception as exc:
        raise api.client_error("listing this owner's instances", exc) from None
    clusters: dict[str, list[dict[str, Any]]] = {}
    for inst in found:
        name = api.tags_of(inst).get(api.TAG_CLUSTER)
        if name and api.ours(inst, name, backend.owner):
            clusters.setdefault(name, []).append(inst)
    now = time.time()
    reaped = []
    for name, instances in sorted(clusters.items()):
        if any(i["State"]["Name"] != "running" for i in instances):
            continue
        launched = max(i["LaunchTime"].timestamp() for i in instances)
        if now - launched < min_age:
            continue
        try:
            head = backend._node(name, backend._ordered(name, instances)[0], None)
            if backend.records(name, head).read(name) is not None:
                continue
        except (BackendError, RunnerError) as exc:
            log.info("cluster %s: head not reachable, not reaped (%s)", name, exc)
            continue
        log.warning("cluster %s: no record on its head (idle or orphaned): terminating it", name)
        try:  # only if still no record, made sure of under the head's lock (a run may adopt it meanwhile)
            if backend._teardown(name, 2.0, None, idle_only=True).removed:
                reaped.append(name)
        except BackendError as exc:
            log.warning("cluster %s: not reaped: %s", name, exc)
    for name in sorted(_named_leftovers(backend) - set(clusters)):
        api.remove_leftovers(backend.ec2, name, backend.owner, min_age)
    return reaped


def _named_leftovers(backend: AWSBackend) -> set[str]:
    """Cluster names of this owner's security groups and key pairs."""
    owner = [{"Name": f"tag:{api.TAG_OWNER}", "Values": [backend.owner]}]
    try:
        found = [
            *backend.ec2.describe_security_groups(Filters=owner)["SecurityGroups"],
            *backend.ec2.describe_key_pairs(Filters=owner)["KeyPairs"],
        ]
    except Exception as exc:
        raise api.client_error("listing this owner's security groups and key pairs", exc) from None
    names = {api.tags_of(r).get(api.TAG_CLUSTER) for r in found}
    return {n for n in names if n}
