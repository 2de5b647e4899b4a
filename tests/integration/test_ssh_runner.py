"""SSHRunner against real sshd daemons on loopback addresses (tests/support/sshd.py); nothing is mocked."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sshd import SSHDCluster, described, needs_sshd, settled_user_processes, user_processes

from airflow_provider_sky.runners import ssh
from airflow_provider_sky.runners.base import CALLS, RunnerError
from airflow_provider_sky.runners.ssh import (
    AuthFailed,
    CommandTimeout,
    HostKeyMismatch,
    HostUnreachable,
    SSHNodeConfig,
    SSHRunner,
    UnknownHostKey,
    hostkeys,
    pool,
    transport,
    wait_for_ssh,
)

pytestmark = needs_sshd


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., SSHDCluster]]:
    """Start clusters on demand; afterwards nothing they started may be left running."""
    clusters: list[SSHDCluster] = []

    def make(n: int, **kwargs: Any) -> SSHDCluster:
        cluster = SSHDCluster(n, tmp_path, **kwargs)
        clusters.append(cluster)
        return cluster.__enter__()

    CALLS.reset()
    yield make
    ssh.close_all()
    try:
        # looked at before the clusters stop: a stopped cluster's block (its users) is free for another
        # test's cluster at once, whose processes would be counted here
        for cluster in clusters:
            for node in cluster.nodes:  # the connections closed: their sessions end, nothing else runs
                left = settled_user_processes(node.user)
                assert not left, f"processes of {node.user} left behind: {described(left)}"
    finally:
        for cluster in clusters:
            cluster.stop()
    for cluster in clusters:
        assert "sshd" not in cluster.leftover_processes()
        for node in cluster.nodes:
            assert not _listening(node.host, node.port), f"sshd still listening on {node.host}:{node.port}"


@pytest.fixture
def cluster4(make_cluster: Callable[..., SSHDCluster]) -> SSHDCluster:
    return make_cluster(4)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _cmdlines(user: str) -> list[bytes]:
    """Command lines of ``user``'s live processes (ones exiting meanwhile are skipped)."""
    out = []
    for pid in user_processes(user):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    return out


def _runners(cluster: SSHDCluster, **overrides: Any) -> list[SSHRunner]:
    return [SSHRunner(cluster.node_config(i, **overrides)) for i in range(len(cluster.nodes))]


def _exists(cluster: SSHDCluster, i: int, path: str) -> bool:
    """Checked with a fresh, correctly configured runner."""
    probe = SSHRunner(cluster.node_config(i))
    try:
        return probe.run_script('test -e "$1"', [path]).returncode == 0
    finally:
        probe.close()


# --------------------------------------------------------------------------------------------- basics


def test_each_host_is_itself(cluster4: SSHDCluster) -> None:
    script = 'printf "%s|%s|%s\\n" "$(whoami)" "$HOME" "$(cat ~/node)"; echo "err-$(whoami)" >&2; exit $((10 + $(cat ~/node)))'
    for i, runner in enumerate(_runners(cluster4)):
        node = cluster4.nodes[i]
        result = runner.run_script(script)
        assert result.returncode == 10 + i
        assert result.text == f"{node.user}|{node.home}|{i}\n"
        assert result.stderr == f"err-{node.user}\n".encode()
    assert len({n.user for n in cluster4.nodes}) == 4
    assert len({n.host for n in cluster4.nodes}) == 4
    assert dict(CALLS.counts) == {n.host: 1 for n in cluster4.nodes}


def test_args_and_script_arrive_verbatim(cluster4: SSHDCluster) -> None:
    canary = "~/canary"
    args = [
        "plain",
        "",
        "with space",
        "'single' \"double\"",
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"; touch {canary}",
        f"' ; touch {canary}; '",
        f'" ; touch {canary}; "',
        f"a\nb\ntouch {canary}",
        "$HOME ${PATH} \\ \\n * ? [a] ~",
        "-e",
        "--",
        "héllo wörld ☃ 日本",
    ]
    script = 'for a in "$@"; do printf "%s\\0" "$a"; done\n# ünïcode in the script itself: ✓\n'
    for i, runner in enumerate(_runners(cluster4)):
        result = runner.run_script(script, args)
        assert result.returncode == 0, result.error_text
        assert result.stdout.split(b"\0")[:-1] == [a.encode() for a in args]
        assert not _exists(cluster4, i, f"{cluster4.nodes[i].home}/canary")


def test_large_output_on_both_streams_and_large_stdin(cluster4: SSHDCluster) -> None:
    """Both streams far beyond the 2 MiB channel window, interleaved: reading one only would deadlock."""
    runner = SSHRunner(cluster4.node_config(0))
    script = "i=0; while [ $i -lt 40 ]; do head -c 131072 /dev/zero; head -c 131072 /dev/zero >&2; i=$((i+1)); done"
    result = runner.run_script(script, timeout=60)
    assert result.returncode == 0
    assert len(result.stdout) == len(result.stderr) == 40 * 131072
    big = "x" * (3 * 1024 * 1024)
    result = runner.run_script(f": <<'EOF'\n{big}\nEOF\necho done; head -c 3000000 /dev/zero", timeout=60)
    assert result.returncode == 0
    assert result.stdout.startswith(b"done\n") and len(result.stdout) == 5 + 3000000


def test_timeout_and_signal_exit(cluster4: SSHDCluster) -> None:
    runner = SSHRunner(cluster4.node_config(1))
    start = time.monotonic()
    with pytest.raises(CommandTimeout, match="still running after 0.5s"):
        runner.run_script("sleep 20", timeout=0.5)
    assert time.monotonic() - start < 3
    # the timed-out script was signalled (sshd killpg's the session), not left running
    deadline = time.monotonic() + 5
    while any(b"sleep" in cmd for cmd in _cmdlines(cluster4.nodes[1].user)):
        assert time.monotonic() < deadline, "timed-out script still running"
        time.sleep(0.02)
    # killed by a signal: sshd sends exit-signal, reported like subprocess does (-N)
    assert runner.run_script("kill -KILL $$").returncode == -9
    assert runner.run_script("kill -TERM $$").returncode == -15
    assert runner.run_script("echo still fine").text == "still fine\n"


def test_secrets_stay_out_of_repr_and_logs(cluster4: SSHDCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = cluster4.node_config(0, passphrase="hunter2")
    body = cluster4.client_key_text.splitlines()[2]  # a line of the private key's base64 body
    assert body not in repr(cfg) and "hunter2" not in repr(cfg)
    runner = SSHRunner(cluster4.node_config(0))
    assert runner.run_script("true").returncode == 0
    assert body not in caplog.text


# --------------------------------------------------------------------------------------------- concurrency


def test_seed_concurrency_one_shared_transport_per_host(cluster4: SSHDCluster) -> None:
    """The seed's check: 20 concurrent commands x 10 rounds per host, all on one transport per host."""
    runners = _runners(cluster4, max_sessions=32)  # really 20 channels at once on each transport
    with ThreadPoolExecutor(max_workers=80) as pool:
        for rnd in range(10):
            futures = [
                (i, k, pool.submit(r.run_script, 'echo "$(whoami) $1"', [f"{rnd}-{k}"]))
                for i, r in enumerate(runners)
                for k in range(20)
            ]
            for i, k, fut in futures:
                result = fut.result(timeout=60)
                assert result.returncode == 0, result.error_text
                assert result.text == f"{cluster4.nodes[i].user} {rnd}-{k}\n"
    info = ssh.pool_info()
    assert sorted(p.host for p in info) == sorted(n.host for n in cluster4.nodes)
    assert all(p.connects == 1 and p.active for p in info), info
    assert CALLS.total() == 4 * 20 * 10


def test_async_fan_out_does_not_block_the_loop(cluster4: SSHDCluster) -> None:
    threads: set[str] = set()

    class Recording(SSHRunner):
        def run_script(self, *a: Any, **kw: Any) -> Any:
            threads.add(threading.current_thread().name)
            return super().run_script(*a, **kw)

    runners = [Recording(cluster4.node_config(i)) for i in range(4)]  # default max_sessions=10: queues

    async def main() -> tuple[list[Any], int, float]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.02)

        tick_task = asyncio.create_task(ticker())
        start = time.monotonic()
        slow = asyncio.create_task(runners[0].arun_script("sleep 1; echo slept"))
        results = await asyncio.gather(
            *(r.arun_script('echo "$1 $(whoami)"', [str(k)]) for r in runners for k in range(20))
        )
        assert (await slow).text == "slept\n"
        elapsed = time.monotonic() - start
        stop.set()
        await tick_task
        return results, ticks, elapsed

    results, ticks, elapsed = asyncio.run(main())
    assert len(results) == 80
    for idx, result in enumerate(results):
        i, k = divmod(idx, 20)
        assert result.text == f"{k} {cluster4.nodes[i].user}\n"
    assert elapsed >= 1.0
    assert ticks >= 25, f"event loop starved: {ticks} ticks in {elapsed:.2f}s"
    assert threads and all(name.startswith("sky-ssh") for name in threads), threads


def test_sixteen_hosts_fan_out(make_cluster: Callable[..., SSHDCluster]) -> None:
    cluster = make_cluster(16)
    runners = _runners(cluster)

    async def main() -> list[Any]:
        return await asyncio.gather(*(r.arun_script("whoami") for r in runners))

    results = asyncio.run(main())
    assert [r.text.strip() for r in results] == [n.user for n in cluster.nodes]
    assert len(ssh.pool_info()) == 16


def test_handshakes_bounded_below_max_startups(
    make_cluster: Callable[..., SSHDCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 distinct connections to ONE sshd at once (MaxStartups 10:30:100), no retries: sshd drops none."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    cluster = make_cluster(1)
    node = cluster.nodes[0]
    keys = [Ed25519PrivateKey.generate() for _ in range(24)]
    with open(Path(node.home) / ".ssh" / "authorized_keys", "a") as fh:
        for key in keys:
            pub = key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            fh.write(pub.decode() + "\n")

    class Counting:
        """Wraps a semaphore and records the most holders seen at once."""

        def __init__(self, inner: threading.BoundedSemaphore) -> None:
            self.inner, self.now, self.peak, self.lock = inner, 0, 0, threading.Lock()

        def __enter__(self) -> None:
            self.inner.acquire()
            with self.lock:
                self.now += 1
                self.peak = max(self.peak, self.now)

        def __exit__(self, *exc: object) -> None:
            with self.lock:
                self.now -= 1
            self.inner.release()

    overall = Counting(transport._HANDSHAKES)
    this_host = Counting(threading.BoundedSemaphore(transport.MAX_HANDSHAKES_PER_HOST))
    monkeypatch.setattr(transport, "_HANDSHAKES", overall)
    monkeypatch.setitem(transport._HOST_HANDSHAKES, (node.host, node.port), this_host)
    texts = [
        k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ).decode()
        for k in keys
    ]
    runners = [SSHRunner(cluster.node_config(0, private_key=t, connect_attempts=1)) for t in texts]
    with ThreadPoolExecutor(max_workers=24) as pool:
        results = list(pool.map(lambda r: r.run_script("echo ok"), runners))
    assert all(r.text == "ok\n" for r in results)
    assert len(ssh.pool_info()) == 24  # one transport per client key
    assert 1 <= this_host.peak <= transport.MAX_HANDSHAKES_PER_HOST < 10
    assert overall.peak <= transport.MAX_CONCURRENT_HANDSHAKES
    assert "past MaxStartups" not in cluster.logs(0)


# --------------------------------------------------------------------------------------------- trust


def test_host_key_mismatch_runs_nothing(cluster4: SSHDCluster, tmp_path: Path) -> None:
    node0, node1 = cluster4.nodes[0], cluster4.nodes[1]
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"{node0.known_hosts_name} {node1.host_pubkey}\n")  # node 1's key under node 0's name
    runner = SSHRunner(cluster4.node_config(0, known_hosts=str(wrong)))
    with pytest.raises(HostKeyMismatch) as err:
        runner.run_script("touch ~/canary")
    message = str(err.value)
    assert node0.host in message and str(node0.port) in message
    assert err.value.host == node0.host
    expected_fp = hostkeys.parse_public_key(node1.host_pubkey).fingerprint
    seen_fp = hostkeys.parse_public_key(node0.host_pubkey).fingerprint
    assert expected_fp in message and seen_fp in message
    assert "known_hosts" in message and "pinned" in message
    assert "Accepted publickey" not in cluster4.logs(0)  # refused before authenticating
    assert not _exists(cluster4, 0, f"{node0.home}/canary")

    # pinned keys are checked the same way; the right pin works without any known_hosts entry
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    pinned_wrong = SSHRunner(
        cluster4.node_config(0, known_hosts=str(empty), pinned_host_keys=(node1.host_pubkey,))
    )
    with pytest.raises(HostKeyMismatch):
        pinned_wrong.run_script("touch ~/canary")
    assert not _exists(cluster4, 0, f"{node0.home}/canary")
    pinned_ok = SSHRunner(
        cluster4.node_config(0, known_hosts=str(empty), pinned_host_keys=(node0.host_pubkey,))
    )
    assert pinned_ok.run_script("whoami").text == f"{node0.user}\n"
    # a transport already open does not let a runner with a wrong key list ride along
    with pytest.raises(HostKeyMismatch):
        SSHRunner(cluster4.node_config(0, known_hosts=str(wrong))).run_script("touch ~/canary")
    assert not _exists(cluster4, 0, f"{node0.home}/canary")


def test_unknown_host_accept_new_and_skip(
    cluster4: SSHDCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = cluster4.nodes[2]
    fresh = tmp_path / "sub" / "known_hosts"
    with pytest.raises(UnknownHostKey) as err:
        SSHRunner(cluster4.node_config(2, known_hosts=str(fresh))).run_script("touch ~/canary")
    for part in (node.host, "known_hosts", "pin", "accept-new"):
        assert part in str(err.value)
    assert not _exists(cluster4, 2, f"{node.home}/canary")

    accept = SSHRunner(cluster4.node_config(2, known_hosts=str(fresh), host_key_policy="accept-new"))
    assert accept.run_script("whoami").text == f"{node.user}\n"
    assert fresh.read_text() == f"{node.known_hosts_name} {node.host_pubkey}\n"
    ssh.close_all()
    verify = SSHRunner(cluster4.node_config(2, known_hosts=str(fresh)))
    assert verify.run_script("whoami").text == f"{node.user}\n"
    # accept-new still refuses a changed key
    ssh.close_all()
    fresh.write_text(f"{node.known_hosts_name} {cluster4.nodes[3].host_pubkey}\n")
    with pytest.raises(HostKeyMismatch):
        SSHRunner(cluster4.node_config(2, known_hosts=str(fresh), host_key_policy="accept-new")).run_script(
            "true"
        )

    ssh.close_all()
    monkeypatch.setattr(hostkeys, "_SKIP_WARNED", set())  # "once per host" is per process
    caplog.set_level(logging.WARNING, logger="airflow_provider_sky.runners.ssh")
    skip_cfg = cluster4.node_config(3, known_hosts=str(tmp_path / "none"), host_key_policy="skip")
    for _ in range(3):
        assert SSHRunner(skip_cfg).run_script("whoami").text == f"{cluster4.nodes[3].user}\n"
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "host key checking is disabled" in r.getMessage()
    ]
    assert len(warnings) == 1 and cluster4.nodes[3].host in warnings[0].getMessage()


def test_wrong_client_key_is_auth_failed(cluster4: SSHDCluster, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    node = cluster4.nodes[1]
    runner = SSHRunner(cluster4.node_config(1, private_key=None, key_file=str(other)))
    with pytest.raises(AuthFailed) as err:
        runner.run_script("touch ~/canary")
    message = str(err.value)
    assert node.host in message and node.user in message and "rejected" in message
    assert err.value.user == node.user
    for line in other.read_text().splitlines()[1:-1]:
        assert line not in message
    # a node's key only opens that node: node 0's user on node 1 is refused (AllowUsers)
    with pytest.raises(AuthFailed):
        SSHRunner(cluster4.node_config(1, user=cluster4.nodes[0].user)).run_script("true")
    assert not _exists(cluster4, 1, f"{node.home}/canary")


# --------------------------------------------------------------------------------------------- failures


def test_unreachable_host(make_cluster: Callable[..., SSHDCluster]) -> None:
    cluster = make_cluster(1)
    dead = f"127.0.{cluster.block}.200"  # inside our claimed block: nothing listens there
    start = time.monotonic()
    with pytest.raises(HostUnreachable) as err:
        wait_for_ssh(dead, cluster.nodes[0].port, timeout=1.0)
    waited = time.monotonic() - start
    assert 1.0 <= waited < 2.5
    assert f"{dead}:{cluster.nodes[0].port}" in str(err.value) and "1s" in str(err.value)
    # a port that accepts TCP but never speaks SSH is not "ready" either
    with socket.socket() as silent:
        silent.bind((f"127.0.{cluster.block}.201", 0))
        silent.listen()
        with pytest.raises(HostUnreachable, match="within 0.5s"):
            wait_for_ssh(f"127.0.{cluster.block}.201", silent.getsockname()[1], timeout=0.5)
    # the runner reports the same failure, after its bounded reconnect attempts
    cfg = SSHNodeConfig(
        dead,
        user="nobody",
        port=cluster.nodes[0].port,
        private_key=cluster.client_key_text,
        connect_attempts=2,
        connect_timeout=1.0,
    )
    with pytest.raises(HostUnreachable, match="after 2 attempts"):
        SSHRunner(cfg).run_script("true")
    assert 0 <= wait_for_ssh(cluster.nodes[0].host, cluster.nodes[0].port, timeout=5) < 1


def test_dropped_connection_reconnects(cluster4: SSHDCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = SSHRunner(cluster4.node_config(0))
    user = cluster4.nodes[0].user
    assert runner.run_script("whoami").text == f"{user}\n"

    cluster4.kill_sessions(0)  # the connection's sshd session process dies; sshd keeps listening
    assert runner.run_script("whoami").text == f"{user}\n"
    assert ssh.pool_info()[0].connects == 2

    # a command in flight when the node dies fails fast as a transport error, not a hang
    result: list[BaseException] = []

    def long_call() -> None:
        try:
            runner.run_script("sleep 30")
        except BaseException as e:  # handed to the test thread
            result.append(e)

    t = threading.Thread(target=long_call)
    t.start()
    deadline = time.monotonic() + 5
    while not any(b"sleep" in cmd for cmd in _cmdlines(user)):
        assert time.monotonic() < deadline, "sleep never started"
        time.sleep(0.02)
    cluster4.kill_node(0)
    t.join(10)
    assert not t.is_alive()
    assert result and isinstance(result[0], RunnerError) and not isinstance(result[0], CommandTimeout)
    assert cluster4.leftover_processes().get(user) is None

    cluster4.restart_node(0)  # same address and host key
    assert runner.run_script("whoami").text == f"{user}\n"
    assert ssh.pool_info()[0].connects == 3

    ssh.close_all()  # a runner still holding the closed entry rejoins the pool on its next call
    assert ssh.pool_info() == []
    assert runner.run_script("whoami").text == f"{user}\n"
    assert [(p.host, p.refs, p.connects) for p in ssh.pool_info()] == [(cluster4.nodes[0].host, 1, 1)]

    runner.close()  # released; closed once idle for IDLE_TTL, swept when the pool is next used
    assert ssh.pool_info()[0].refs == 0
    monkeypatch.setattr(pool, "IDLE_TTL", 0.0)
    assert SSHRunner(cluster4.node_config(1)).run_script("true").returncode == 0
    assert [p.host for p in ssh.pool_info()] == [cluster4.nodes[1].host]


# --------------------------------------------------------------------------------------------- files


def test_put_tree_and_put_file(cluster4: SSHDCluster, tmp_path: Path) -> None:
    src = tmp_path / "workdir"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran $(whoami)\n")
    (src / "sub" / "run.sh").chmod(0o755)
    (src / "sub" / "deeper" / "ü.txt").write_text("unicode name\n")
    (src / "link.txt").symlink_to("a.txt")
    (src / "linkdir").symlink_to("sub")
    (src / "loop").symlink_to(".")  # must not recurse forever

    node = cluster4.nodes[0]
    runner = SSHRunner(cluster4.node_config(0))
    sent = runner.put_tree(src, "~/work")
    assert sent >= 5
    check = runner.run_script(
        "cd ~/work && cat a.txt && sub/run.sh && cat sub/deeper/ü.txt && "
        "test ! -L link.txt && cat link.txt && test ! -L linkdir && linkdir/run.sh && "
        "stat -c %a sub/run.sh a.txt && pwd"
    )
    assert check.returncode == 0, check.error_text
    assert check.text.splitlines() == [
        "alpha",
        f"ran {node.user}",
        "unicode name",
        "alpha",
        f"ran {node.user}",
        "755",
        "644",
        f"{node.home}/work",
    ]
    assert not _exists(cluster4, 1, f"{cluster4.nodes[1].home}/work")  # only node 0 got it

    runner.put_file(src / "a.txt", "~/x/y/z.txt", mode=0o600)
    runner.put_file(src / "sub" / "run.sh", f"{node.home}/abs/run.sh")
    out = runner.run_script("stat -c %a ~/x/y/z.txt ~/abs/run.sh && cat ~/x/y/z.txt").text
    assert out.splitlines() == ["600", "755", "alpha"]


# ------------------------------------------------------------------------------------------- the relay


def test_a_relay_flooded_with_silent_clients_leaves_the_hosts_sessions_to_other_calls(
    make_cluster: Callable[..., SSHDCluster],
) -> None:
    """An EC2 head's agent is reached through a relay (an SSH session per connection). 12 local clients
    connect and say nothing, more than sshd's MaxSessions (10): the relay holds a few sessions at most,
    so a script on the host still runs at once, and each held session is freed as soon as the node's
    side drops its silent client (the agent does after its 5 s handshake; this server after 1 s)."""
    from airflow_provider_sky.runners.ssh.relay import MAX_RELAYED, Relay

    cluster = make_cluster(1)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    def one(conn: socket.socket) -> None:  # echo; a client silent for 1 s is dropped
        with conn:
            conn.settimeout(1.0)
            try:
                while data := conn.recv(4096):
                    conn.sendall(data)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    runner = SSHRunner(cluster.node_config(0))
    relay = Relay(runner, port)
    clients = [socket.create_connection(relay.address, 5) for _ in range(12)]
    try:
        time.sleep(0.5)
        with ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            assert pool.submit(runner.run_script, "echo ok").result(timeout=10).text == "ok\n"
            assert time.monotonic() - t0 < 5.0  # not behind the silent clients
        # the node's side dropped them: their sessions are free, and a client that speaks gets through
        for c in clients[:MAX_RELAYED]:
            c.settimeout(5)
            assert c.recv(1) == b""
        talker = socket.create_connection(relay.address, 5)
        talker.settimeout(15)  # past the silent ones still waiting for a session (1 s each)
        talker.sendall(b"ping")
        assert talker.recv(4) == b"ping"
        talker.close()
    finally:
        for c in clients:
            c.close()
        relay.close()
        server.close()
        runner.close()


def test_a_call_made_after_close_gives_its_connection_back(
    make_cluster: Callable[..., SSHDCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread a runner's owner leaves running (an abandoned call, a relay's client waiting for a
    session) may call the runner after ``close()``: the call runs, and the pooled connection is then
    closed once idle like any other, not held open for the life of the process (a triggerer's)."""
    monkeypatch.setattr(pool, "IDLE_TTL", 0.5)
    cluster = make_cluster(1)
    user = cluster.nodes[0].user
    runner = SSHRunner(cluster.node_config(0))
    assert runner.run_script("echo a").text == "a\n"
    runner.close()
    assert runner.run_script("echo b").text == "b\n"  # the late call
    assert [row.refs for row in ssh.pool_info()] == [0]
    # the idle sweep (every IDLE_TTL / 4 once the last reference goes) closes it: the session ends
    deadline = time.monotonic() + 20
    while ssh.pool_info() or user_processes(user):
        assert time.monotonic() < deadline, (ssh.pool_info(), described(user_processes(user)))
        time.sleep(0.1)
