"""Every error the provider raises on purpose, under one root: ``except SkyError`` catches them all.

Each class is also importable from the module that raises it (``airflow_provider_sky.spec.SpecError``,
``airflow_provider_sky.backends.base.BackendError``, ...): those names are these very classes. Classes
that were a ``ValueError`` or ``RuntimeError`` still are, so existing ``except`` clauses keep working.
Every message names what is wrong and how to fix it. The module imports only the standard library, so
every layer can use it, backends and runners (which never import Airflow) included.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AccountError",
    "AgentError",
    "AgentUnreachable",
    "AuthFailed",
    "BackendError",
    "BridgeError",
    "CallAbandoned",
    "ClusterBusy",
    "CommandTimeout",
    "ConnectionConfigError",
    "HostKeyError",
    "HostKeyMismatch",
    "HostUnreachable",
    "LaunchError",
    "ResultError",
    "RunnerError",
    "SetupFailed",
    "SkyError",
    "SpecError",
    "StatusParseError",
    "UnknownHostKey",
]


class SkyError(Exception):
    """The root: something the provider detected and explains (field and fix in the message)."""


# ------------------------------------------------------------------------------------ the task spec


class SpecError(SkyError, ValueError):
    """Bad task spec. ``str()`` is ``'<field>: <message>'``; the message says what is wrong and how to fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[SpecError], tuple[str, str]]:
        # The default reduce would call SpecError(str(self)) and fail: keep it picklable across processes.
        return (SpecError, (self.field, self.message))


# ------------------------------------------------------------------------------------ backends


class BackendError(SkyError):
    """Provisioning or teardown failed; the message says what and how to fix it."""


class ClusterBusy(BackendError):
    """The cluster is being torn down; a provision of that name waits for the teardown to end."""


class ConnectionConfigError(BackendError, ValueError):
    """A connection's settings are wrong or contradict each other; the message names the field and the fix."""


class AccountError(SkyError, RuntimeError):
    """Something the Kubernetes account needs is missing; the message names each piece and the fix."""


# ------------------------------------------------------------------------------------ runners


class RunnerError(SkyError):
    """A node could not be reached or the transport failed (not: the command exited nonzero)."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host


class HostUnreachable(RunnerError):
    """Nothing answered SSH at host:port in time (node down, still booting, or wrong address)."""


class HostKeyError(RunnerError):
    """The server's host key could not be trusted; nothing was run on the host."""


class HostKeyMismatch(HostKeyError):
    """The server presented a key other than the one we know: re-keyed host or an interception."""

    def __init__(self, host: str, message: str, *, expected: tuple[str, ...], seen: str) -> None:
        super().__init__(host, message)
        self.expected = expected
        self.seen = seen


class UnknownHostKey(HostKeyError):
    """Policy ``verify`` and no known_hosts entry or pinned key for the host."""

    def __init__(self, host: str, message: str, *, seen: str) -> None:
        super().__init__(host, message)
        self.seen = seen


class AuthFailed(RunnerError):
    """The server rejected our private key for this user."""

    def __init__(self, host: str, message: str, *, user: str) -> None:
        super().__init__(host, message)
        self.user = user


class CommandTimeout(RunnerError):
    """The script did not finish within ``timeout``; its channel was closed."""


class CallAbandoned(RunnerError):
    """The caller of :meth:`SSHRunner.arun_script` was cancelled; the script was stopped."""


# ------------------------------------------------------------------------------------ the gang's run


class StatusParseError(SkyError, ValueError):
    """The node's status output is not what the status script prints."""


class LaunchError(SkyError):
    """Not every rank could be started; the ones that did were cancelled."""


class SetupFailed(SkyError):
    """Setup failed on at least one node; the others' setups were stopped."""


class BridgeError(SkyError):
    """The bridge could not be started or ended without answering (its log says why)."""


class AgentError(SkyError):
    """The head refused a call, or answered outside the protocol."""


class AgentUnreachable(AgentError):
    """The head's agent, or some node's agent behind it, cannot be reached: the per-node path applies.

    ``nodes``: the nodes the head does not hear from (empty: the head itself did not answer)."""

    def __init__(self, message: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = list(nodes)


class ResultError(SkyError):
    """The gang succeeded but its result cannot be had (too big, file missing, node unreachable)."""
