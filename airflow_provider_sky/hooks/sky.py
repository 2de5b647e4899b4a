"""The Airflow side of a cluster: a connection names the backend; the hook owns every remote call."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_sky.backends import Backend, ClusterHandle, Teardown, make_backend
from airflow_provider_sky.gang import BAD, CANCELLED, GangStatus
from airflow_provider_sky.jobs import DEFAULT_ORPHAN_TIMEOUT, GangClient, MonitorState, run_sync, watch
from airflow_provider_sky.logtext import TAIL_LINES, LineSplitter, tail_text
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.spec import TaskSpec, check_backend

log = logging.getLogger(__name__)

#: connection type → backend kind
CONN_TYPES = {"sky_local": "local", "sky_ssh": "ssh"}


def merge_ssh_connection(config: dict[str, Any], ssh_conn: Any) -> dict[str, Any]:
    """Fill what a ``sky_ssh`` connection leaves empty from a standard ``ssh`` connection (not asked twice).

    The ``ssh`` connection's host (comma-separated hosts allowed), login, port, password or
    ``private_key``/``key_file`` extras and pinned ``host_key`` are used; the ``sky_ssh`` fields win.
    """
    extra = dict(ssh_conn.extra_dejson)
    merged: dict[str, Any] = {}
    for key, value in {
        "host": ssh_conn.host,
        "login": ssh_conn.login,
        "port": ssh_conn.port,
        "private_key": extra.get("private_key"),
        "key_file": extra.get("key_file"),
        "private_key_passphrase": extra.get("private_key_passphrase"),
        "pinned_host_keys": extra.get("host_key"),
    }.items():
        if value not in (None, ""):
            merged[key] = value
    if str(extra.get("no_host_key_check", "")).lower() == "true":
        merged["host_key_policy"] = "skip"
    merged.update({k: v for k, v in config.items() if v not in (None, "")})
    return merged


class SetupFailed(Exception):
    """Setup failed on at least one node; the others' setups were stopped."""


def _unreadable(conn_id: str, exc: BaseException) -> RuntimeError:
    """A lookup that failed for another reason than "not found" (a secrets backend denying or timing
    out): never a silent fall back to the local backend, which would run the job on this machine."""
    return RuntimeError(
        f"sky_conn_id: the connection {conn_id!r} could not be read ({type(exc).__name__}: {exc}); "
        "fix the secrets backend or the connection, nothing was started"
    )


class SkyHook(BaseHook):
    """Build the backend a connection describes; without a ``sky_default`` connection, the local backend.

    :param sky_conn_id: a ``sky_local`` or ``sky_ssh`` connection. The default id falls back to the
        embedded local backend when no such connection exists, so a DAG runs with nothing configured.
    """

    conn_name_attr = "sky_conn_id"
    default_conn_name = "sky_default"
    conn_type = "sky_local"
    hook_name = "Sky local cluster"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["host", "schema", "login", "password", "port"],
            "relabeling": {},
            "placeholders": {"extra": '{"state_dir": "/path/for/local/nodes (optional)"}'},
        }

    def __init__(self, sky_conn_id: str | None = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sky_conn_id = sky_conn_id
        self._backend: Backend | None = None

    def _config_from(self, conn: Any) -> tuple[str, dict[str, Any]]:
        kind = CONN_TYPES.get(conn.conn_type or "")
        if kind is None:
            raise ValueError(
                f"connection {self.sky_conn_id!r} has type {conn.conn_type!r}; "
                f"use one of {', '.join(sorted(CONN_TYPES))}"
            )
        config: dict[str, Any] = dict(conn.extra_dejson)
        fields = {"host": conn.host, "login": conn.login, "port": conn.port, "password": conn.password}
        config.update({k: v for k, v in fields.items() if v not in (None, "")})
        return kind, config

    def backend_config(self) -> tuple[str, dict[str, Any]]:
        """(backend kind, config) from the connection; the local default when there is none."""
        if not self.sky_conn_id:
            return "local", {}
        try:
            conn = self.get_connection(self.sky_conn_id)
        except AirflowNotFoundException:
            if self.sky_conn_id == self.default_conn_name:
                return "local", {}  # only a connection that does not exist means the local default
            raise
        except Exception as exc:
            raise _unreadable(self.sky_conn_id, exc) from exc
        kind, config = self._config_from(conn)
        if config.get("ssh_conn_id"):
            config = merge_ssh_connection(config, self.get_connection(config["ssh_conn_id"]))
        return kind, config

    async def abackend_config(self) -> tuple[str, dict[str, Any]]:
        """Same as :meth:`backend_config`, for triggers (never blocks the event loop)."""
        if not self.sky_conn_id:
            return "local", {}
        try:
            conn = await self.aget_connection(self.sky_conn_id)
        except AirflowNotFoundException:
            if self.sky_conn_id == self.default_conn_name:
                return "local", {}  # only a connection that does not exist means the local default
            raise
        except Exception as exc:
            raise _unreadable(self.sky_conn_id, exc) from exc
        kind, config = self._config_from(conn)
        if config.get("ssh_conn_id"):
            config = merge_ssh_connection(config, await self.aget_connection(config["ssh_conn_id"]))
        return kind, config

    def get_backend(self) -> Backend:
        if self._backend is None:
            self._backend = make_backend(*self.backend_config())
        return self._backend

    async def aget_backend(self) -> Backend:
        if self._backend is None:
            self._backend = make_backend(*(await self.abackend_config()))
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

    def check(self, spec: TaskSpec) -> None:
        """Everything the backend cannot honour fails here, before anything is provisioned."""
        check_backend(spec, self.get_backend().capabilities)

    def provision(self, name: str, spec: TaskSpec, holder: str | None = None) -> ClusterHandle:
        """Create or reuse the cluster; ``holder`` (``<dag_id>/<run_id>``) takes a lease on it, so another
        run's teardown keeps it while this run uses it."""
        self.check(spec)
        backend = self.get_backend()
        return backend.provision(name, spec, holder=holder)

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:
        """``workdir`` and ``file_mounts`` to every node, before setup."""
        self.get_backend().sync_files(handle, spec)

    def run_setup(
        self,
        handle: ClusterHandle,
        spec: TaskSpec,
        job_id: str,
        *,
        on_log: Callable[[int, str], None],
        poll_interval: float = 0.5,
        grace: float = 3.0,
        orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT,
        idle_down: float = 0,
    ) -> None:
        """Setup on every node at once; the first failure stops the rest and raises :class:`SetupFailed`.

        ``orphan_timeout``: the nodes kill the setup when nothing polled it for that long (0: never).
        ``idle_down``: the nodes tear the cluster down once nothing ran on it for that long (0: never).

        Every node's setup log is read to its end (in bounded chunks) before this returns or raises,
        so no line is lost and a failure quotes the real last lines of the failed nodes' logs.
        """
        if not spec.setup:
            return
        client = self.client(handle)
        splitters: dict[int, LineSplitter] = {}
        tails: dict[int, deque[str]] = {}

        def show(rank: int, data: bytes | None) -> None:
            """Log ``data``'s complete lines (a line split across reads is joined); None: the log ended."""
            lines = splitters.setdefault(rank, LineSplitter(mask=spec.redacted))
            tail = tails.setdefault(rank, deque(maxlen=TAIL_LINES))
            for line in lines.flush() if data is None else lines.feed(data):
                on_log(rank, line)
                tail.append(line)

        async def go() -> GangStatus:
            await client.alaunch(
                spec, job_id, stage="setup", orphan_timeout=orphan_timeout, idle_down=idle_down
            )
            state = MonitorState()
            last = None
            async for poll in watch(client, job_id, poll_interval=poll_interval, grace=grace, state=state):
                for rank, (_, data) in sorted(poll.chunks.items()):
                    show(rank, data)
                last = poll
            assert last is not None
            # a poll reads at most one chunk per node: what the nodes printed since is still unread
            for st in last.status.ranks:
                try:
                    async for data in client.aread_range(
                        job_id, st.rank, state.offsets.get(st.rank, 0), st.log_size
                    ):
                        show(st.rank, data)
                except RunnerError as exc:
                    on_log(st.rank, f"(the rest of this setup log could not be read: {exc})")
                show(st.rank, None)
            return last.status

        try:
            status = run_sync(go())
        finally:
            client.close()
        if status.failed:
            bad = [r for r in status.ranks if r.state in BAD]
            parts = [f"rank {r.rank} ({r.ip}) exit code {r.exit_code}: {r.reason}" for r in bad]
            stopped = [r.rank for r in status.ranks if r.state == CANCELLED]
            msg = "setup failed (FAILED_SETUP). Failed workers: " + "; ".join(parts)
            if stopped:
                msg += f". Setup stopped on ranks {stopped}"
            for r in bad:
                msg += f"\n--- last lines of rank {r.rank}'s setup log ---\n"
                msg += tail_text(tails.get(r.rank, ()))
            raise SetupFailed(msg)

    def teardown(
        self, name: str, grace: float = 3.0, *, holder: str | None = None, force: bool = False
    ) -> Teardown:
        """Release ``holder``'s lease and remove the cluster when no other run holds one.

        Without a holder the cluster is removed only if no run holds it (this also finishes a teardown
        that left nodes unclean); ``force=True`` removes it whoever holds it.
        """
        return self.get_backend().terminate(name, grace=grace, holder=None if force else holder or "")


class SkySSHHook(SkyHook):
    """A gang on existing machines: a ``sky_ssh`` connection lists the hosts (head first) and the key.

    Host keys are verified by default (``known_hosts`` or keys pinned in the connection); ``skip`` is an
    explicit opt-out that logs a warning. ``ssh_conn_id`` reuses a standard ``ssh`` connection's hosts,
    user and key instead of asking for them twice.
    """

    conn_type = "sky_ssh"
    hook_name = "Sky SSH cluster"
    default_conn_name = "sky_ssh_default"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema"],
            "relabeling": {
                "host": "Hosts (head first, comma-separated)",
                "login": "User",
                "password": "Private key (text)",
            },
            "placeholders": {"host": "10.0.0.1, 10.0.0.2:2222, gpu-3", "port": "22"},
        }
