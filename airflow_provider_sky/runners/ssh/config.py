"""How to reach one node over SSH: address, user, client key and host-key trust policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeGuard

HostKeyPolicy = Literal["verify", "accept-new", "skip"]
_POLICIES = ("verify", "accept-new", "skip")


def is_policy(value: str) -> TypeGuard[HostKeyPolicy]:
    """``value`` is one of the host-key policies (narrows a connection's string to the policy type)."""
    return value in _POLICIES


@dataclass(frozen=True)
class SSHNodeConfig:
    """How to reach one node. Secrets (``private_key``, ``passphrase``) are kept out of ``repr``."""

    host: str
    _: dataclasses.KW_ONLY
    user: str
    port: int = 22
    #: private key TEXT (OpenSSH or PEM); takes precedence over ``key_file``
    private_key: str | None = field(default=None, repr=False)
    key_file: str | None = None
    passphrase: str | None = field(default=None, repr=False)
    host_key_policy: HostKeyPolicy = "verify"
    #: known_hosts path; ``None`` means ``~/.ssh/known_hosts`` (read if it exists; written by accept-new)
    known_hosts: str | None = None
    #: trusted host keys as ``"ssh-ed25519 AAAA... [comment]"`` lines
    pinned_host_keys: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    keepalive: int = 15
    #: handshake attempts (exponential backoff between them) before HostUnreachable
    connect_attempts: int = 4
    #: channels used at once on the shared transport; sshd's default ``MaxSessions`` is 10
    max_sessions: int = 10

    def __post_init__(self) -> None:
        if self.host_key_policy not in _POLICIES:
            raise ValueError(f"host_key_policy must be one of {_POLICIES}, not {self.host_key_policy!r}")
        if not self.user:
            raise ValueError("user is required")
        if isinstance(self.pinned_host_keys, str):
            raise ValueError("pinned_host_keys must be a tuple of key lines, not one string")
        if self.connect_attempts < 1 or self.max_sessions < 1:
            raise ValueError("connect_attempts and max_sessions must be >= 1")

    @property
    def address(self) -> str:
        """``host:port`` for messages."""
        return f"{self.host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The host's name in known_hosts: ``host``, or ``[host]:port`` off port 22 (OpenSSH's form)."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()
