"""Secrets on the node: masked before output reaches the log, deleted once read, any size."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gangs import local_gang, wait_done
from k8s_cluster import wait_for
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.watch.jobs import GangClient

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


def test_a_rank_whose_leftover_holds_its_output_ends_and_the_leftover_stays_masked(sky_home: Path) -> None:
    """The command exits while a process it left holds the mask filter's pipe open: the rank still ends
    (the wrapper waits for the filter at most ~2 s while a process of its group is left, here long before
    the leftover ends), and what the leftover prints later still goes through the mask."""
    secret = "leftover-secret-value-44"
    run = 'echo "first $TOK"; (sleep 6; echo "late $TOK"; sleep 14) & exit 3'
    b, client, _ = _run(sky_home, run, secrets={"TOK": secret})
    rank_dir = Path(client.node_of(0).root) / "jobs" / "job" / "0"
    poll = wait_done(client, timeout=60)
    assert poll.status.ranks[0].exit_code == 3
    took = (rank_dir / "exit").stat().st_mtime - (rank_dir / "start").stat().st_mtime
    # the leftover holds the pipe for 20 s; the wrapper's bound is 2 s (10 s of margin for a loaded machine)
    assert took < 12, f"the rank took {took:.1f} s to end"
    deadline = time.time() + 30
    while b"late" not in _log(client) and time.time() < deadline:
        time.sleep(0.2)
    assert _log(client) == b"first ***\nlate ***\n"
    assert not _on_disk(sky_home, secret.encode())
    b.terminate("c")


def test_a_filter_slower_than_the_command_still_has_the_last_line_in_the_log_when_the_exit_is_written(
    sky_home: Path,
) -> None:
    """A rank that prints one line and ends while its filter is not yet running (a Python filter still
    starting on a loaded machine: seen once in a CI run with three integration workers) left no process
    that holds its output: the wrapper waits for the filter, so the line is in the log when the exit is,
    the contract a reader of the exit relies on. Here the filter is stopped (SIGSTOP) while the command
    prints and ends, and let go 4 s later: past the 2 s that a rank with a leftover process gets, within
    the 10 s bound of one without."""
    go = sky_home.parent / "go"
    run = f'while [ ! -e {go} ]; do sleep 0.05; done; echo "rank $SKYPILOT_NODE_RANK has the $TOK"'
    b, client, _ = _run(sky_home, run, secrets={"TOK": "token-value-45"})
    rank_dir = Path(client.node_of(0).root) / "jobs" / "job" / "0"
    filters = wait_for(lambda: _filters(rank_dir), 10, "a filter reading the rank's output", 0.05)
    for pid in filters:
        os.kill(pid, signal.SIGSTOP)
    try:
        go.touch()
        time.sleep(4.0)
        # the command has ended; its output waits in the pipe: the exit is not written before it is through
        assert not (rank_dir / "exit").exists(), (
            "the exit was written while the rank's last line was not in the log"
        )
    finally:
        for pid in filters:
            os.kill(pid, signal.SIGCONT)
    wait_for((rank_dir / "exit").exists, 20, "the rank's exit", 0.01)
    log = _log(client)  # read as soon as the exit is there, as a watcher does
    assert log == b"rank 0 has the ***\n", log
    assert wait_done(client).status.succeeded
    b.terminate("c")


def _fds_on(pid: int, path: str) -> list[int]:
    """The descriptors of ``pid`` open on ``path``."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            if os.readlink(fd) == path:
                out.append(int(fd.name))
        except OSError:
            pass
    return out


def _stat(pid: int) -> tuple[str, int]:
    """A process's state letter and parent pid."""
    text = Path(f"/proc/{pid}/stat").read_text()
    state, ppid = text.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def test_a_line_printed_before_the_filter_opened_its_pipe_is_in_the_log(
    sky_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short command can print and end before its output filter's shell has run at all (not
    scheduled yet on a loaded machine: seen as the empty log of a rank that succeeded; when the wrapper
    had dropped its end of the pipe first, the command died of SIGPIPE, exit 141). The line must wait in
    the pipe for the filter, not go with the last open end. Under strace, every process of the
    rank stops (SIGSTOP) at its first close of a descriptor on the pipe; the test lets each go at once,
    but a child of the wrapper that holds no end of the pipe there (a filter about to open it itself)
    only once nothing else holds the pipe: the command has ended and the wrapper dropped its end."""
    fifo = ""

    def argv_under_strace(self: Any, args: list[str] | None) -> list[str]:
        return [
            "strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=close",
            "-e", "inject=close:signal=SIGSTOP:when=1", "-P", fifo,
            "/bin/sh", "-s", "--", *(args or []),
        ]  # fmt: skip

    run = 'echo "rank $SKYPILOT_NODE_RANK has the $TOK"'
    b, client, spec = local_gang(sky_home, 1, run, secrets={"TOK": "token-value-46"})
    rank_dir = Path(client.node_of(0).root) / "jobs" / "job" / "0"
    fifo = str(rank_dir / "out")
    monkeypatch.setattr(type(client.runner(client.node_of(0))), "_argv", argv_under_strace)
    # strace follows every process the call starts: no keeper, so the call ends with the rank
    launch = threading.Thread(target=client.launch, args=(spec, "job"), kwargs={"orphan_timeout": 0})
    launch.start()
    held: set[int] = set()
    deadline = time.time() + 60
    while launch.is_alive() and time.time() < deadline:
        procs = {}
        for d in Path("/proc").glob("[0-9]*"):
            try:
                if str(rank_dir).encode() in (d / "cmdline").read_bytes():
                    procs[int(d.name)] = _stat(int(d.name))
            except OSError:
                pass
        for pid, (state, ppid) in procs.items():
            if state not in "tT":
                continue
            filter_to_be = ppid in procs and not _fds_on(pid, fifo)
            if filter_to_be and any(_fds_on(p, fifo) for p in procs if p != pid):
                held.add(pid)
                continue
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    launch.join(5)
    monkeypatch.undo()
    assert not launch.is_alive()
    assert (rank_dir / "exit").read_text().split()[0] == "0"
    assert _log(client) == b"rank 0 has the ***\n", f"held at its first close on the pipe: {sorted(held)}"
    assert wait_done(client).status.succeeded
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


#: a rank printing one long line, no newline, with its secret every ~64 KiB and at every MiB edge, in
#: writes of 4,093 bytes (the filter's reads cut it anywhere); the rest once the test says ``go``
LONG_LINE = r"""
import os, sys, time
secret, size, go = os.environ["TOK"].encode(), int(sys.argv[1]), sys.argv[2]
line = bytearray(b"a" * size)
for k in range(1, size // 65536):
    for at in (k * 65536 - len(secret) // 2, k * 1048576 - 3):
        if at + len(secret) < size:
            line[at : at + len(secret)] = secret
for i in range(0, size, 4093):
    os.write(1, line[i : i + 4093])
    if i // 4093 % 97 == 0:
        time.sleep(0.001)
while not os.path.exists(go):
    time.sleep(0.05)
os.write(1, b"\ndone\n")
"""


def _filters(rank_dir: Path) -> list[int]:
    """The rank's output filter: the processes reading its fifo."""
    fifo, found = str(rank_dir / "out"), []
    for fd0 in Path("/proc").glob("[0-9]*/fd/0"):
        try:
            if os.readlink(fd0) == fifo:
                found.append(int(fd0.parent.parent.name))
        except OSError:
            pass
    return found


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def test_a_long_unterminated_line_is_masked_in_bounded_memory_and_shown_before_its_end(
    sky_home: Path, tmp_path: Path
) -> None:
    """64 MiB without a newline: the log has all but its last 64 KiB while the rank still writes the
    line (``sed`` showed nothing before the newline and held the line twice, 2.3 MB/s), the filter's
    memory stays far below the line's size, and every secret across a cut or a read edge is masked."""
    import sys

    secret, size = "s3cr3t-token-0123456789", 64 << 20
    (tmp_path / "long.py").write_text(LONG_LINE)
    go = tmp_path / "go"
    run = f"exec {sys.executable} {tmp_path / 'long.py'} {size} {go}"
    b, client, _ = _run(sky_home, run, secrets={"TOK": secret})
    rank_dir = Path(client.node_of(0).root) / "jobs" / "job" / "0"
    line = bytearray(b"a" * size)
    for k in range(1, size // 65536):
        for at in (k * 65536 - len(secret) // 2, k * 1048576 - 3):
            if at + len(secret) < size:
                line[at : at + len(secret)] = secret.encode()
    masked = bytes(line).replace(secret.encode(), b"***")
    log = rank_dir / "log"
    deadline = time.time() + 60
    while time.time() < deadline and (
        not log.exists() or log.stat().st_size < len(masked) - 65536 - len(secret)
    ):
        time.sleep(0.1)
    shown = log.read_bytes() if log.exists() else b""
    assert len(shown) >= len(masked) - 65536 - len(secret), f"{len(shown)} of {len(masked)} bytes in the log"
    assert masked.startswith(shown), "the log is not the masked line's start"
    peaks = {pid: _peak_kib(pid) for pid in _filters(rank_dir)}
    assert peaks and max(peaks.values()) < 32 * 1024, peaks  # the line is 64 MiB
    go.touch()
    assert wait_done(client).status.succeeded
    assert _log(client) == masked + b"\ndone\n"
    b.terminate("c")


def _awk_bin(which: str, tmp_path: Path) -> str:
    """A PATH whose ``awk`` is ``which`` (mawk: Debian's; busybox: a Kubernetes test pod's)."""
    import shutil

    exe = shutil.which(which)
    if exe is None:
        pytest.fail(f"{which} is missing: the system deps install it (make system-deps)")
    d = tmp_path / which
    d.mkdir()
    (d / "awk").symlink_to(exe)
    return f"{d}:/usr/bin:/bin"


@pytest.mark.parametrize("impl", ["maskpy", "maskawk:mawk", "maskawk:busybox"])
def test_the_filter_masks_across_reads_and_cuts_and_shows_each_line_at_once(
    impl: str, tmp_path: Path
) -> None:
    """Straight through ``maskfilter``'s two implementations, one write at a time: each line is in the
    log before the next write (no 4 KiB buffer to fill first), a secret split across two writes (two
    reads) is masked, and so is one across a long line's cut (Python: the line's first 64 KiB are out
    before its end; awk holds a line whole)."""
    import subprocess

    from airflow_provider_sky.node.runtime import mask_file
    from airflow_provider_sky.node.shell import MASK_FUNC

    secret = "s3cr3t-token-0123456789"
    (tmp_path / "mask").write_text(mask_file({"TOK": secret, "OTHER": "another-one-42"}))
    out = tmp_path / "out"
    func, _, awk = impl.partition(":")
    env = {"PATH": _awk_bin(awk, tmp_path) if awk else "/usr/bin:/bin"}
    with open(out, "wb") as sink:
        script = f'exec 3<"$1"; rm -f "$1"\n{MASK_FUNC}{func}'
        p = subprocess.Popen(
            ["sh", "-c", script, "sh", str(tmp_path / "mask")], stdin=subprocess.PIPE, stdout=sink, env=env
        )
    assert p.stdin is not None
    long = b"x" * 70000
    # (write, what the log must have once it is read: a prefix of the whole masked stream)
    steps = [
        (f"step 1 {secret} and another-one-42\n".encode(), b"step 1 *** and ***\n"),
        (b"half " + secret[:9].encode(), b""),
        (secret[9:].encode() + b" whole\n", b"half *** whole\n"),
    ]
    if func == "maskpy":
        steps += [
            # cut: all but the last len(secret) - 1 bytes are out, the secret's start waits for the rest
            (long + secret[:5].encode(), long[: 5 - len(secret) + 1]),
            (secret[5:].encode() + b"y\n", long[5 - len(secret) + 1 :] + b"***y\n"),
            # the cut falls inside a whole secret: out with it
            (long + secret.encode() + b"zz", long + b"***"),
            (b"\n", b"zz\n"),
            (b"50%\r", b"50%\r"),  # a progress bar's update shows at once
            (b"100%\n", b"100%\n"),
        ]
    else:
        steps += [(long + secret[:5].encode(), b""), (secret[5:].encode() + b"y\n", long + b"***y\n")]
    expected = b""
    for data, shown in steps:
        p.stdin.write(data)
        p.stdin.flush()
        expected += shown
        deadline = time.time() + 10
        while time.time() < deadline and out.stat().st_size < len(expected):
            time.sleep(0.01)
        time.sleep(0.05)  # nothing more than that, and the next write is a read of its own
        assert out.read_bytes() == expected, (impl, data[-100:], out.read_bytes()[-100:])
    p.stdin.close()
    assert p.wait(10) == 0
    assert out.read_bytes() == expected


def test_on_a_busybox_pod_awk_masks_live_and_across_writes(k8s: Any, k8s_image: Any) -> None:
    """A Kubernetes test pod has busybox and no Python: the awk filter shows each line while the rank
    still runs and masks a secret printed in two pieces."""
    import asyncio

    from k8s_cluster import connection_extras

    from airflow_provider_sky.backends.registry import by_kind
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.loop import watch

    secret = "s3cr3t-token-0123456789"
    run = (
        'command -v python3 || echo "no python here"; echo "first $TOK"; '
        'printf "%s" "${TOK%????????????}"; sleep 0.5; printf "%s\\n" "${TOK#s3cr3t-toke}"; sleep 3; echo last'
    )
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    spec = task_from_args(num_nodes=1, run=run, secrets={"TOK": secret})
    h = b.provision("mask", spec)
    try:
        c = GangClient(b, h)
        c.launch(spec, "job")
        seen, live = b"", b""

        async def go() -> None:
            nonlocal seen, live
            async for poll in watch(c, "job", poll_interval=0.2):
                if 0 in poll.chunks:
                    seen += poll.chunks[0][1]
                if not poll.status.ranks[0].terminal and b"***" in seen:
                    live = seen

        asyncio.run(asyncio.wait_for(go(), 90))
        assert seen == b"no python here\nfirst ***\n***\nlast\n", seen
        assert live.startswith(b"no python here\nfirst ***\n"), live  # shown before the rank ended
    finally:
        b.terminate("mask")
        b.close()


@needs_sshd
def test_on_an_ssh_host_the_rank_user_masks_live_and_across_writes(tmp_path: Path) -> None:
    """An SSH host: the rank runs as the host's own user, its filter (the system's python3 there) masks a
    secret printed in two pieces and shows each line while the rank still runs."""
    import asyncio

    from airflow_provider_sky.backends.ssh import SSHBackend
    from airflow_provider_sky.runners import ssh
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.loop import watch

    secret = "s3cr3t-token-0123456789"
    run = (
        'echo "first $TOK"; printf "%s" "${TOK%????????????}"; sleep 0.5; '
        'printf "%s\\n" "${TOK#s3cr3t-toke}"; sleep 3; echo last'
    )
    with SSHDCluster(1, tmp_path) as c:
        b = SSHBackend(
            c.host_list(),
            user="",
            key_file=c.client_key_path,
            known_hosts=c.known_hosts_path,
            connect_timeout=5.0,
        )
        spec = task_from_args(num_nodes=1, run=run, secrets={"TOK": secret})
        h = b.provision("mask", spec)
        try:
            client = GangClient(b, h)
            client.launch(spec, "job")
            seen, live = b"", b""

            async def go() -> None:
                nonlocal seen, live
                async for poll in watch(client, "job", poll_interval=0.2):
                    if 0 in poll.chunks:
                        seen += poll.chunks[0][1]
                    if not poll.status.ranks[0].terminal and b"***" in seen:
                        live = seen

            asyncio.run(asyncio.wait_for(go(), 60))
            assert seen == b"first ***\n***\nlast\n", seen
            assert live.startswith(b"first ***\n"), live
        finally:
            b.terminate("mask")
            ssh.close_all()


def test_the_python_filter_masks_a_large_stream_whose_secret_bytes_come_and_go(tmp_path: Path) -> None:
    """``maskpy`` looks for one byte of each secret first and searches only a read that has it; that byte
    changes when a read has it without the secret. 12 MiB of lines (past the switch to compiled searches)
    that use each secret's bytes in some reads and not in others, the secrets on short lines, on 100 KiB
    lines at the 64 KiB cut and across reads, written in pieces of random sizes: the log is the stream
    with every secret masked, byte for byte."""
    import random
    import subprocess
    import threading

    from airflow_provider_sky.node.runtime import mask_file
    from airflow_provider_sky.node.shell import MASK_FUNC

    secrets = {"TOK": "s3cr3t-Token-0123456789", "OTHER": "another_one.42"}
    (tmp_path / "mask").write_text(mask_file(secrets))
    rnd = random.Random(7)
    plain = [b"step 12 loss 0.5 lr=1e-4\n", b"epoch done in 13s\n", b"x" * 70 + b"\n"]
    # the secrets' bytes without the secrets: an upper case T, dashes, dots, digits, underscores
    near = [b"Token count-3 s3cr3t no\n", b"another one_42 another_one 42.\n", b"T-.-_0123\n"]
    stream = bytearray()
    splits: list[int] = []
    while len(stream) < 12 << 20:
        kind = rnd.random()
        block = len(stream) >> 20
        if block % 3 == 0:  # a MiB of lines that never use the secrets' bytes
            stream += rnd.choice(plain[1:])
        elif kind < 0.01:
            s = rnd.choice(list(secrets.values())).encode()
            long = bytearray(b"y" * 100_000)
            at = rnd.choice([65536 - len(s) // 2, 65536 - len(s) + 1, 65535, rnd.randrange(99_000)])
            long[at : at + len(s)] = s
            if len(splits) < 200:  # a read that ends right after it: the 64 KiB cut falls inside it
                splits.append(len(stream) + at + len(s))
            stream += long + b"\n"
        elif kind < 0.05:
            s = rnd.choice(list(secrets.values())).encode()
            if len(splits) < 100:  # cut between two writes that the filter reads apart
                splits.append(len(stream) + 4 + rnd.randrange(1, len(s)))
            stream += b"key=" + s + b" ok\n"
        elif kind < 0.3:
            stream += rnd.choice(near)
        else:
            stream += rnd.choice(plain)
    expected = bytes(stream)
    for value in secrets.values():
        expected = expected.replace(value.encode(), b"***")
    assert expected.count(b"***") > 100
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        script = f'exec 3<"$1"; rm -f "$1"\n{MASK_FUNC}maskpy'
        p = subprocess.Popen(
            ["sh", "-c", script, "sh", str(tmp_path / "mask")],
            stdin=subprocess.PIPE,
            stdout=sink,
            env={"PATH": "/usr/bin:/bin"},
        )
    assert p.stdin is not None
    stdin = p.stdin

    def feed() -> None:
        pos, todo = 0, list(splits)
        while pos < len(stream):
            n = rnd.choice([1, 7, 4093, 65536, 300_000, 1 << 20])
            split = bool(todo) and todo[0] <= pos + n
            if split:
                n = todo.pop(0) - pos
            stdin.write(stream[pos : pos + n])
            stdin.flush()
            pos += n
            if split:
                time.sleep(0.005)  # the filter reads the secret's first part on its own
        stdin.close()

    writer = threading.Thread(target=feed)
    writer.start()
    writer.join(60)
    assert p.wait(60) == 0
    got = out.read_bytes()
    assert len(got) == len(expected) and got == expected, next(
        (i, got[i - 40 : i + 40], expected[i - 40 : i + 40])
        for i in range(min(len(got), len(expected)) + 1)
        if got[i : i + 1] != expected[i : i + 1]
    )
