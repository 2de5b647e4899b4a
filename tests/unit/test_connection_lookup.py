"""Connections as a user keeps them: only a missing ``sky_default`` means "the local backend",
and a connection kept in the metadata DB is found under ``airflow dags test`` by the triggers too.

A lookup that fails for another reason (here a secrets backend that denies access, as a Vault policy does)
used to be swallowed too, and the job silently ran on this machine instead of the user's cluster. Real
Airflow secrets-backend loading, in a fresh process so the backend is configured before Airflow reads it.
"""

from __future__ import annotations

from aws_fixtures import hosts, moto, net  # noqa: F401 (fixtures)

PROBE = """
from airflow_provider_sky.hooks.sky import SkyHook
try:
    print("CONFIG", SkyHook("sky_default").backend_config())
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""


# -- a connection kept in the metadata DB under ``dag.test()`` / ``airflow dags test`` -----------
#
# ``dag.test()`` runs each trigger inline through Airflow's in-process supervisor, whose comms answer only
# synchronous requests (no ``asend``): the Task SDK's async connection lookup through the Execution API then
# failed quietly and said "isn't defined", though the tasks (synchronous lookups) found the connection.
# ``AIRFLOW_CONN_*`` variables hid it (the environment backend is read before the Execution API).


def test_every_connection_type_is_a_uri_scheme_and_its_old_name_still_works() -> None:
    from airflow_provider_sky import get_provider_info
    from airflow_provider_sky.backends.registry import all_backends, by_conn_type

    listed = {e["connection-type"] for e in get_provider_info()["connection-types"]}
    for info in all_backends():
        assert "_" not in info.conn_type and info.conn_type.isalnum(), info.conn_type
        old = f"sky_{info.kind}"
        assert by_conn_type(old, "c") is info and by_conn_type(info.conn_type, "c") is info
        assert {info.conn_type, old} <= listed  # old connections keep their form and Test button
