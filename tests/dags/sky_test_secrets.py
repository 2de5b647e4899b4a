"""A gang whose setup and run print a secret: every log must show *** instead."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

SECRET = "tok-9f3a71c2e5"

with DAG(
    "sky_test_secrets", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "g",
        num_nodes=2,
        secrets={"DB_CRED": SECRET},
        setup='echo "setup sees $DB_CRED"',
        # the rank checks it got the value without the DAG repeating it outside `secrets`
        run='echo "token is $DB_CRED"; test "$(printf %s "$DB_CRED" | wc -c)" -eq ' + str(len(SECRET)),
    )

if __name__ == "__main__":
    dag.test()
