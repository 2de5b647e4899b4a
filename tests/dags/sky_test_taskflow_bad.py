"""``@task.sky`` whose function returns no command (a blank string): the run fails before provisioning."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task


@task.sky(num_nodes=2, setup="echo provisioned-and-set-up")
def train(flag: str) -> str:
    return "   " if flag == "none" else "echo never"


with DAG(
    "sky_test_taskflow_bad", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    train("none")

if __name__ == "__main__":
    dag.test()
