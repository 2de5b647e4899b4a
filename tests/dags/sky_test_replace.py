"""A node lost during attempt 1 is replaced before attempt 2: rank 1 removes its own local
node (its directory) and stays silent; the retry puts a new node in its place, runs setup there, and
attempt 2 succeeds with the new address in every rank's SKYPILOT_NODE_IPS."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

START = pendulum.datetime(2026, 1, 1, tz="UTC")
SETUP = 'echo "set up as rank $SKYPILOT_SETUP_NODE_RANK" > setup_done'
RUN = (
    'if [ "$SKY_ATTEMPT" = 1 ] && [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 1; d=$PWD; cd /; rm -rf "$d"; '
    "sleep 1000; fi; "
    'echo "rank $SKYPILOT_NODE_RANK attempt $SKY_ATTEMPT ips $(printf %s "$SKYPILOT_NODE_IPS" | tr "\\n" " ")'
    '$(cat setup_done)"'
)

with DAG("sky_test_replace", schedule=None, start_date=START, catchup=False) as dag:
    sky_gang("train", num_nodes=3, setup=SETUP, run=RUN, retries=1)
