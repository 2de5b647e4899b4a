"""Host-key trust without any SSH server: known_hosts text, OpenSSH host patterns, pins, the policies.

Keys are real (generated here with paramiko and cryptography); hashed names come from paramiko's
``HostKeys.hash_host``, and where ``ssh-keygen`` is installed the pattern matching is checked against
OpenSSH's own lookup (``ssh-keygen -F``).
"""

from __future__ import annotations

import io
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.ssh import (
    HostKeyMismatch,
    SSHNodeConfig,
    UnknownHostKey,
    verify_host_key,
)
from airflow_provider_sky.runners.ssh.hostkeys import (
    describe,
    host_matches,
    judge_host_key,
    known_host_keys,
    parse_public_key,
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


def blobs(found: list[paramiko.PKey]) -> list[bytes]:
    return [k.asbytes() for k in found]


def cfg(tmp_path: Path, host: str = "node1.example.com", port: int = 22, **kw: object) -> SSHNodeConfig:
    kw.setdefault("known_hosts", str(tmp_path / "known_hosts"))
    return SSHNodeConfig(host, user="sky", port=port, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- parsing


def test_public_key_lines_parse_to_the_same_key(keys: dict[str, paramiko.PKey]) -> None:
    for key in keys.values():
        assert parse_public_key(line(key)).asbytes() == key.asbytes()
        assert parse_public_key(f"{line(key)} me@laptop").asbytes() == key.asbytes()  # with a comment
        assert parse_public_key(f"somehost {line(key)}").asbytes() == key.asbytes()  # pasted known_hosts
        assert describe(parse_public_key(line(key))) == f"{key.get_name()} {key.fingerprint}"
    ed = keys["ed25519"]
    for junk in ("", "ssh-ed25519", "ssh-ed25519 not-base64!", f"ssh-rsa {ed.get_base64()}", "ssh-foo AAAA"):
        with pytest.raises(ValueError):
            parse_public_key(junk)


def test_plain_names_several_keys_comments_and_junk(keys: dict[str, paramiko.PKey]) -> None:
    ed, ec, rsa = keys["ed25519"], keys["ecdsa"], keys["rsa"]
    text = "\n".join(
        [
            "# a comment line",
            "",
            f"node1.example.com {line(ed)}",
            f"node1.example.com,10.0.0.1 {line(ec)} root@node1",
            f"   node1.example.com {line(rsa)}",  # leading blanks are fine
            f"node2.example.com {line(keys['ed25519-b'])}",
            "node1.example.com ssh-ed25519 AAAAbroken",  # an unusable key is skipped
            "node1.example.com ssh-ed25519",  # too few fields
            f"@cert-authority node1.example.com {line(keys['ed25519-b'])}",  # CAs are not host keys
        ]
    )
    trusted, revoked = known_host_keys(text, "node1.example.com")
    assert blobs(trusted) == blobs([ed, ec, rsa]) and revoked == []
    assert blobs(known_host_keys(text, "10.0.0.1")[0]) == blobs([ec])
    assert blobs(known_host_keys(text, "node2.example.com")[0]) == blobs([keys["ed25519-b"]])
    assert known_host_keys(text, "node1") == ([], [])  # names match whole, not as a prefix
    assert known_host_keys(text, "NODE1.example.com") == ([], [])  # as given (callers pass lower case)
    for key in (ed, ec, rsa):
        assert judge_host_key(key, trusted, revoked) == "trusted"


def test_bracketed_host_and_port(keys: dict[str, paramiko.PKey]) -> None:
    ed, ec = keys["ed25519"], keys["ecdsa"]
    text = f"[node1.example.com]:2222 {line(ed)}\nnode1.example.com {line(ec)}\n"
    assert blobs(known_host_keys(text, "[node1.example.com]:2222")[0]) == blobs([ed])
    assert blobs(known_host_keys(text, "node1.example.com")[0]) == blobs([ec])  # port 22: the bare name
    assert known_host_keys(text, "[node1.example.com]:2223") == ([], [])
    assert known_host_keys(text, "[node1.example.com]:22") == ([], [])  # OpenSSH never writes that form
    assert SSHNodeConfig("h", user="u", port=2222).known_hosts_name == "[h]:2222"
    assert SSHNodeConfig("h", user="u").known_hosts_name == "h"


def test_hashed_entries(keys: dict[str, paramiko.PKey]) -> None:
    ed, ec = keys["ed25519"], keys["ecdsa"]
    hashed = paramiko.HostKeys.hash_host("node1.example.com")
    hashed_port = paramiko.HostKeys.hash_host("[node1.example.com]:2222")
    text = "\n".join(
        [
            f"{hashed} {line(ed)}",
            f"{hashed_port} {line(ec)}",
            f"|1|not-base64|junk {line(keys['rsa'])}",  # a broken hash matches nothing
            f"|1|only-two-fields {line(keys['rsa'])}",
        ]
    )
    assert blobs(known_host_keys(text, "node1.example.com")[0]) == blobs([ed])
    assert blobs(known_host_keys(text, "[node1.example.com]:2222")[0]) == blobs([ec])
    assert known_host_keys(text, "node2.example.com") == ([], [])
    assert not host_matches(hashed, "node1.example.co")
    assert host_matches(f"other,{hashed}", "node1.example.com")  # hashes in a list of names


@pytest.mark.parametrize(
    ("patterns", "name", "hit"),
    [
        ("*.example.com", "node1.example.com", True),
        ("*.example.com", "example.com", False),
        ("node?.example.com", "node7.example.com", True),
        ("node?.example.com", "node17.example.com", False),
        ("10.0.0.*", "10.0.0.42", True),
        ("10.0.0.*", "10.0.1.42", False),
        ("*", "anything", True),
        ("[*.internal]:2222", "[db.internal]:2222", True),  # [ and ] are literal, * still a wildcard
        ("[*.internal]:2222", "[db.internal]:2223", False),
        ("[*.internal]:2222", "db.internal", False),
        ("node.example.com", "nodeXexample.com", False),  # a dot is a dot, not "any character"
        ("*.example.com,!bad.example.com", "good.example.com", True),
        ("*.example.com,!bad.example.com", "bad.example.com", False),  # negation wins wherever it is
        ("!bad.example.com,*.example.com", "bad.example.com", False),
        ("!bad.example.com", "good.example.com", False),  # a negation alone matches nothing
        ("!*.example.com,node1.example.com", "node1.example.com", False),
        ("a,b,node1", "node1", True),
        ("a,b,node1", "node", False),
    ],
)
def test_host_patterns(patterns: str, name: str, hit: bool) -> None:
    assert host_matches(patterns, name) is hit


# --------------------------------------------------------------------------------------------- verdicts


def test_judge(keys: dict[str, paramiko.PKey]) -> None:
    ed, ec, rsa = keys["ed25519"], keys["ecdsa"], keys["rsa"]
    assert judge_host_key(ed, [ed, ec], []) == "trusted"
    assert judge_host_key(rsa, [ed, ec], []) == "mismatch"
    assert judge_host_key(rsa, [], []) == "unknown"
    assert judge_host_key(ed, [ed], [ed]) == "revoked"  # revoked wins over trusted
    assert judge_host_key(ed, [], [ec]) == "unknown"  # revoking another key trusts nothing
    # same key, a different object (as parsed from a file): compared by its bytes
    assert judge_host_key(parse_public_key(line(ed)), [ed], []) == "trusted"


def test_verify_trusted_and_several_keys(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    ed, ec, rsa = keys["ed25519"], keys["ecdsa"], keys["rsa"]
    (tmp_path / "known_hosts").write_text(
        f"node1.example.com {line(ed)}\nnode1.example.com {line(ec)}\n[node1.example.com]:2222 {line(rsa)}\n"
    )
    for key in (ed, ec):
        verify_host_key(cfg(tmp_path), key)
    verify_host_key(cfg(tmp_path, port=2222), rsa)
    with pytest.raises(HostKeyMismatch) as err:
        verify_host_key(cfg(tmp_path, port=2222), ed)  # the bare-name keys are not port 2222's
    assert err.value.expected == (describe(rsa),)


def test_verify_mismatch(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    ed, ec, rsa = keys["ed25519"], keys["ecdsa"], keys["rsa"]
    (tmp_path / "known_hosts").write_text(f"node1.example.com {line(ed)}\nnode1.example.com {line(ec)}\n")
    for policy in ("verify", "accept-new"):  # accept-new only accepts hosts it has no key for
        with pytest.raises(HostKeyMismatch) as err:
            verify_host_key(cfg(tmp_path, host_key_policy=policy), rsa)
        assert err.value.seen == describe(rsa)
        assert err.value.expected == (describe(ed), describe(ec))
        message = str(err.value)
        assert "HOST KEY MISMATCH" in message and "node1.example.com:22" in message
        assert rsa.fingerprint in message and ed.fingerprint in message and ec.fingerprint in message
        assert "ssh-keygen -R 'node1.example.com'" in message
    assert (tmp_path / "known_hosts").read_text().count("\n") == 2  # nothing was added


def test_verify_pinned_keys(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    ed, ec = keys["ed25519"], keys["ecdsa"]
    # no known_hosts file at all: the pin alone decides
    verify_host_key(cfg(tmp_path, pinned_host_keys=(f"{line(ed)} pinned by ops",)), ed)
    verify_host_key(
        cfg(tmp_path, pinned_host_keys=(f"node1.example.com {line(ed)}",)), ed
    )  # known_hosts form
    with pytest.raises(HostKeyMismatch):
        verify_host_key(cfg(tmp_path, pinned_host_keys=(line(ec),)), ed)
    # pins add to known_hosts: either one trusts
    (tmp_path / "known_hosts").write_text(f"node1.example.com {line(ec)}\n")
    pinned = cfg(tmp_path, pinned_host_keys=(line(ed),))
    verify_host_key(pinned, ed)
    verify_host_key(pinned, ec)
    with pytest.raises(RunnerError, match="pinned host key is invalid") as err:
        verify_host_key(cfg(tmp_path, pinned_host_keys=("ssh-ed25519 AAAAbroken",)), ed)
    assert not isinstance(err.value, HostKeyMismatch)


def test_verify_revoked(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    ed, ec = keys["ed25519"], keys["ecdsa"]
    (tmp_path / "known_hosts").write_text(
        f"@revoked * {line(ed)}\nnode1.example.com {line(ed)}\nnode1.example.com {line(ec)}\n"
    )
    trusted, revoked = read_known_hosts(tmp_path / "known_hosts", "node1.example.com")
    assert blobs(trusted) == blobs([ed, ec]) and blobs(revoked) == blobs([ed])
    for policy in ("verify", "accept-new"):
        with pytest.raises(HostKeyMismatch, match="@revoked"):
            verify_host_key(cfg(tmp_path, host_key_policy=policy), ed)
        with pytest.raises(HostKeyMismatch, match="@revoked"):  # a pin does not lift a revocation
            verify_host_key(cfg(tmp_path, host_key_policy=policy, pinned_host_keys=(line(ed),)), ed)
    verify_host_key(cfg(tmp_path), ec)


def test_verify_unknown_and_accept_new(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    ed, ec = keys["ed25519"], keys["ecdsa"]
    known = tmp_path / "sub" / "known_hosts"
    with pytest.raises(UnknownHostKey) as err:
        verify_host_key(cfg(tmp_path, port=2222, known_hosts=str(known)), ed)
    assert err.value.seen == describe(ed)
    for part in ("[node1.example.com]:2222", "ssh-keyscan -p 2222 node1.example.com", "accept-new", "pin"):
        assert part in str(err.value)
    assert not known.exists()  # verify never writes

    # an entry for another host is no entry for this one
    known.parent.mkdir()
    known.write_text(f"node2.example.com {line(ec)}")  # no trailing newline
    accept = cfg(tmp_path, port=2222, known_hosts=str(known), host_key_policy="accept-new")
    verify_host_key(accept, ed)
    assert known.read_text() == f"node2.example.com {line(ec)}\n[node1.example.com]:2222 {line(ed)}\n"
    verify_host_key(cfg(tmp_path, port=2222, known_hosts=str(known)), ed)  # now known to "verify" too
    verify_host_key(accept, ed)  # nothing appended twice
    assert known.read_text().count("node1") == 1
    with pytest.raises(HostKeyMismatch):  # the recorded key now binds accept-new too
        verify_host_key(accept, ec)


def test_skip_trusts_anything_and_reads_nothing(tmp_path: Path, keys: dict[str, paramiko.PKey]) -> None:
    (tmp_path / "known_hosts").write_text(f"@revoked * {line(keys['ed25519'])}\n")
    skip = cfg(tmp_path, host_key_policy="skip", pinned_host_keys=(line(keys["ecdsa"]),))
    verify_host_key(skip, keys["ed25519"])
    verify_host_key(skip, keys["rsa"])
    assert (tmp_path / "known_hosts").read_text().count("\n") == 1


def test_bad_policy_and_pins_are_refused() -> None:
    with pytest.raises(ValueError, match="host_key_policy"):
        SSHNodeConfig("h", user="u", host_key_policy="trust-me")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tuple"):
        SSHNodeConfig("h", user="u", pinned_host_keys="ssh-ed25519 AAAA")  # type: ignore[arg-type]
