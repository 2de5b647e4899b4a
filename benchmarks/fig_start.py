"""Figure 2: gang start. ``GangClient.launch`` → every rank running, vs ``pdsh -R ssh -w <hosts> true``.

"Every rank running" is the last rank's own ``start`` timestamp (its wrapper writes it on the node);
the skew is last minus first ``start``. Cold = fresh connection pool (``runners.ssh.close_all()`` and
a new backend object, so keys are loaded and every host handshaked again: what pdsh does each time);
warm = the same client launching again over its open connections.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Hosts

_ids = itertools.count()


@dataclass
class Launch:
    to_last_start: float  # launch() called -> last rank's start
    skew: float  # last start - first start
    returned: float  # launch() wall time


def pdsh_argv(hosts: Hosts, n: int, command: str = "true") -> tuple[list[str], dict[str, str]]:
    nodes = hosts.nodes[:n]
    ports = {x.port for x in nodes}
    assert len(ports) == 1, "the test hosts share one port"
    c = hosts.cluster
    ssh_args = (
        f"-p {ports.pop()} -F /dev/null -i {c.client_key_path} -o IdentitiesOnly=yes "
        f"-o UserKnownHostsFile={c.known_hosts_path} -o GlobalKnownHostsFile=/dev/null "
        "-o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=10"
    )
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": ssh_args}
    w = ",".join(f"{x.user}@{x.host}" for x in nodes)
    return ["pdsh", "-R", "ssh", "-f", str(max(n, 32)), "-u", "30", "-w", w, command], env


def pdsh_once(hosts: Hosts, n: int) -> float:
    argv, env = pdsh_argv(hosts, n)
    t = time.monotonic()
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t
    if res.returncode != 0:
        raise RuntimeError(f"pdsh failed ({res.returncode}): {res.stderr[-2000:]}")
    return took


def launch_once(client: Any, n: int) -> Launch:
    from airflow_provider_sky.spec import task_from_args

    job_id = f"start{n}-{next(_ids)}-{int(time.time() * 1000) % 10**8}"
    spec = task_from_args(num_nodes=n, run="true")
    t_wall = time.time()
    t = time.monotonic()
    client.launch(spec, job_id)
    returned = time.monotonic() - t
    poll = client.poll(job_id)
    starts = [r.start for r in poll.status.ranks]
    if len(starts) != n or any(s is None for s in starts):
        raise RuntimeError(f"not every rank has a start time: {starts}")
    return Launch(max(starts) - t_wall, max(starts) - min(starts), returned)


def cold_launch(hosts: Hosts, cluster_name: str, n: int) -> Launch:
    from airflow_provider_sky.runners import ssh
    from airflow_provider_sky.watch.jobs import GangClient

    ssh.close_all()
    backend = hosts.backend(n)
    handle = backend.find(cluster_name)  # reads the record on the head (connects the head only)
    ssh.close_all()  # ... so drop that connection too: the launch starts from nothing
    client = GangClient(hosts.backend(n), handle)
    try:
        return launch_once(client, n)
    finally:
        client.close()
        backend.close()


def measure(hosts: Hosts, cluster_name: str, n: int, reps: int, log: Any) -> dict[str, list[float]]:
    """Interleaved cold launch, warm launch and pdsh, ``reps`` times each."""
    from airflow_provider_sky.watch.jobs import GangClient

    out: dict[str, list[float]] = {k: [] for k in ("cold", "cold_skew", "warm", "warm_skew", "pdsh")}
    out |= {"cold_returned": [], "warm_returned": []}
    backend = hosts.backend(n)
    warm_client = GangClient(backend, backend.find(cluster_name))
    try:
        launch_once(warm_client, n)  # opens the connections
        for i in range(reps):
            cold = cold_launch(hosts, cluster_name, n)
            warm_client.close()  # its runners rejoin the pool (close_all retired the old entries)
            launch_once(warm_client, n)  # reconnect, then measure the next one warm
            warm = launch_once(warm_client, n)
            p = pdsh_once(hosts, n)
            for k, v in (("cold", cold), ("warm", warm)):
                out[k].append(v.to_last_start)
                out[f"{k}_skew"].append(v.skew)
                out[f"{k}_returned"].append(v.returned)
            out["pdsh"].append(p)
            log(
                f"  fig2 N={n} #{i + 1}: cold {cold.to_last_start:.3f}s (skew {cold.skew:.3f}s, "
                f"returned {cold.returned:.3f}s), warm {warm.to_last_start:.3f}s (skew {warm.skew:.3f}s), "
                f"pdsh {p:.3f}s"
            )
    finally:
        warm_client.close()
        backend.close()
    return out
