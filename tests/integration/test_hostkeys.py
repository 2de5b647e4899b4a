"""Host-key trust without any SSH server: known_hosts text, OpenSSH host patterns, pins, the policies.

Keys are real (generated here with paramiko and cryptography); hashed names come from paramiko's
``HostKeys.hash_host``, and where ``ssh-keygen`` is installed the pattern matching is checked against
OpenSSH's own lookup (``ssh-keygen -F``).
"""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from airflow_provider_sky.runners.ssh.hostkeys import (
    read_known_hosts,
)


def _ed25519() -> paramiko.PKey:
    """paramiko cannot generate Ed25519 keys: make one with cryptography, load it with paramiko."""
    text = (
        ed25519.Ed25519PrivateKey.generate()
        .private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        .decode()
    )
    return paramiko.Ed25519Key.from_private_key(io.StringIO(text))


@pytest.fixture(scope="module")
def keys() -> dict[str, paramiko.PKey]:
    return {
        "ed25519": _ed25519(),
        "ed25519-b": _ed25519(),
        "ecdsa": paramiko.ECDSAKey.generate(bits=256),
        "rsa": paramiko.RSAKey.generate(2048),
    }


def line(key: paramiko.PKey) -> str:
    """``"ssh-ed25519 AAAA..."``: the key part of a known_hosts line or a pin."""
    return f"{key.get_name()} {key.get_base64()}"


# --------------------------------------------------------------------------------------------- parsing


@pytest.mark.skipif(not shutil.which("ssh-keygen"), reason="ssh-keygen not installed")
def test_patterns_agree_with_openssh(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    """The same verdicts as OpenSSH's own known_hosts lookup (``ssh-keygen -F name -f file``)."""
    names = [
        "node1.example.com",
        "bad.example.com",
        "example.com",
        "node17.example.com",
        "10.0.0.42",
        "[db.internal]:2222",
        "[db.internal]:2223",
        "db.internal",
        "[node1.example.com]:2222",
    ]
    patterns = [
        "*.example.com,!bad.example.com",
        "node?.example.com",
        "10.0.0.*",
        "[*.internal]:2222",
        "!node1.example.com",
        paramiko.HostKeys.hash_host("[node1.example.com]:2222"),
        paramiko.HostKeys.hash_host("example.com"),
    ]
    for pattern in patterns:
        path = tmp_path / "known_hosts"
        path.write_text(f"{pattern} {line(keys['ed25519'])}\n")
        for name in names:
            found = subprocess.run(
                ["ssh-keygen", "-F", name, "-f", str(path)], capture_output=True, check=False
            )
            assert found.returncode in (0, 1), found.stderr
            openssh = found.returncode == 0
            assert bool(read_known_hosts(path, name)[0]) is openssh, (pattern, name, openssh)


# --------------------------------------------------------------------------------------------- verdicts
