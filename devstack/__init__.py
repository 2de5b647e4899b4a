"""Developer tools: a real Airflow (api-server, scheduler, dag-processor, triggerer) on this machine.

Nothing here is imported by the provider itself; :mod:`devstack.stack` drives the
``airflow`` CLI as subprocesses and :mod:`devstack.demo` is what ``make demo`` runs.
"""
