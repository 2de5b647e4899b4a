"""Real ``sshd`` test hosts on loopback addresses, one daemon, host key, user and home per node.

Why real daemons: the SSH runner's risks (host key trust, auth errors, channel multiplexing, sshd's
``MaxStartups`` / ``MaxSessions``, dropped connections) only show against OpenSSH itself.

Address plan: Linux routes all of 127.0.0.0/8 to ``lo``, so node ``i`` of a cluster listens on
``127.0.<k>.<i+1>``. The block ``k`` (20..249) is claimed with an ``flock`` on
``/tmp/sky-sshd-blocks/block-<k>.lock`` held for the cluster's life, so concurrent clusters (another
fixture, another pytest process) never share addresses or users; a crashed holder releases its lock when
its process dies. Node ``i``'s login user is ``sky<k>n<i>`` (created once with ``useradd``, reused), so
killing "every process of that node's user" never touches another cluster. All nodes of a cluster share
one port, free on every address (``port=None``), or the port you pass (e.g. 22).

Fake GPUs (``gpus={i: [...]}`` / ``rocm_gpus={i: [...]}``): node ``i`` gets the fake ``nvidia-smi`` /
``rocm-smi`` of ``tests/fakes`` in ``~/.fake-bin`` of its user, its GPU list in ``~/.fake-nvidia-smi-gpus``
/ ``~/.fake-rocm-smi-gpus``, and its sshd puts ``~/.fake-bin`` first on the sessions' PATH (``SetEnv``).
Nodes not named have no GPU tool at all, as before.

Needs root and ``openssh-server`` (``/usr/sbin/sshd``, ``ssh-keygen``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest

from airflow_provider_sky.runners.ssh import HostUnreachable, SSHNodeConfig, wait_for_ssh

if TYPE_CHECKING:
    from airflow_provider_sky.backends.ssh import SSHBackend

#: The sshd binary (sshd wants an absolute path). ``SKY_TEST_SSHD`` overrides it; a path that does not
#: exist plays a machine without openssh-server (how the missing-tools summary is checked).
SSHD = os.environ.get("SKY_TEST_SSHD") or (
    "/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else shutil.which("sshd") or "/usr/sbin/sshd"
)


def missing_packages() -> list[str]:
    """The Debian packages of the tools these hosts need that this machine lacks (``make system-deps``)."""
    missing = []
    if not os.path.exists(SSHD):
        missing.append("openssh-server")
    if not shutil.which("ssh-keygen"):
        missing.append("openssh-client")
    if not (shutil.which("useradd") or os.path.exists("/usr/sbin/useradd")):
        missing.append("passwd")
    return missing


def _skip() -> tuple[str, str]:
    """(skip reason, the one command that fixes it); ("", "") when the SSH tests can run."""
    missing = missing_packages()
    install = f"apt-get update && apt-get install -y --no-install-recommends {' '.join(missing)}"
    if os.geteuid() != 0:
        need = "root" + (f" and {', '.join(missing)}" if missing else "")
        # as root, `make test` installs the missing packages itself (the system-deps target)
        return f"needs {need} (it starts sshd daemons and creates users)", "sudo make test"
    if missing:
        where = f" ({SSHD} not found)" if "openssh-server" in missing else ""
        return f"needs {', '.join(missing)}{where}", install
    return "", ""


#: why the SSH tests are skipped on this machine and the command that fixes it (the conftest's summary
#: lists the skipped tests with it); both "" when they can run
SKIP_REASON, FIX_COMMAND = _skip()

#: mark for a test module that starts sshd hosts
needs_sshd = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "sshd hosts available")

LOCK_DIR = Path(tempfile.gettempdir()) / "sky-sshd-blocks"
FAKES = Path(__file__).resolve().parents[1] / "fakes"
#: what a session's PATH is without SetEnv (OpenSSH's default for a non-root user)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/games"
BLOCKS = range(20, 250)


@dataclass
class _Proc:
    pid: int
    ppid: int
    uid: int
    state: str


def _field(status: bytes, key: bytes) -> bytes:
    """The value of ``key`` in a ``/proc/PID/status`` text (never its first line, ``Name``)."""
    start = status.index(b"\n" + key + b":") + len(key) + 2
    return status[start : status.index(b"\n", start)].strip()


def _processes() -> list[_Proc]:
    """Every live process from /proc (zombies included; callers decide).

    The leak checks of the SSH tests scan /proc once per host user: the fields are found in the raw
    status text rather than parsed line by line."""
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
            procs.append(
                _Proc(
                    pid=int(name),
                    ppid=int(_field(status, b"PPid")),
                    uid=int(_field(status, b"Uid").split()[0]),
                    state=_field(status, b"State").split()[0].decode(),
                )
            )
        except (OSError, ValueError, IndexError):
            continue
    return procs


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ("" once it is gone)."""
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        )
    except OSError:
        return ""


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state, ppid, pgrp, ... (OSError once gone)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def described(pids: list[int]) -> str:
    """Each pid with its state, parent (and the parent's command) and command line: what a leak check
    prints, so that a process left behind says what it was."""
    out = []
    for pid in pids:
        try:
            stat = _stat(pid)
        except OSError:
            out.append(f"{pid}: gone")
            continue
        out.append(
            f"{pid} (state {stat[0]}, parent {stat[1]}: {cmdline(int(stat[1]))[:80]!r}): {cmdline(pid)[:200]!r}"
        )
    return "; ".join(out)


def _exiting(pid: int) -> bool:
    """Whether the process is on its way out (``PF_EXITING`` in its flags): past its exit, before it is a
    zombie; its command line already reads empty. On a loaded machine it can stay so for a while."""
    try:
        flags = int(_stat(pid)[6])
    except (OSError, IndexError, ValueError):
        return True  # gone
    return bool(flags & 0x4)


def user_processes(user: str) -> list[int]:
    """Running pids owned by ``user``: what ``pgrep -u`` shows, minus zombies and processes exiting."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return []
    return [p.pid for p in _processes() if p.uid == uid and p.state != "Z" and not _exiting(p.pid)]


def settled_user_processes(user: str, timeout: float = 10.0) -> list[int]:
    """``user``'s processes once it has none (their sessions end after the connections close), or what
    is still there after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while (left := user_processes(user)) and time.time() < deadline:
        time.sleep(0.1)
    return left


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in _processes():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill(pids: list[int]) -> None:
    _signal(pids, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _ensure_user(name: str) -> pwd.struct_passwd:
    """Create a login user once (idempotent across runs and processes); ``*`` password = key-only, unlocked."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / "useradd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pwd.getpwnam(name)
        except KeyError:
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            useradd = shutil.which("useradd") or "/usr/sbin/useradd"  # /usr/sbin may be off PATH
            _run(useradd, "--create-home", "--shell", shell, "--password", "*", name)
            return pwd.getpwnam(name)


def _keygen(path: Path, comment: str) -> str:
    """ed25519 key pair at ``path``; returns the public line without its comment."""
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@dataclass
class SSHDNode:
    """One test host."""

    index: int
    host: str
    port: int
    user: str
    home: str
    host_pubkey: str  # "ssh-ed25519 AAAA..." for pinning
    dir: Path
    #: fake GPUs of this host: lines for the fake nvidia-smi / rocm-smi ("NVIDIA H100 80GB HBM3, 81559")
    gpus: tuple[str, ...] = ()
    rocm_gpus: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def log_path(self) -> Path:
        return self.dir / "sshd.log"


class SSHDCluster:
    """N real sshd daemons; use as a context manager (``stop()`` runs on errors too)."""

    def __init__(
        self,
        n: int,
        base_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        gpus: Mapping[int, Sequence[str]] | None = None,
        rocm_gpus: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        if not 1 <= n <= 250:
            raise ValueError("1 <= n <= 250")
        if os.geteuid() != 0:
            raise RuntimeError("SSHDCluster needs root (it starts sshd and creates test users)")
        if not os.path.exists(SSHD):
            raise RuntimeError(f"{SSHD} missing: apt-get install -y openssh-server")
        self.n = n
        self.requested_port = port
        self.gpus = {i: tuple(v) for i, v in (gpus or {}).items()}
        self.rocm_gpus = {i: tuple(v) for i, v in (rocm_gpus or {}).items()}
        self.block: int | None = None
        self._block_lock: IO[str] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="sshd-cluster-", dir=base_dir))
        self.nodes: list[SSHDNode] = []
        self.client_key_path = str(self.dir / "client_ed25519")
        self.client_key_text = ""
        self.client_pubkey = ""
        self.known_hosts_path = str(self.dir / "known_hosts")

    # -- lifecycle

    def __enter__(self) -> SSHDCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SSHDCluster:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        self._claim_block()
        assert self.block is not None
        hosts = [f"127.0.{self.block}.{i + 1}" for i in range(self.n)]
        port = self.requested_port if self.requested_port is not None else self._free_port(hosts)
        self.client_pubkey = _keygen(Path(self.client_key_path), "sky-test-client")
        self.client_key_text = Path(self.client_key_path).read_text()
        for i, host in enumerate(hosts):
            user = f"sky{self.block}n{i}"
            pw = _ensure_user(user)
            _kill(user_processes(user))  # leftovers of a crashed earlier holder of this block
            node_dir = self.dir / f"node{i}"
            node_dir.mkdir()
            host_pub = _keygen(node_dir / "ssh_host_ed25519_key", f"{user}-hostkey")
            node = SSHDNode(
                i,
                host,
                port,
                user,
                pw.pw_dir,
                host_pub,
                node_dir,
                self.gpus.get(i, ()),
                self.rocm_gpus.get(i, ()),
            )
            self._reset_home(node, pw)
            self._write_config(node)
            self.nodes.append(node)
        Path(self.known_hosts_path).write_text(
            "".join(f"{node.known_hosts_name} {node.host_pubkey}\n" for node in self.nodes)
        )
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait_ready(node)
        return self

    def stop(self) -> None:
        """Kill every sshd and every process of the cluster's users; remove keys, configs, homes' content."""
        for node in self.nodes:
            self._kill_node(node)
        for node in self.nodes:
            with contextlib.suppress(OSError):
                self._clear_home(node.home)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._block_lock is not None:
            self._block_lock.close()  # releases the flock
            self._block_lock = None

    # -- node loss and recovery

    def kill_node(self, i: int) -> None:
        """Node loss: SIGKILL its sshd (and per-connection sshd children) and every process of its user."""
        self._kill_node(self.nodes[i])

    def restart_node(self, i: int) -> None:
        """Start node ``i``'s sshd again (same address, host key and home) and wait until it answers."""
        node = self.nodes[i]
        self._kill_node(node)
        self._spawn(node)
        self._wait_ready(node)

    def kill_sessions(self, i: int) -> None:
        """Drop node ``i``'s live SSH connections (kill its user's processes) but keep sshd listening."""
        node = self.nodes[i]
        self._kill_until_gone(node.user, [])

    def leftover_processes(self) -> dict[str, list[int]]:
        """Non-zombie processes still alive that this cluster started: ``{"sshd": [...], user: [...]}``."""
        out: dict[str, list[int]] = {}
        sshd = [n.proc.pid for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        if sshd:
            out["sshd"] = sshd
        for node in self.nodes:
            pids = user_processes(node.user)
            if pids:
                out[node.user] = pids
        return out

    def host_list(self) -> list[str]:
        """``user@host:port`` of every node, head first: the hosts of a ``sky_ssh`` connection."""
        return [f"{n.user}@{n.host}:{n.port}" for n in self.nodes]

    def ssh_backend(self, hosts: list[str] | None = None, **overrides: Any) -> SSHBackend:
        """An ``SSHBackend`` over these hosts (``hosts``: some of them) with the test client key, its
        known_hosts and short timeouts; ``overrides`` are the backend's own arguments."""
        from airflow_provider_sky.backends.ssh import SSHBackend

        args: dict[str, Any] = {
            "user": "",
            "key_file": self.client_key_path,
            "known_hosts": self.known_hosts_path,
            "connect_timeout": 5.0,
            "ready_timeout": 5.0,
            **overrides,
        }
        return SSHBackend(self.host_list() if hosts is None else hosts, **args)

    def sky_ssh_connection(self, **extra_fields: Any) -> str:
        """A ``sky_ssh`` connection over every node, as JSON for an ``AIRFLOW_CONN_*`` variable."""
        extra = {"key_file": self.client_key_path, "known_hosts": self.known_hosts_path, **extra_fields}
        return json.dumps({"conn_type": "sky_ssh", "host": ",".join(self.host_list()), "extra": extra})

    def rank_processes(self) -> dict[str, list[tuple[int, str]]]:
        """Per host user: every live process that is not an SSH session (rank wrappers, commands)."""
        out = {}
        for n in self.nodes:
            procs = [(p, cmdline(p)) for p in user_processes(n.user)]
            procs = [(p, c) for p, c in procs if not c.startswith("sshd:")]
            if procs:
                out[n.user] = procs
        return out

    def node_config(self, i: int, **overrides: Any) -> SSHNodeConfig:
        """An SSHNodeConfig for node ``i`` trusting the cluster's known_hosts with the test client key."""
        node = self.nodes[i]
        kwargs: dict[str, Any] = {
            "user": node.user,
            "port": node.port,
            "private_key": self.client_key_text,
            "known_hosts": self.known_hosts_path,
            "connect_timeout": 5.0,
        }
        kwargs.update(overrides)
        return SSHNodeConfig(node.host, **kwargs)

    def logs(self, i: int) -> str:
        try:
            return self.nodes[i].log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- internals

    def _claim_block(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for k in BLOCKS:
            fh = open(LOCK_DIR / f"block-{k}.lock", "w")  # held open for the cluster's life
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            self.block, self._block_lock = k, fh
            return
        raise RuntimeError(f"all loopback blocks 127.0.{BLOCKS.start}-{BLOCKS.stop - 1}.x are in use")

    @staticmethod
    def _free_port(hosts: list[str]) -> int:
        """A port every host address can bind (the kernel picks it on the first, the rest must agree)."""
        for _ in range(50):
            socks: list[socket.socket] = []
            try:
                first = socket.socket()
                socks.append(first)
                first.bind((hosts[0], 0))
                port = first.getsockname()[1]
                for host in hosts[1:]:
                    s = socket.socket()
                    socks.append(s)
                    s.bind((host, port))
                return int(port)
            except OSError:
                continue
            finally:
                for s in socks:
                    s.close()
        raise RuntimeError("no port is free on every test address")

    @staticmethod
    def _clear_home(home: str) -> None:
        for entry in os.scandir(home):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _reset_home(self, node: SSHDNode, pw: pwd.struct_passwd) -> None:
        """Fresh state per cluster: empty home with only this client's key authorized."""
        home = Path(pw.pw_dir)
        home.mkdir(mode=0o700, exist_ok=True)
        self._clear_home(str(home))
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        (ssh_dir / "authorized_keys").write_text(self.client_pubkey + "\n")
        (home / "node").write_text(f"{node.index}\n")
        for path in (home, ssh_dir, ssh_dir / "authorized_keys", home / "node"):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(ssh_dir / "authorized_keys", 0o600)
        if node.gpus or node.rocm_gpus:
            self._install_fake_gpus(node, pw)

    @staticmethod
    def _install_fake_gpus(node: SSHDNode, pw: pwd.struct_passwd) -> None:
        """The fake GPU tools in the user's own ``~/.fake-bin`` (the test tree may not be readable by
        them), with this host's GPU lists; ``_write_config`` puts the directory on the sessions' PATH."""
        home = Path(pw.pw_dir)
        bin_dir = home / ".fake-bin"
        bin_dir.mkdir(mode=0o755)
        made = [bin_dir]
        for tool, lines in (("nvidia-smi", node.gpus), ("rocm-smi", node.rocm_gpus)):
            if not lines:
                continue
            shutil.copyfile(FAKES / f"{tool}-fake", bin_dir / tool)
            os.chmod(bin_dir / tool, 0o755)
            listing = home / f".fake-{tool}-gpus"
            listing.write_text("".join(f"{line}\n" for line in lines))
            made += [bin_dir / tool, listing]
        for path in made:
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _write_config(self, node: SSHDNode) -> None:
        node.config_path.write_text(
            "\n".join(
                [
                    f"ListenAddress {node.host}",
                    f"Port {node.port}",
                    f"HostKey {node.dir / 'ssh_host_ed25519_key'}",
                    f"PidFile {node.dir / 'sshd.pid'}",
                    "AuthorizedKeysFile .ssh/authorized_keys",
                    f"AllowUsers {node.user}",  # a runner that mixes nodes up fails to log in
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin no",
                    "UsePAM no",
                    "StrictModes no",
                    "MaxStartups 10:30:100",  # the default, kept so fan-out tests meet it
                    "MaxSessions 64",
                    "MaxAuthTries 6",
                    "UseDNS no",
                    "PrintMotd no",
                    "X11Forwarding no",
                    "AllowTcpForwarding no",
                    "Subsystem sftp internal-sftp",
                    "LogLevel VERBOSE",
                    *(
                        [f"SetEnv PATH={node.home}/.fake-bin:{DEFAULT_PATH}"]
                        if node.gpus or node.rocm_gpus
                        else []
                    ),
                    "",
                ]
            )
        )

    def _spawn(self, node: SSHDNode) -> None:
        node.log = open(node.log_path, "ab")  # closed in _kill_node
        node.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(node.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=node.log,
            stderr=node.log,
            start_new_session=True,
        )

    def _wait_ready(self, node: SSHDNode) -> None:
        try:
            wait_for_ssh(node.host, node.port, timeout=15.0)
        except HostUnreachable as e:
            code = node.proc.poll() if node.proc else None
            raise RuntimeError(
                f"sshd for node {node.index} ({node.host}:{node.port}) not ready (exit code {code}): "
                f"{e}\n{self.logs(node.index)[-2000:]}"
            ) from None

    def _kill_until_gone(self, user: str, extra: list[int]) -> None:
        """SIGKILL ``extra`` and ``user``'s processes, repeating until none run (they may be forking)."""
        deadline = time.monotonic() + 10.0
        delay = 0.005
        while True:
            pids = [p for p in extra if _alive(p)] + user_processes(user)
            if not pids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of {user} survive SIGKILL: {pids}")
            _kill(pids)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _kill_node(self, node: SSHDNode) -> None:
        extra: list[int] = []
        if node.proc is not None:
            # per-connection sshd processes run as root: find them through the listener before it dies,
            # each stopped as found (SIGSTOP) until none is new: one forked after the look would start a
            # session of the node's user once the user's processes were killed (a flood of connections)
            frozen = {node.proc.pid}
            fresh = [node.proc.pid]
            while fresh:
                _signal(fresh, signal.SIGSTOP)
                fresh = [pid for pid in _descendants(node.proc.pid) if pid not in frozen]
                frozen.update(fresh)
            extra = sorted(frozen - {node.proc.pid})
            _kill([node.proc.pid])
            node.proc.wait()
            node.proc = None
        if node.log is not None:
            node.log.close()
            node.log = None
        self._kill_until_gone(node.user, extra)
