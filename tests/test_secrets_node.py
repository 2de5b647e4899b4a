"""Secrets on the node: masked before output reaches the log, deleted once read, any size."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.jobs import GangClient
from airflow_provider_sky.spec import SpecError
from gangs import local_gang, wait_done

PEM = "-----BEGIN KEY-----\nMIIEvQIBADANBgkqhkiG9w0\nQEFAASCBKcwggSjAgEAAoIB\n-----END KEY-----"


def _run(sky_home: Path, run: str, **kw: object) -> tuple[LocalBackend, GangClient, object]:
    b, client, spec = local_gang(sky_home, 1, run, **kw)
    client.launch(spec, "job")
    return b, client, spec


def _log(client: GangClient) -> bytes:
    return (Path(client.node_of(0).root) / "jobs" / "job" / "0" / "log").read_bytes()


def _on_disk(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_each_line_of_a_multi_line_secret_is_masked(sky_home: Path) -> None:
    run = 'echo "$KEY"; echo "$KEY" | sed -n 2p; echo "x$(echo "$KEY" | sed -n 3p)y"; echo fine'
    b, client, _ = _run(sky_home, run, secrets={"KEY": PEM})
    assert wait_done(client).status.succeeded
    log = _log(client)
    for line in PEM.splitlines():
        assert line.encode() not in log, line
    assert log.count(b"***") >= 6 and b"fine" in log
    b.terminate("c")


def test_a_secret_written_in_two_pieces_is_masked_whole(sky_home: Path) -> None:
    """The log on disk is masked, so no read of it, at any chunk edge, can show a prefix."""
    secret = "s3cr3t-token-0123456789"
    run = f'printf "%s" "${{TOK%????????????}}"; sleep 0.5; printf "%s\\n" "${{TOK#{secret[:11]}}}"'
    b, client, _ = _run(sky_home, run, secrets={"TOK": secret})
    offsets: dict[int, int] = {}
    seen = b""
    deadline = time.time() + 20
    while time.time() < deadline:
        poll = client.poll("job", offsets, max_log=5)  # tiny chunks: edges everywhere
        if 0 in poll.chunks:
            off, data = poll.chunks[0]
            seen += data
            offsets[0] = off + len(data)
        if poll.status.done and not poll.chunks:
            break
        time.sleep(0.05)
    assert seen == b"***\n"
    b.terminate("c")


def test_no_secret_stays_on_disk_while_or_after_the_rank_runs(sky_home: Path) -> None:
    b, client, _ = _run(sky_home, 'echo "$TOK"; sleep 2', secrets={"TOK": "very-secret-value-42"})
    rank_dir = Path(client.node_of(0).root) / "jobs" / "job" / "0"
    deadline = time.time() + 5
    while not (rank_dir / "pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert not _on_disk(sky_home, b"very-secret-value-42"), "a secret is on disk while the rank runs"
    assert {"secrets", "mask", "redact"}.isdisjoint(p.name for p in rank_dir.iterdir())
    wait_done(client)
    assert not _on_disk(sky_home, b"very-secret-value-42")
    b.terminate("c")


def test_a_rank_that_fails_at_once_leaves_no_secret(sky_home: Path) -> None:
    b, client, _ = _run(sky_home, "exit 7", secrets={"TOK": "very-secret-value-43"})
    poll = wait_done(client)
    assert poll.status.ranks[0].exit_code == 7
    assert not _on_disk(sky_home, b"very-secret-value-43")
    b.terminate("c")


def test_a_200_kb_env_value_and_secret_work(sky_home: Path) -> None:
    big, secret = "x" * 200_000, "y" * 200_000
    run = 'echo "env=${#BIG} secret=${#HUGE}"; python3 -c "print(42)"'
    b, client, _ = _run(sky_home, run, envs={"BIG": big}, secrets={"HUGE": secret})
    poll = wait_done(client)
    log = _log(client).decode()
    assert poll.status.succeeded, log[:2000]
    assert "env=200000 secret=200000" in log and "42" in log
    assert "BIG is 200005 bytes" in log  # says why the value is not exported
    assert not _on_disk(sky_home, secret[:1000].encode())
    b.terminate("c")


def test_a_secret_name_with_a_newline_never_launches_and_a_good_one_reaches_every_rank(
    sky_home: Path,
) -> None:
    """``HF_TOKEN\\n`` once passed the name check, broke its line of the env file and the rank ran without
    the variable (the run succeeded); now it is refused at parse, and the real name still works."""
    with pytest.raises(SpecError, match="secrets.HF_TOKEN"):
        local_gang(sky_home, 2, "true", secrets={"HF_TOKEN\n": "hf_secret_value_1"})
    assert not list(sky_home.rglob("*.json")), "nothing may be provisioned for a refused spec"
    run = '[ "$HF_TOKEN" = hf_secret_value_1 ] && echo "rank $SKYPILOT_NODE_RANK has the token"'
    b, client, spec = local_gang(sky_home, 2, run, secrets={"HF_TOKEN": "hf_secret_value_1"})
    client.launch(spec, "job")
    assert wait_done(client).status.succeeded
    for rank in (0, 1):
        log = (Path(client.node_of(rank).root) / "jobs" / "job" / str(rank) / "log").read_bytes()
        assert f"rank {rank} has the token".encode() in log and b"command not found" not in log
    b.terminate("c")
