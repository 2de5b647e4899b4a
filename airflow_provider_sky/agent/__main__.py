"""``python3 -m airflow_provider_sky.agent``: the node agent, where the package is installed."""

from __future__ import annotations

from airflow_provider_sky.agent.node import main

main()
