"""The Airflow side of a cluster: a connection names the backend; the hook owns connections and clients.

Which connection types exist, their fields and their backends come from the registry
(``backends/registry.py``); one hook class per connection type is made here from it, as Airflow maps
each connection type to a hook class.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_sky.backends import Backend, ClusterHandle, Teardown
from airflow_provider_sky.backends.base import Choice, choose_resources, with_resources_recorded
from airflow_provider_sky.backends.registry import (
    BackendInfo,
    all_backends,
    by_conn_type,
    by_kind,
    conn_types,
)
from airflow_provider_sky.backends.storage import needs_storage
from airflow_provider_sky.spec import TaskSpec
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.setup_stage import SetupFailed

__all__ = ["SetupFailed", "SkyHook"]

log = logging.getLogger(__name__)


def _unreadable(conn_id: str, exc: BaseException) -> RuntimeError:
    """A lookup that failed for another reason than "not found" (a secrets backend denying or timing
    out): never a silent fall back to the local backend, which would run the job on this machine."""
    return RuntimeError(
        f"sky_conn_id: the connection {conn_id!r} could not be read ({type(exc).__name__}: {exc}); "
        "fix the secrets backend or the connection, nothing was started"
    )


def _comms_answer_only_synchronously() -> bool:
    """Whether this trigger runs under ``dag.test()`` / ``airflow dags test``.

    There a trigger runs inline, through Airflow's in-process supervisor, whose comms have ``send`` but
    no ``asend`` (Airflow 3.3). The Task SDK's async lookup asks the Execution API with ``asend``, fails
    on the missing method, takes that for "not there" and answers ``isn't defined`` for every connection
    kept in the metadata DB (``AIRFLOW_CONN_*`` variables are read before, so they worked). The
    synchronous lookup the tasks use reads the same connection through the same supervisor.
    """
    from airflow.sdk.execution_time import task_runner

    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
    return comms is not None and not hasattr(comms, "asend")


def _unprefixed(key: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def connection_config(info: BackendInfo, conn: Any, conn_id: str) -> dict[str, Any]:
    """A connection's extras and the standard fields its backend reads, as one plain dict.

    Extras are checked against the backend's declared ones ("did you mean"); extras written by older
    forms as ``extra__<type>__<name>`` are read as ``<name>``; empty values count as not given.
    """
    prefixes = tuple(f"extra__{t}__" for t in info.all_conn_types)
    extras = {_unprefixed(k, prefixes): v for k, v in dict(conn.extra_dejson).items() if v not in (None, "")}
    info.check_extras(extras, conn_id)
    fields = {f: getattr(conn, f, None) for f in info.standard_fields}
    return {**extras, **{k: v for k, v in fields.items() if v not in (None, "")}}


class SkyHook(BaseHook):
    """Build the backend a connection describes; without a ``sky_default`` connection, the local backend.

    :param sky_conn_id: a connection of one of the ``sky_*`` types. The default id falls back to the
        embedded local backend when no such connection exists, so a DAG runs with nothing configured.
    """

    conn_name_attr = "sky_conn_id"
    default_conn_name = "sky_default"
    conn_type = "skylocal"
    hook_name = "Sky local cluster"

    def __init__(self, sky_conn_id: str | None = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sky_conn_id = sky_conn_id
        self._backend: Backend | None = None

    def _parse(self, conn: Any) -> tuple[BackendInfo, dict[str, Any]]:
        conn_id = self.sky_conn_id or ""
        info = by_conn_type(conn.conn_type or "", conn_id)
        return info, connection_config(info, conn, conn_id)

    def _missing(self, exc: AirflowNotFoundException) -> tuple[str, dict[str, Any]]:
        if self.sky_conn_id == SkyHook.default_conn_name:
            return "local", {}  # only a connection that does not exist means the local default
        raise exc

    def backend_config(self) -> tuple[str, dict[str, Any]]:
        """(backend kind, config) from the connection; the local default when there is none."""
        if not self.sky_conn_id:
            return "local", {}
        try:
            conn = self.get_connection(self.sky_conn_id)
        except AirflowNotFoundException as exc:
            return self._missing(exc)
        except Exception as exc:
            raise _unreadable(self.sky_conn_id, exc) from exc
        info, config = self._parse(conn)
        linked = info.linked_conn_id(config)
        if linked:
            try:
                config = info.merge_linked(config, self.get_connection(linked))
            except AirflowNotFoundException:
                if not info.linked_by_default(config):
                    raise
        return info.kind, config

    async def abackend_config(self) -> tuple[str, dict[str, Any]]:
        """Same as :meth:`backend_config`, for triggers (never blocks the event loop)."""
        if not self.sky_conn_id:
            return "local", {}
        try:
            conn = await self._aconnection(self.sky_conn_id)
        except AirflowNotFoundException as exc:
            return self._missing(exc)
        except Exception as exc:
            raise _unreadable(self.sky_conn_id, exc) from exc
        info, config = self._parse(conn)
        linked = info.linked_conn_id(config)
        if linked:
            try:
                config = info.merge_linked(config, await self._aconnection(linked))
            except AirflowNotFoundException:
                if not info.linked_by_default(config):
                    raise
        return info.kind, config

    async def _aconnection(self, conn_id: str) -> Any:
        """The connection, without blocking a triggerer's event loop; under ``dag.test()`` through the
        synchronous lookup (see :func:`_comms_answer_only_synchronously`). There the trigger runs alone
        in its own loop, and the in-process lookup is a local DB read: nothing else waits on it."""
        if _comms_answer_only_synchronously():
            return self.get_connection(conn_id)
        return await self.aget_connection(conn_id)

    def test_connection(self) -> tuple[bool, str]:
        """The connection form's Test button: reach every node (or the API), check host keys and
        credentials, run nothing."""
        try:
            backend = self.get_backend()
            try:
                return True, backend.test_connection()
            finally:
                backend.close()
                self._backend = None
        except Exception as exc:
            return False, str(exc)

    def get_backend(self) -> Backend:
        if self._backend is None:
            kind, config = self.backend_config()
            self._backend = by_kind(kind).make(config)
        return self._backend

    async def aget_backend(self) -> Backend:
        if self._backend is None:
            kind, config = await self.abackend_config()
            self._backend = by_kind(kind).make(config)
        return self._backend

    def client(self, handle: ClusterHandle | dict[str, Any]) -> GangClient:
        if not isinstance(handle, ClusterHandle):
            handle = ClusterHandle.from_dict(handle)
        return GangClient(self.get_backend(), handle)

    async def aclient(self, handle: ClusterHandle | dict[str, Any]) -> GangClient:
        if not isinstance(handle, ClusterHandle):
            handle = ClusterHandle.from_dict(handle)
        return GangClient(await self.aget_backend(), handle)

    # -- cluster lifecycle ----------------------------------------------------------------------

    def check(self, spec: TaskSpec, name: str | None = None) -> Choice:
        """Everything the backend cannot honour or satisfy fails here, before anything is provisioned,
        in one error; else which of the task's resources alternatives it will get (the first it can:
        for SSH, the first the hosts have; locally, the first this machine's free GPUs allow).
        ``name``: the cluster, whose own nodes count when it exists."""
        return choose_resources(self.get_backend(), spec, name, conn_types())

    def provision(
        self, name: str, spec: TaskSpec, holder: str | None = None, choice: Choice | None = None
    ) -> ClusterHandle:
        """Create or reuse the cluster with the chosen resources (``choice``, else :meth:`check`'s);
        ``holder`` (``<dag_id>/<run_id>``) takes a lease on it, so another run's teardown keeps it while
        this run uses it. The handle records the resources chosen (the job task's env reads them)."""
        if choice is None:
            choice = self.check(spec, name)
        backend = self.get_backend()
        handle = backend.provision(name, spec.with_resources(choice.resources), holder=holder)
        return with_resources_recorded(handle, choice.resources)

    #: the ``aws`` connection whose credentials reach S3 buckets in ``file_mounts`` (the Amazon
    #: provider's default id; when it does not exist, boto3's own credential chain)
    storage_aws_conn_id = "aws_default"

    def storage_access(self) -> Any:
        """S3 access for bucket ``file_mounts``, from :attr:`storage_aws_conn_id`."""
        from airflow_provider_sky.hooks.aws import s3_access

        try:
            conn = self.get_connection(self.storage_aws_conn_id)
        except AirflowNotFoundException:
            conn = None
        return s3_access(conn)

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:
        """``workdir`` and ``file_mounts`` to every node, before setup (S3 buckets through
        :meth:`storage_access`)."""
        storage = self.storage_access() if needs_storage(spec.file_mounts, spec.storage) else None
        self.get_backend().sync_files(handle, spec, storage)

    def teardown(
        self, name: str, grace: float = 3.0, *, holder: str | None = None, force: bool = False
    ) -> Teardown:
        """Release ``holder``'s lease and remove the cluster when no other run holds one.

        Without a holder the cluster is removed only if no run holds it (this also finishes a teardown
        that left nodes unclean); ``force=True`` removes it whoever holds it.
        """
        return self.get_backend().terminate(name, grace=grace, holder=None if force else holder or "")


def _hook_for(info: BackendInfo, conn_type: str) -> type[SkyHook]:
    """The hook class Airflow maps ``conn_type`` (one of ``info.all_conn_types``) to (its ``conn_type``
    must match)."""
    return type(
        info.hook_class_for(conn_type),
        (SkyHook,),
        {
            "__module__": __name__,
            "__doc__": f"A {info.hook_name}: a ``{conn_type}`` connection (see the README).",
            "conn_type": conn_type,
            "hook_name": info.hook_name_for(conn_type),
            "default_conn_name": info.default_conn_id,
        },
    )


for _info in all_backends():
    for _type in _info.all_conn_types:
        if _info.hook_class_for(_type) != SkyHook.__name__:
            globals()[_info.hook_class_for(_type)] = _hook_for(_info, _type)
            __all__.append(_info.hook_class_for(_type))
