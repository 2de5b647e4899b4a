"""Reliability DAG of an out-of-memory kill under the real scheduler: ``sky_test_oom``'s gang
(rank 1 grows until the kernel's OOM killer ends it, rank 0 sleeps) on the ``sky_rel_ssh`` hosts, whose
sshd the test puts in a memory-limited cgroup first."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG
from sky_test_oom import RUN

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_rel_oom", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang("g", sky_conn_id="sky_rel_ssh", num_nodes=2, run=RUN)
