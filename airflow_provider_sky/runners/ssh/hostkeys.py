"""Which host keys to trust: known_hosts parsing, OpenSSH host patterns, pinned keys, the trust policy.

Matching is plain code over text and keys (:func:`known_host_keys`, :func:`host_matches`,
:func:`judge_host_key`), so it is tested without an SSH server; only :func:`verify_host_key` reads and
(for ``accept-new``) appends to the known_hosts file.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import functools
import hashlib
import hmac
import logging
import os
import re
import threading
from pathlib import Path
from typing import Literal

import paramiko

from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.ssh.config import SSHNodeConfig
from airflow_provider_sky.runners.ssh.errors import HostKeyMismatch, UnknownHostKey

log = logging.getLogger(__name__)

#: what :func:`judge_host_key` concludes about a presented key
Verdict = Literal["trusted", "revoked", "mismatch", "unknown"]


def describe(key: paramiko.PKey) -> str:
    """``ssh-ed25519 SHA256:...``: what users compare with ``ssh-keygen -lf``."""
    return f"{key.get_name()} {key.fingerprint}"


def same_key(a: paramiko.PKey, b: paramiko.PKey) -> bool:
    return a.asbytes() == b.asbytes()


def parse_public_key(line: str) -> paramiko.PKey:
    """``"ssh-ed25519 AAAA... [comment]"`` (or a known_hosts line) -> PKey; raises ValueError on junk."""
    parts = line.split()
    if (
        len(parts) >= 3
        and not parts[0].startswith(("ssh-", "ecdsa-"))
        and parts[1].startswith(("ssh-", "ecdsa-"))
    ):
        parts = parts[1:]  # "host keytype base64": a line pasted from known_hosts
    if len(parts) < 2:
        raise ValueError(f"not a public key line: {line[:40]!r}")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        return paramiko.PKey.from_type_string(parts[0], blob)
    except (binascii.Error, paramiko.SSHException, paramiko.pkey.UnknownKeyType, ValueError) as e:
        raise ValueError(f"not a usable {parts[0]} public key: {type(e).__name__}") from None


@functools.lru_cache(maxsize=512)
def _glob(pattern: str) -> re.Pattern[str]:
    """OpenSSH patterns know only ``*`` and ``?`` (``[`` is literal, as in ``[host]:port``)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern))


def host_matches(patterns: str, name: str) -> bool:
    """OpenSSH known_hosts host field: comma list of names, ``|1|`` hashes, wildcards, ``!`` negation."""
    matched = False
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("|1|"):
            try:
                _, _, salt_b64, digest_b64 = pattern.split("|")
                salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
            except ValueError:
                continue
            hit = hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)
        else:
            hit = _glob(pattern).fullmatch(name) is not None
        if hit and negated:
            return False
        matched = matched or hit
    return matched


def known_host_keys(text: str, name: str) -> tuple[list[paramiko.PKey], list[paramiko.PKey]]:
    """(trusted, revoked) keys for ``name`` (``host`` or ``[host]:port``) in known_hosts ``text``.

    Comments, ``@cert-authority`` lines and unusable keys are skipped; ``@revoked`` keys are returned apart.
    """
    trusted: list[paramiko.PKey] = []
    revoked: list[paramiko.PKey] = []
    for raw in text.splitlines():
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3 or marker == "@cert-authority":
            continue
        if not host_matches(fields[0], name):
            continue
        try:
            key = parse_public_key(f"{fields[1]} {fields[2]}")
        except ValueError:
            continue
        (revoked if marker == "@revoked" else trusted).append(key)
    return trusted, revoked


def read_known_hosts(path: Path, name: str) -> tuple[list[paramiko.PKey], list[paramiko.PKey]]:
    """:func:`known_host_keys` of a known_hosts file; a missing file is empty."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], []
    return known_host_keys(text, name)


def judge_host_key(
    seen: paramiko.PKey, trusted: list[paramiko.PKey], revoked: list[paramiko.PKey]
) -> Verdict:
    """A revoked key is refused even if also trusted; any trusted key matching wins; a host with trusted
    keys none of which match is a mismatch; a host with none is unknown."""
    if any(same_key(seen, k) for k in revoked):
        return "revoked"
    if any(same_key(seen, k) for k in trusted):
        return "trusted"
    return "mismatch" if trusted else "unknown"


_KNOWN_HOSTS_WRITE = threading.Lock()
_SKIP_WARNED: set[str] = set()
_SKIP_LOCK = threading.Lock()


def append_known_host(cfg: SSHNodeConfig, key: paramiko.PKey) -> bool:
    """accept-new: record ``key`` unless another thread/process recorded one first. True if appended."""
    path = cfg.known_hosts_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _KNOWN_HOSTS_WRITE, open(path, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            trusted, _ = read_known_hosts(path, cfg.known_hosts_name)
            if trusted:
                return False
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:
                fh.seek(fh.tell() - 1)
                if fh.read(1) != "\n":
                    fh.write("\n")
            fh.write(f"{cfg.known_hosts_name} {key.get_name()} {key.get_base64()}\n")
            fh.flush()
            return True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def expected_keys(cfg: SSHNodeConfig) -> tuple[list[paramiko.PKey], list[paramiko.PKey]]:
    """Keys we trust for the host (known_hosts + pins) and keys known_hosts revokes."""
    trusted, revoked = read_known_hosts(cfg.known_hosts_path(), cfg.known_hosts_name)
    for line in cfg.pinned_host_keys:
        try:
            trusted.append(parse_public_key(line))
        except ValueError as e:
            raise RunnerError(cfg.host, f"pinned host key is invalid: {e}") from None
    return trusted, revoked


def verify_host_key(cfg: SSHNodeConfig, seen: paramiko.PKey) -> None:
    """Apply ``cfg.host_key_policy`` to the key the server presented; raise HostKeyError to refuse it."""
    if cfg.host_key_policy == "skip":
        with _SKIP_LOCK:
            first = cfg.address not in _SKIP_WARNED
            _SKIP_WARNED.add(cfg.address)
        if first:
            log.warning(
                "host key checking is disabled for %s (host_key_policy='skip'): accepting %s unverified; "
                "anyone on the path can impersonate this host",
                cfg.address,
                describe(seen),
            )
        return
    trusted, revoked = expected_keys(cfg)
    where = f"known_hosts file {cfg.known_hosts_path()}"
    verdict = judge_host_key(seen, trusted, revoked)
    if verdict == "revoked":
        raise HostKeyMismatch(
            cfg.host,
            f"host key {describe(seen)} of {cfg.address} is marked @revoked in {where}; refusing to connect. "
            "Nothing was run on this host.",
            expected=tuple(describe(k) for k in trusted),
            seen=describe(seen),
        )
    if verdict == "trusted":
        return
    if verdict == "mismatch":
        expected = tuple(describe(k) for k in trusted)
        raise HostKeyMismatch(
            cfg.host,
            f"HOST KEY MISMATCH for {cfg.address}: expected {', '.join(expected)} but the server presented "
            f"{describe(seen)}. Nothing was run on this host. If the host was re-installed or re-keyed, "
            f"update its entry {cfg.known_hosts_name!r} in the {where} (ssh-keygen -R '{cfg.known_hosts_name}' "
            "-f <file>, then add the new key) or the connection's pinned host keys; otherwise the connection "
            "may be intercepted.",
            expected=expected,
            seen=describe(seen),
        )
    if cfg.host_key_policy == "accept-new":
        if append_known_host(cfg, seen):
            log.info(
                "trusting new host key %s for %s (accept-new), saved to %s",
                describe(seen),
                cfg.address,
                cfg.known_hosts_path(),
            )
            return
        verify_host_key(cfg, seen)  # somebody else recorded a key meanwhile: it must match
        return
    raise UnknownHostKey(
        cfg.host,
        f"unknown host key for {cfg.address} ({describe(seen)}): no entry {cfg.known_hosts_name!r} in the "
        f"{where} and no pinned host key. Add the host to known_hosts (ssh-keyscan -p {cfg.port} {cfg.host}), "
        "pin its key in the connection (pinned_host_keys), or use host_key_policy='accept-new'. "
        "Nothing was run on this host.",
        seen=describe(seen),
    )
