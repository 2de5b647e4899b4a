"""Developer tools: a real Airflow (api-server, scheduler, dag-processor, triggerer) on this machine.

Nothing here is imported by the provider itself; :mod:`airflow_provider_sky.dev.stack` drives the
``airflow`` CLI as subprocesses and :mod:`airflow_provider_sky.dev.demo` is what ``make demo`` runs.
"""
