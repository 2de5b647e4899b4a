"""Host-key trust without any SSH server: known_hosts text, OpenSSH host patterns, pins, the policies.

Keys are real (generated here with paramiko and cryptography); hashed names come from paramiko's
``HostKeys.hash_host``, and where ``ssh-keygen`` is installed the pattern matching is checked against
OpenSSH's own lookup (``ssh-keygen -F``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import paramiko
import pytest

from airflow_provider_sky.runners.ssh.hostkeys import (
    read_known_hosts,
)
from unit.test_hostkeys import keys, line  # noqa: F401  (shared with the unit half; fixtures among them)

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
