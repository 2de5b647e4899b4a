"""What can go wrong reaching a node over SSH, as :class:`RunnerError` subclasses callers can tell apart."""

from __future__ import annotations

from airflow_provider_sky.runners.base import RunnerError


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
