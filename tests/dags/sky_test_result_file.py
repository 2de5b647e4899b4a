"""A result file: masked like the log, bounded in size, required once named."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_test_result_file", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "masked",
        cluster_name="sky-result-masked",
        num_nodes=1,
        secrets={"TOKEN": "s3cr3t-value"},
        run='mkdir -p out && printf "token=%s" "$TOKEN" > out/r.txt',
        result_file="out/r.txt",
    )
    sky_gang(
        "big",
        cluster_name="sky-result-big",
        num_nodes=1,
        run="head -c 5000 /dev/zero | tr '\\0' x > r.txt",
        result_file="r.txt",
        result_max_bytes=1000,
    )
    sky_gang(
        "missing", cluster_name="sky-result-missing", num_nodes=1, run="true", result_file="~/nowhere.json"
    )
