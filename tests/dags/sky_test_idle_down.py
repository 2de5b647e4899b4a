"""A cluster kept after its run (``down=False``) that goes down by itself once idle (``idle_down``)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_test_idle_down", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "kept",
        num_nodes=2,
        setup="echo setup",
        run="setsid sleep 10000 & echo rank $SKYPILOT_NODE_RANK",
        cluster_name="sky-idle-kept",
        down=False,
        # 10 s: the test must find the cluster kept after dag.test() returns, which comes a few
        # seconds after the ranks end (the gang task, the run's end); 3 s was too short at a load
        # average of 10 (the cluster was already gone)
        idle_down=10,
    )
