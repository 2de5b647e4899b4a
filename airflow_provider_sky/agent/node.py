#!/usr/bin/env python3
"""The node agent: one per node, the head's (rank 0's node) is the gang's authority.

One file, standard library only, Python >= 3.8: a backend copies it to a node as it is (nodes have
Python 3 but not this package) and starts it with ``python3 agent.py``; on the control plane it is
imported as :mod:`airflow_provider_sky.agent.node` for its protocol. It never imports the rest of the
package: the node runtime's scripts (launch, cancel) reach it in the start message, so they have one
source, ``node_scripts``/``runtime``. The design, the protocol and the security properties are in
``docs/node-agent.md``.

Roles: the head listens on the cluster's port; every other node's agent connects to it and reports
its ranks' starts and exits (read from the rank directories the wrapper writes: the exit records are
the node runtime's own) plus heartbeats; the head decides the gang's fate and tells every agent to
cancel, each agent then runs the node runtime's cancel script on its ranks. The control plane talks to
the head only: one ``start``, one ``status`` per poll, one ``cancel``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import collections
import hashlib
import hmac
import json
import logging
import os
import re
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sky-agent")

#: the server's greeting: protocol name and version, then its nonce
MAGIC = b"SKYAGT01"
NONCE = 16
MAC = 32
#: largest frame (MAC + JSON body) a peer may send once authenticated: a gang start carries every
#: node's launch script (~15 KB of env per rank)
MAX_FRAME = 16 * 1024 * 1024
#: seconds a new connection has to prove it holds the token
HANDSHAKE_TIMEOUT = 5.0
#: connections that have not proven the token yet (a peer that holds it proves it in one round trip):
#: one host's past ``PEER_PENDING`` that have been silent for ``PEER_GRACE`` seconds are dropped, oldest
#: first, so a flooding host holds 16 (many nodes behind one address joining at once are young, and
#: kept); past ``MAX_PENDING`` in all, the oldest of the host with the most goes, so a flood never
#: crowds out another host's peers. The grace is the round trip of a busy head: 200 peers of one
#: address proving the token at once took longer than 0.5 s with 2 cores at a load average of 30
MAX_PENDING = 1024
PEER_PENDING = 16
PEER_GRACE = 2.0
#: authenticated connections at most (every agent of a 1,024-node gang, the control plane's)
MAX_CONNS = 4096
#: a launch's output kept for the control plane (``STARTED`` lines: a few per rank)
MAX_OUTPUT = 256 * 1024
#: an authenticated control connection idle this long is closed
CONTROL_IDLE = 600.0
#: jobs the head remembers (the oldest finished ones are forgotten first)
MAX_JOBS = 256
#: seconds between an agent's SIGTERMs and its cancel script (the rest: escaped processes, a rank that
#: started since, the SIGKILL after the grace): nodes that share CPUs (128 pods on one machine) all
#: signal their groups before any of them forks the script's shells (a fan-out there takes ~0.3 s; at
#: 0.25 s the early agents' forks doubled the last sibling's time)
SCRIPT_AFTER_SIGNAL = 1.0
#: seconds between reads of the rank directories where the end of each running rank's command wakes the
#: agent (a pidfd): the reads then only find ranks that started and wrappers lost without a record, and
#: a node's agents (128 pods on one machine) stay off the CPU their ranks and fail-fast need
WAITED_SCAN = 0.25
#: after a rank's command ended: its directory is read this often, up to BURST_FOR seconds, until its
#: exit record is there (the wrapper writes it once the output is flushed through the mask)
BURST_EVERY = 0.01
BURST_FOR = 3.0
#: new log bytes an agent ships to the head with each heartbeat, per rank and in all: the control plane
#: then reads running ranks' output from the head (one call per poll at any N). A rank that printed more
#: than SHIP_RANK since the last beat is shipped from its newest SHIP_RANK bytes (a gap the control plane
#: fills from the node); ranks past SHIP_BEAT go first at the next beat
SHIP_RANK = 64 * 1024
SHIP_BEAT = 4 * 1024 * 1024
#: the newest log bytes the head keeps of each running rank (four beats of a rank at SHIP_RANK)
HEAD_WINDOW = 256 * 1024
#: log bytes in one status answer at most (base64 in JSON: under MAX_FRAME)
STATUS_LOG_MAX = 6 * 1024 * 1024
#: a cancel reason as the node runtime writes it for a rank failing first (see ``runtime.node_cancel_reason``)
RANK_FAILED = re.compile(r"@rank-failed (\d+) (-?\d+|-)( oom)?")
JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,180}")
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,120}")

TERMINAL = ("exited", "badexit", "lost")
#: how a worker's reason for stopping its ranks ends when it lost the head
HEAD_LOST = "(head node lost)"
#: a hung rank's reason (and its siblings' cancel) starts so (``gang.classify`` reads it)
HUNG_PREFIX = "hung: "
#: seconds the head waits for the hung ranks' stack dumps before it cancels the gang
DUMP_TIMEOUT = 60.0


def hang_reason(timeout: float, ranks: Any) -> str:
    """ "hung: no output for 600 s (ranks 1, 3)": every hung rank's reason, and the siblings' cancel
    (one text whichever side found the hang: the head, or a watcher on the per-node path)."""
    rs = sorted(int(r) for r in ranks)
    which = ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)
    return f"{HUNG_PREFIX}no output for {timeout:g} s ({which})"


class ProtocolError(Exception):
    """A peer broke the protocol (wrong token, bad frame, unknown message): its connection is dropped."""


# -- the wire ------------------------------------------------------------------------------------


def _mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, label + b"".join(parts), hashlib.sha256).digest()


def _keystream_xor(key: bytes, seq: int, data: bytes) -> bytes:
    """``data`` XOR a SHAKE-256 keystream of (key, sequence number): the frame's encryption, its own
    inverse. Each (connection, direction, frame) has its own key and number, so no keystream repeats.
    SHAKE-256 (a keyed sponge, as KMAC is) is in every Python 3's ``hashlib``; AES is not."""
    ks = hashlib.shake_256(key + struct.pack(">Q", seq)).digest(len(data))
    return (int.from_bytes(data, "big") ^ int.from_bytes(ks, "big")).to_bytes(len(data), "big")


class Channel:
    """One authenticated, encrypted connection: length-prefixed frames of ``MAC || ciphertext``.

    Keys per connection and direction are derived from the cluster's token and both sides' nonces.
    Each frame's body (JSON) is encrypted (:func:`_keystream_xor`), then MACed (HMAC-SHA256 over its
    sequence number and the ciphertext, checked before anything is decrypted or parsed): a frame cannot
    be read, forged, replayed, reordered or reflected, on this connection or another. A gang start's
    launch scripts carry the ranks' secrets, as they do over SSH.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        token: bytes,
        session: bytes,
        server: bool,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.reader, self.writer = reader, writer
        out, into = (b"s>", b"c>") if server else (b"c>", b"s>")
        self._enc_out, self._mac_out = _mac(token, b"enc" + out, session), _mac(token, b"mac" + out, session)
        self._enc_in, self._mac_in = _mac(token, b"enc" + into, session), _mac(token, b"mac" + into, session)
        self._sent = self._got = 0
        self._max = max_frame
        self._lock = asyncio.Lock()
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    async def send(self, msg: dict[str, Any], timeout: float = 10.0) -> None:
        body = json.dumps(msg, separators=(",", ":")).encode()
        async with self._lock:  # sequence numbers in the order the frames go out
            self._sent += 1
            seq = struct.pack(">Q", self._sent)
            ct = _keystream_xor(self._enc_out, self._sent, body)
            mac = hmac.new(self._mac_out, seq + ct, hashlib.sha256).digest()
            self.writer.write(struct.pack(">I", MAC + len(ct)) + mac + ct)
            await asyncio.wait_for(self.writer.drain(), timeout)

    async def recv(self, timeout: float | None = None) -> dict[str, Any]:
        head = await asyncio.wait_for(self.reader.readexactly(4), timeout)
        (n,) = struct.unpack(">I", head)
        if n < MAC + 2 or n > self._max:
            raise ProtocolError(f"frame of {n} bytes")
        data = await asyncio.wait_for(self.reader.readexactly(n), timeout)
        self._got += 1
        want = hmac.new(self._mac_in, struct.pack(">Q", self._got) + data[MAC:], hashlib.sha256).digest()
        if not hmac.compare_digest(data[:MAC], want):
            raise ProtocolError("bad frame MAC")
        try:
            msg = json.loads(_keystream_xor(self._enc_in, self._got, data[MAC:]))
        except ValueError as exc:
            raise ProtocolError("frame is not JSON") from exc
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise ProtocolError("frame is not a message")
        return msg

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # closing a broken transport: nothing left to do
            pass


async def server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes
) -> Channel:
    """Greet, check the peer's proof of the token, prove ours: the two nonces key the connection."""
    snonce = os.urandom(NONCE)
    writer.write(MAGIC + snonce)
    await writer.drain()
    data = await reader.readexactly(NONCE + MAC)
    cnonce, proof = data[:NONCE], data[NONCE:]
    if not hmac.compare_digest(proof, _mac(token, b"auth-c", snonce, cnonce)):
        raise ProtocolError("wrong token")
    writer.write(_mac(token, b"auth-s", snonce, cnonce))
    await writer.drain()
    return Channel(reader, writer, token, snonce + cnonce, server=True)


async def client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes, timeout: float
) -> Channel:
    """The client's side of :func:`server_handshake`; the server's proof is checked too."""
    greet = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE), timeout)
    if greet[: len(MAGIC)] != MAGIC:
        raise ProtocolError("not a node agent")
    snonce, cnonce = greet[len(MAGIC) :], os.urandom(NONCE)
    writer.write(cnonce + _mac(token, b"auth-c", snonce, cnonce))
    await writer.drain()
    proof = await asyncio.wait_for(reader.readexactly(MAC), timeout)
    if not hmac.compare_digest(proof, _mac(token, b"auth-s", snonce, cnonce)):
        raise ProtocolError("the agent does not hold the cluster's token")
    return Channel(reader, writer, token, snonce + cnonce, server=False)


async def connect(host: str, port: int, token: bytes, hello: dict[str, Any], timeout: float) -> Channel:
    """Open an authenticated connection and say who we are (``hello``); the head answers ``welcome``."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        chan = await client_handshake(reader, writer, token, timeout)
        await chan.send(hello)
        reply = await chan.recv(timeout)
    except BaseException:
        writer.close()
        raise
    if reply.get("op") != "welcome":
        chan.close()
        raise ProtocolError(f"the head refused us: {reply.get('error', reply.get('op'))}")
    return chan


# -- one node's ranks ----------------------------------------------------------------------------


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def _num(text: str | None) -> float | None:
    try:
        return float((text or "").strip())
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rank_group(d: str, pg: int) -> tuple[int, bool] | None:
    """What to signal for the process group a rank's ``pgid`` file names (the node runtime's
    ``rankgroups``): ``(pg, True)`` the group, ``(pg, False)`` its first process alone (it has not run
    setsid yet), None when the group is gone or the number is another's now (a rank that ended without
    an exit record, as a crashed wrapper leaves it: a busy machine gives numbers out again within
    minutes). The first process is the rank's while it is a child of the rank's wrapper (``pid``), or
    carries the rank's mark (its wrapper was killed)."""
    try:
        with open(f"/proc/{pg}/stat", "rb") as f:
            fields = f.read().rsplit(b") ", 1)[-1].split()
    except FileNotFoundError:
        try:  # the first process is gone: members left keep the number taken
            os.killpg(pg, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pg, True
    except OSError:
        return pg, True  # no /proc to tell by: the group, as named
    ppid, group = int(fields[1]), int(fields[2])
    wrapper = _num(_read(os.path.join(d, "pid"), 32))
    if not wrapper or ppid == int(wrapper):  # no wrapper pid yet: it is written right after the pgid
        return pg, group == pg
    environ = _read(f"/proc/{pg}/environ", 1 << 20) or ""
    if f"\0SKY_PROVIDER_MARK={d}/\0" in f"\0{environ}":
        return pg, group == pg
    return None


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def read_rank(d: str) -> dict[str, Any]:
    """A rank's state from its directory, read the way the node runtime's status script reads it.

    ``own``: it failed on its own (nonzero, no cancel reached it, not orphaned; or hung), what fails a gang.
    """
    rec: dict[str, Any] = {"state": "pending", "code": None, "start": None, "end": None, "why": ""}
    rec.update(oom=False, orphaned=False, own=False, hung=False)
    if not os.path.isdir(d):
        return rec
    rec["start"] = _num(_read(os.path.join(d, "start")))
    rec["orphaned"] = os.path.exists(os.path.join(d, "orphaned"))
    rec["hung"] = os.path.isdir(os.path.join(d, "hang"))
    cancel = _read(os.path.join(d, "cancel"), 500)
    rec["why"] = (cancel or "").strip()  # a cancel on its way to a rank still running
    ex = _read(os.path.join(d, "exit"))
    if not ex:
        pid = _num(_read(os.path.join(d, "pid")))
        if pid is None or pid <= 0:
            return rec
        if _alive(int(pid)):
            rec["state"] = "running"
            return rec
        ex = _read(os.path.join(d, "exit"))
        if not ex:
            # its wrapper is gone without a record: a failure, unless a cancel had reached it
            rec["state"], rec["own"] = "lost", not rec["why"]
            return rec
    lines = ex.split("\n")
    code = lines[0].strip()
    if not code.lstrip("-").isdigit():
        rec["state"], rec["own"] = "badexit", not rec["why"]
        return rec
    rec["state"], rec["code"] = "exited", int(code)
    rec["log"] = _size(os.path.join(d, "log"))  # its whole output: the control plane reads what it has not
    end = _read(os.path.join(d, "end"))
    rec["end"] = _num(end) if end is not None else _num(lines[1] if len(lines) > 1 else None)
    why = (cancel or "").strip() or (lines[2].strip() if len(lines) > 2 else "")
    rec["why"] = why
    rec["oom"] = os.path.exists(os.path.join(d, "oom"))
    # as the gang policy reads it (gang.classify): orphaned is the dead-man's switch, not a rank's
    # failure; a rank the hang watch killed failed, whatever cancel reason it carries
    rec["own"] = rec["code"] != 0 and not rec["orphaned"] and (rec["hung"] or not why)
    return rec


class NodeJob:
    """A job's ranks on this node and what this node was told about it."""

    def __init__(
        self,
        job: str,
        ranks: list[list[Any]],
        flag: str,
        grace: float,
        cancel_script: str,
        dump_script: str = "",
        lost_after: float = 0.0,
    ):
        self.job = job
        self.dump_script = dump_script  # the node runtime's stack dump of hung ranks (hang_timeout)
        self.lost_after = lost_after  # the head silent this long: the job's ranks stop (0: the agent's)
        self.dirs = {int(r): os.path.join(str(root), "jobs", job, str(int(r))) for root, r in ranks}
        self.roots = {int(r): str(root) for root, r in ranks}
        self.flag, self.grace, self.cancel_script = flag, grace, cancel_script
        self.recs: dict[int, dict[str, Any]] = {}
        self.pids: dict[int, int] = {}  # each running rank's wrapper
        self.lost_once: set = set()
        self.cancel: dict[str, Any] | None = None  # the head's cancel, once told
        self.covered: set = set()  # ranks a cancel call covered (their directory existed then)
        self.claimed = False  # this agent claimed the machine's cancel (.cancelling)
        self.done = False
        self.waited: set = set()  # ranks whose command's end wakes the agent (a pidfd)


class NodeWork:
    """What every agent does on its own node: start ranks with the launch script it is given, watch
    their directories, report changes, cancel with the node runtime's cancel script."""

    def __init__(self, node: str, report: Callable[[str, list[dict[str, Any]]], None], scan: float) -> None:
        self.node = node
        self.report = report
        self.scan = scan
        self.jobs: dict[str, NodeJob] = {}
        self._tasks: set = set()
        # each running rank's command is waited on (a pidfd, Linux 5.3+): its end wakes the agent at once
        self.waits = hasattr(os, "pidfd_open")
        self._ended: set = set()  # (job, rank) whose command ended and whose record is not read yet
        self._bursting = False
        self.shipped: dict[tuple[str, int], int] = {}  # (job, rank) -> log bytes shipped to the head
        self._ship_first = 0  # where the next beat's shipping starts (ranks past SHIP_BEAT go first)

    def add(self, job: str, *args: Any, **kwargs: Any) -> NodeJob:
        """The job, made with :class:`NodeJob`'s arguments the first time (a known job stays as it is)."""
        nj = self.jobs.get(job)
        if nj is None:
            nj = self.jobs[job] = NodeJob(job, *args, **kwargs)
            done = [j for j, x in self.jobs.items() if x.done]
            for j in done[: max(0, len(self.jobs) - MAX_JOBS)]:
                del self.jobs[j]  # the oldest finished: every hello carries the state of the rest
        return nj

    def prepare(self, msg: dict[str, Any]) -> NodeJob:
        """Know a job's ranks from the moment its ``run`` arrives, before its script runs: a cancel
        that comes right behind it (a rank failed at once elsewhere) then finds them."""
        return self.add(
            str(msg["job"]),
            msg["ranks"],
            str(msg.get("flag") or ""),
            float(msg["grace"]),
            msg["cancel_script"],
            str(msg.get("dump_script") or ""),
            float(msg.get("lost_after") or 0),
        )

    async def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Start this node's ranks of a job: its launch script, run as the control plane rendered it.
        Cancelled already, it still runs: with the gang flag set its launchers record every rank
        cancelled without starting it, and a rank started all the same is cancelled when a scan sees it."""
        self.prepare(msg)
        args = msg.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            return {"rc": None, "out": "", "error": "a run's args must be a list of strings"}
        rc, out = await _sh(str(msg["script"]), args, timeout=float(msg.get("timeout") or 120))
        self.tick()  # a rank that failed at once is reported with the answer
        return {"rc": rc, "out": out}

    def tick(self) -> None:
        """Read every unfinished rank once; report what changed, cancel ranks a cancel missed."""
        for nj in list(self.jobs.values()):
            if nj.done:
                continue
            changed = []
            for r, d in nj.dirs.items():
                old = nj.recs.get(r)
                if old is not None and old["state"] in TERMINAL:
                    continue
                pid = nj.pids.get(r)
                if pid and not os.path.exists(os.path.join(d, "exit")) and _alive(pid):
                    if self.waits and r not in nj.waited:
                        self._wait_end(nj, r, d)
                    continue  # still running: two system calls, not a read of every file (256 ranks: 10% of a core)
                rec = read_rank(d)
                if rec["state"] == "running" and r not in nj.pids:
                    nj.pids[r] = int(_num(_read(os.path.join(d, "pid"), 32)) or 0)
                    if self.waits:
                        self._wait_end(nj, r, d)
                if rec["state"] == "lost" and r not in nj.lost_once:
                    nj.lost_once.add(r)  # a pid read half-written: the next read decides
                    continue
                rec["rank"] = r
                if rec["state"] in TERMINAL:
                    self._ended.discard((nj.job, r))
                if rec != old:
                    nj.recs[r] = rec
                    changed.append(rec)
            if nj.cancel is not None:
                late = [r for r, d in nj.dirs.items() if r not in nj.covered and os.path.isdir(d)]
                if late:
                    self._spawn(self._cancel(nj, late))
            if len(nj.recs) == len(nj.dirs) and all(x["state"] in TERMINAL for x in nj.recs.values()):
                nj.done = True
            if changed:
                self.report(nj.job, changed)

    async def watch(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # one unreadable directory must not stop the watch of every job
                log.exception("Reading the ranks failed")
            await asyncio.sleep(max(self.scan, WAITED_SCAN) if self.waits else self.scan)

    def _wait_end(self, nj: NodeJob, r: int, d: str) -> None:
        """Be woken when rank ``r``'s command ends: a pidfd on its process group's first process
        (``pgid``), readable once it exits; then its directory is read until the exit record is there."""
        pg = _num(_read(os.path.join(d, "pgid"), 32))
        if not pg or pg <= 1:
            return  # not written yet: the next read
        nj.waited.add(r)
        try:
            fd = os.pidfd_open(int(pg))
        except ProcessLookupError:  # ended already
            self._ended.add((nj.job, r))
            self._spawn(self._burst())
            return
        except OSError as exc:  # no pidfds here (an old kernel, a seccomp filter): read every scan
            log.info("Cannot wait on processes (%s): the rank directories are read every %ss", exc, self.scan)
            self.waits = False
            return
        try:
            asyncio.get_running_loop().add_reader(fd, self._command_ended, fd, nj.job, r)
        except Exception:
            os.close(fd)
            raise

    def _command_ended(self, fd: int, job: str, r: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(fd)
        os.close(fd)
        self._ended.add((job, r))
        self._spawn(self._burst())

    def _stopped(self, ended: tuple[str, int]) -> bool:
        """Whether this agent stopped the job of an ended rank (a cancel), so its fate is decided."""
        nj = self.jobs.get(ended[0])
        return nj is not None and nj.cancel is not None

    def _unrecorded(self, job: str, r: int) -> bool:
        nj = self.jobs.get(job)
        return nj is not None and not nj.done and (nj.recs.get(r) or {}).get("state") not in TERMINAL

    async def _burst(self) -> None:
        """Read the ranks every BURST_EVERY s while a command that ended has no exit record yet (the
        wrapper writes it once the output is through), BURST_FOR s at most: a failure is reported
        milliseconds after it, without reading every directory that often all the time. Ranks this
        agent stopped are read at doubling intervals: the gang's fate is decided already, and 128 pods
        reading their ranks 100 times a second took the CPU the cancel's last agents needed."""
        if self._bursting:
            return
        self._bursting = True
        try:
            until = time.monotonic() + BURST_FOR
            every = BURST_EVERY
            while self._ended and time.monotonic() < until:
                try:
                    self.tick()
                except Exception:
                    log.exception("Reading the ranks failed")
                self._ended = {(j, r) for j, r in self._ended if self._unrecorded(j, r)}
                if not self._ended:
                    break
                await asyncio.sleep(every)
                every = min(every * 2, WAITED_SCAN) if all(map(self._stopped, self._ended)) else BURST_EVERY
            self._ended.clear()
        finally:
            self._bursting = False

    def cancel(self, job: str, reason: str, orphaned: bool = False) -> None:
        """Stop this node's ranks of ``job`` (once; later calls add nothing): the node runtime's cancel."""
        nj = self.jobs.get(job)
        if nj is None or nj.cancel is not None:
            return
        nj.cancel = {"reason": reason, "orphaned": orphaned}
        if orphaned:
            for r, d in nj.dirs.items():
                rec = nj.recs.get(r)
                if os.path.isdir(d) and not (rec and rec["state"] in TERMINAL):
                    _write(os.path.join(d, "orphaned"), reason + "\n")
        m = RANK_FAILED.fullmatch(reason)
        if m and nj.flag:
            # the machine's gang flag, as a start call's flag_failure writes it: its launchers start
            # nothing more, and record the ranks they skip as cancelled by that rank
            try:
                if not os.path.exists(nj.flag) or os.path.getsize(nj.flag) == 0:
                    os.makedirs(os.path.dirname(nj.flag), exist_ok=True)
                    with open(nj.flag, "a") as f:
                        f.write(f"{m.group(1)} {m.group(2)}\n")
            except OSError as exc:
                log.warning("Could not write the gang flag of job %s: %s", job, exc)
        self._spawn(self._cancel(nj, [r for r, d in nj.dirs.items() if os.path.isdir(d)]))

    async def _cancel(self, nj: NodeJob, ranks: list[int]) -> None:
        ranks = [r for r in ranks if r not in nj.covered]
        if not ranks or nj.cancel is None:
            return
        nj.covered.update(ranks)
        reason = " ".join(nj.cancel["reason"].split())[:400]
        if RANK_FAILED.fullmatch(reason) and nj.flag and not nj.claimed:
            # the machine's cancel is claimed once (.cancelling, as the wrapper of a rank failing first
            # there claims it): a rank of this machine that claimed it first covers every rank here;
            # claimed here, no wrapper of this machine signals its siblings a second time
            claim = os.path.join(os.path.dirname(nj.flag), ".cancelling")
            try:
                os.mkdir(claim)
            except FileExistsError:
                nj.covered.update(nj.dirs)
                return
            except OSError:
                pass
            else:
                nj.claimed = True
                aside = os.path.join(claim, f"reason.{os.getpid()}")
                _write(aside, reason + "\n")
                try:  # whole or not at all: a wrapper reads it (see the node runtime's WRAPPER)
                    os.replace(aside, os.path.join(claim, "reason"))
                except OSError as exc:
                    log.warning("Could not write the cancel reason of job %s: %s", nj.job, exc)
        mode = "nowait"
        # every unfinished rank's reason, then one SIGTERM per group, from here (no fork between the
        # head's word and the signal); the cancel script then does the rest as on the per-node path
        # (escaped processes, the SIGKILL after the grace) and signals no group twice
        targets: list[tuple[int, bool]] = []
        for r in ranks:
            d = nj.dirs[r]
            if os.path.exists(os.path.join(d, "exit")):
                continue
            pg = _num(_read(os.path.join(d, "pgid"), 32))
            _write(os.path.join(d, "cancel"), reason + "\n")
            if not pg:
                # not started: its wrapper reads the reason right after it writes its pgid, so one of
                # the two signals the group (the cancel script's order, see the node runtime's WRAPPER)
                pg = _num(_read(os.path.join(d, "pgid"), 32))
            # only a group that is still the rank's (an ended one's number may be another's by now)
            target = _rank_group(d, int(pg)) if pg and pg > 1 else None
            if target is not None:
                targets.append(target)
        for pg, whole in targets:
            try:
                (os.killpg if whole else os.kill)(pg, signal.SIGTERM)
            except ProcessLookupError:  # ended meanwhile
                pass
            except OSError as exc:
                log.warning("Could not signal group %s: %s", pg, exc)
        grace = nj.grace
        if targets and grace > SCRIPT_AFTER_SIGNAL:  # the grace counts from the SIGTERMs
            await asyncio.sleep(SCRIPT_AFTER_SIGNAL)
            grace -= SCRIPT_AFTER_SIGNAL
        args = [f"{grace:.3f}", mode, reason]
        for r in ranks:
            args += [nj.roots[r], nj.job, str(r)]
        env = dict(os.environ, SKY_SIGNALLED="".join(f" -{pg}" for pg, _ in targets))
        rc, out = await _sh(nj.cancel_script, args, timeout=30 + nj.grace, env=env)
        if rc != 0:
            log.warning("The cancel of job %s ranks %s ended with %s: %s", nj.job, ranks, rc, out[-500:])

    async def dump(self, job: str, ranks: Any, reason: str) -> None:
        """Dump the stacks of this node's hung ranks into their logs (the node runtime's dump script, as
        the per-node path runs it: ``mkdir hang`` is its lock, so a watcher dumping too adds nothing)."""
        nj = self.jobs.get(job)
        if nj is None or not nj.dump_script or not isinstance(ranks, list):
            return
        args = [reason]
        for r in ranks:
            if isinstance(r, int) and r in nj.roots:
                args += [nj.roots[r], job, str(r)]
        if len(args) > 1:
            rc, out = await _sh(nj.dump_script, args, timeout=DUMP_TIMEOUT)
            if rc != 0:
                log.warning("The stack dump of job %s ranks %s ended with %s: %s", job, ranks, rc, out[-500:])

    def stop_lost(self, silent: float, lost_after: float) -> bool:
        """The head has been silent for ``silent`` seconds: every job still running here whose
        ``lost_after`` (else the agent's) has passed is stopped (all or nothing). Whether one was."""
        stopped = False
        for job, nj in self.jobs.items():
            limit = nj.lost_after or lost_after
            if not nj.done and silent >= limit:
                stopped = True
                if nj.cancel is None:
                    self.cancel(job, f"the head node's agent stopped answering for {limit:.0f}s {HEAD_LOST}")
        return stopped

    def state(self) -> dict[str, list[dict[str, Any]]]:
        return {job: list(nj.recs.values()) for job, nj in self.jobs.items()}

    def log_sizes(self) -> dict[str, dict[str, Any]]:
        """The log size of every running rank (one ``stat`` each; ``[size, mtime]`` when it has a
        progress file, ``SKY_PROGRESS_FILE``), sent with the heartbeat: the control plane then reads a
        log only when it grew, so a quiet gang's poll is one call at any size."""
        out: dict[str, dict[str, Any]] = {}
        for job, nj in self.jobs.items():
            if nj.done:
                continue
            sizes: dict[str, Any] = {}
            for r, d in nj.dirs.items():
                if (nj.recs.get(r) or {}).get("state") != "running":
                    continue
                size = _size(os.path.join(d, "log"))
                try:
                    sizes[str(r)] = [size, int(os.stat(os.path.join(d, "progress")).st_mtime)]
                except OSError:
                    sizes[str(r)] = size
            if sizes:
                out[job] = sizes
        return out

    def log_tails(self, sizes: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[Any]]]:
        """The new bytes of each running rank's log since the last beat (``sizes``: this beat's
        :meth:`log_sizes`), ``[offset, base64]`` per rank, at most SHIP_RANK each and SHIP_BEAT in all.
        The log on the node is masked already (the wrapper's filter wrote it)."""
        live = {(job, int(r)) for job, by in sizes.items() for r in by}
        for key in [k for k in self.shipped if k not in live]:
            del self.shipped[key]  # an ended rank: its last bytes are read from its node once
        todo = []
        for job, by in sizes.items():
            for r, size in by.items():
                end = size[0] if isinstance(size, list) else size
                if end > self.shipped.get((job, int(r)), 0):
                    todo.append((job, int(r), int(end)))
        if not todo:
            return {}
        first = self._ship_first % len(todo)
        self._ship_first += 1
        out: dict[str, dict[str, list[Any]]] = {}
        budget = SHIP_BEAT
        for job, rank, end in todo[first:] + todo[:first]:
            if budget <= 0:
                break
            nj = self.jobs.get(job)
            if nj is None:
                continue
            off = max(self.shipped.get((job, rank), 0), end - SHIP_RANK)
            try:
                with open(os.path.join(nj.dirs[rank], "log"), "rb") as f:
                    f.seek(off)
                    data = f.read(min(end - off, budget))
            except (OSError, KeyError):
                continue
            if data:
                self.shipped[(job, rank)] = off + len(data)
                budget -= len(data)
                out.setdefault(job, {})[str(rank)] = [off, base64.b64encode(data).decode()]
        return out

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        log.warning("Could not write %s: %s", path, exc)


async def _sh(
    script: str, args: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """``sh -s -- ARGS`` with the script on stdin (as the control plane runs the node scripts)."""
    proc = await asyncio.create_subprocess_exec(
        "sh",
        "-s",
        "--",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd="/",
        env=env,
    )
    OURS.add(proc.pid)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(script.encode()), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None, "timed out"
    finally:
        OURS.discard(proc.pid)
    return proc.returncode, out[-MAX_OUTPUT:].decode("utf-8", "replace")


#: the agent's own ``sh`` children (asyncio waits for them): the orphan reaper leaves them alone
OURS: set[int] = set()


def reap_orphans() -> int:
    """Reap the zombies an init must: as a pod's own process (pid 1) the agent inherits every rank
    wrapper (each is started detached and its starter exits), and nothing else would wait for them."""
    reaped = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in OURS:
            continue
        stat = _read(f"/proc/{entry}/stat", 1024) or ""
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[0] == "Z" and fields[1] == str(os.getpid()):
            try:
                if os.waitpid(int(entry), os.WNOHANG)[0]:
                    reaped += 1
            except ChildProcessError:
                pass
    return reaped


async def reaper(every: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            reap_orphans()
        except OSError as exc:
            log.debug("Reaping failed: %s", exc)


# -- the head: the gang's authority --------------------------------------------------------------


class Link:
    """The head's view of one node's agent (the head's own node included: ``chan`` None, always up)."""

    def __init__(self, node: str, chan: Channel | None, now: float) -> None:
        self.node, self.chan, self.heard = node, chan, now

    async def send(self, msg: dict[str, Any]) -> bool:
        if self.chan is None:
            return False
        try:
            await self.chan.send(msg)
            return True
        except Exception as exc:  # the link is judged by what the head hears, not by a failed send
            log.info("Could not send %s to node %s: %s", msg.get("op"), self.node, exc)
            return False


class HeadJob:
    def __init__(
        self, job: str, plan: dict[str, Any], orphan_timeout: float, now: float, hang_timeout: float = 0.0
    ) -> None:
        self.job = job
        self.nodes: dict[str, list[int]] = {n: [int(r) for _, r in p["ranks"]] for n, p in plan.items()}
        self.node_of = {r: n for n, rs in self.nodes.items() for r in rs}
        self.ranks: dict[int, dict[str, Any]] = {}
        self.state = "running"  # running | succeeded | failed | cancelled
        self.reason = ""
        self.cause: dict[str, Any] | None = None
        self.cancel: dict[str, Any] | None = None  # what every agent is told: reason, orphaned
        self.lost: dict[str, str] = {}  # node -> why
        self.decided: float | None = None  # when the head decided the gang's fate (its clock)
        self.orphan_timeout = orphan_timeout
        self.contact = now
        self.started: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.logs: dict[int, Any] = {}  # rank -> its log's size (or [size, progress mtime]), from the beats
        self.tails: dict[int, list[Any]] = {}  # rank -> [offset, bytearray]: its newest shipped log bytes
        self.rotor = 0  # where the next status answer's log bytes start (STATUS_LOG_MAX is shared)
        #: a running rank silent this long (no new log byte, no newer progress file) is hung (0: off)
        self.hang_timeout = hang_timeout
        #: rank -> (its last sign of life, when the head first saw it, the check before that one)
        self.signs: dict[int, tuple[Any, float, float]] = {}
        self.hang_at: float | None = None  # the head's last hang check
        self.hanging = False  # hung ranks found: their stacks are being dumped, then the gang fails
        self.dump_script = ""  # the node runtime's stack dump, run by the hung ranks' agents
        self.lost_after = 0.0  # a node not heard from this long is lost (set by the start)
        self.dumps: dict[str, asyncio.Future[None]] = {}  # node -> its answer to the dump

    def done(self) -> bool:
        for r, n in self.node_of.items():
            rec = self.ranks.get(r)
            if n not in self.lost and not (rec and rec["state"] in TERMINAL):
                return False
        return True


class Head:
    """The gang's authority on the head node: merges the agents' reports, decides, tells them."""

    def __init__(self, node: str, work: NodeWork, lost_after: float, beat: float) -> None:
        self.node = node
        self.work = work
        self.lost_after, self.beat = lost_after, beat
        self.links: dict[str, Link] = {node: Link(node, None, time.monotonic())}
        self.jobs: collections.OrderedDict[str, HeadJob] = collections.OrderedDict()

    # reports
    def on_report(self, node: str, job: str, recs: list[dict[str, Any]]) -> None:
        hj = self.jobs.get(job)
        if hj is None:
            return
        for rec in recs:
            r = int(rec.get("rank", -1))
            if hj.node_of.get(r) != node:
                continue  # an agent speaks for its own ranks only
            if hj.ranks.get(r, {}).get("state") in TERMINAL and rec.get("state") not in TERMINAL:
                continue  # an ended rank stays ended, whatever a late or repeated report says
            hj.ranks[r] = rec
            if rec.get("state") in TERMINAL:
                hj.tails.pop(r, None)  # an ended rank's log is read from its node, to its last byte
            if rec.get("own") and hj.state == "running":
                code = rec.get("code")
                why = (
                    f"@rank-failed {r} {'-' if code is None else int(code)}{' oom' if rec.get('oom') else ''}"
                )
                if rec["state"] == "lost":
                    text = f"rank {r}'s wrapper ended without an exit record"
                elif rec["state"] == "badexit":
                    text = f"rank {r}'s exit record is unreadable"
                else:
                    text = why
                hj.cause = {"rank": r, "code": code, "oom": bool(rec.get("oom")), "node": node, "why": text}
                self.decide(hj, "failed", text, why)
            elif self._lost_the_head(hj, rec):
                # its node stopped it without the head's word (that node lost the head for lost_after):
                # the rest of the gang stops too, all or nothing, for the reason that node gave
                text = str(rec.get("why"))
                hj.cause = {"rank": r, "code": rec.get("code"), "oom": False, "node": node, "why": text}
                self.decide(hj, "failed", text, text)
        if hj.state == "running" and hj.done():
            ok = all(hj.ranks.get(r, {}).get("code") == 0 for r in hj.node_of)
            hj.state = "succeeded" if ok else "failed"

    @staticmethod
    def _lost_the_head(hj: HeadJob, rec: dict[str, Any]) -> bool:
        """A rank its own agent stopped for a lost head while the head had decided nothing (the head was
        stopped or cut off). Other cancels the head did not give (a teardown of some nodes, a per-node
        cancel from the control plane) are theirs to finish, not a verdict on the whole gang."""
        return (
            hj.state == "running"
            and hj.cancel is None
            and rec.get("state") in TERMINAL
            and str(rec.get("why") or "").endswith(HEAD_LOST)
        )

    def on_logs(self, node: str, logs: Any) -> None:
        """Log sizes from a node's heartbeat (its own ranks only)."""
        if not isinstance(logs, dict):
            return
        for job, sizes in logs.items():
            hj = self.jobs.get(str(job))
            if hj is None or not isinstance(sizes, dict):
                continue
            for r, size in sizes.items():
                ok = isinstance(size, int) or (
                    isinstance(size, list) and len(size) == 2 and all(isinstance(x, int) for x in size)
                )
                if ok and str(r).isdigit() and hj.node_of.get(int(r)) == node:
                    hj.logs[int(r)] = size

    def on_tails(self, node: str, tails: Any) -> None:
        """New log bytes from a node's heartbeat (its own ranks only): each rank keeps its newest
        HEAD_WINDOW bytes; bytes after a gap (the agent skipped ahead) start the window again."""
        if not isinstance(tails, dict):
            return
        for job, by in tails.items():
            hj = self.jobs.get(str(job))
            if hj is None or not isinstance(by, dict):
                continue
            for r, item in by.items():
                if not (str(r).isdigit() and hj.node_of.get(int(r)) == node and isinstance(item, list)):
                    continue
                if len(item) != 2 or not isinstance(item[0], int) or not isinstance(item[1], str):
                    continue
                try:
                    data = base64.b64decode(item[1], validate=True)
                except (binascii.Error, ValueError):
                    continue
                off, rank = item[0], int(r)
                win = hj.tails.get(rank)
                if win is not None and win[0] <= off <= win[0] + len(win[1]):
                    win[1] += data[win[0] + len(win[1]) - off :]
                elif off >= 0:
                    win = hj.tails[rank] = [off, bytearray(data)]
                else:
                    continue
                if len(win[1]) > HEAD_WINDOW:
                    cut = len(win[1]) - HEAD_WINDOW
                    del win[1][:cut]
                    win[0] += cut

    def _log_bytes(self, hj: HeadJob, logs_from: Any, max_log: Any) -> dict[int, dict[str, Any]]:
        """What a status answer says of each asked rank's log from the watcher's offset: ``chunk``
        ``[offset, base64]`` (the head has bytes from there), ``behind`` (the head's window starts past
        it: the watcher reads that rank's node), and ``shipped``, the end of what the head has.
        STATUS_LOG_MAX bytes in one answer, shared in turns."""
        out: dict[int, dict[str, Any]] = {}
        if not isinstance(logs_from, dict) or not isinstance(max_log, int) or max_log <= 0:
            return out
        asked = sorted(
            (int(r), off)
            for r, off in logs_from.items()
            if str(r).isdigit() and int(r) in hj.tails and isinstance(off, int) and off >= 0
        )
        if not asked:
            return out
        first = hj.rotor % len(asked)
        hj.rotor += 1
        budget = STATUS_LOG_MAX
        for rank, off in asked[first:] + asked[:first]:
            start, buf = hj.tails[rank]
            end = start + len(buf)
            item: dict[str, Any] = {"shipped": end}
            if off < start:
                item["behind"] = True
            elif off < end and budget > 0:
                data = bytes(buf[off - start : off - start + min(max_log, budget)])
                budget -= len(data)
                item["chunk"] = [off, base64.b64encode(data).decode()]
            out[rank] = item
        return out

    def decide(self, hj: HeadJob, state: str, reason: str, cancel: str, orphaned: bool = False) -> None:
        """The gang's fate, once: every agent is told to cancel at once (the head's own node first)."""
        if hj.cancel is not None:
            return
        hj.state, hj.reason = state, reason
        hj.decided = time.time()
        hj.cancel = {"op": "cancel", "job": hj.job, "reason": cancel, "orphaned": orphaned}
        log.info("Job %s %s: %s; cancelling on %d nodes", hj.job, state, reason, len(hj.nodes))
        for node in hj.nodes:
            self.tell(node, hj.cancel)

    def tell(self, node: str, msg: dict[str, Any]) -> None:
        if node == self.node:
            self.work.cancel(msg["job"], msg["reason"], bool(msg.get("orphaned")))
            return
        link = self.links.get(node)
        if link is not None and link.chan is not None:
            self.work._spawn(link.send(msg))

    # links
    def up(self, node: str, within: float = 0.0) -> bool:
        """Whether the head heard from ``node`` within ``within`` seconds (0: the agent's lost_after)."""
        link = self.links.get(node)
        if link is None:
            return False
        limit = within or self.lost_after
        return (link.chan is None and node == self.node) or time.monotonic() - link.heard < limit

    def attach(self, node: str, chan: Channel, state: dict[str, Any]) -> Link:
        old = self.links.get(node)
        if old is not None and old.chan is not None and old.chan is not chan:
            old.chan.close()
        link = self.links[node] = Link(node, chan, time.monotonic())
        for job, recs in state.items():
            if isinstance(recs, list):
                self.on_report(node, str(job), [r for r in recs if isinstance(r, dict)])
        # an agent back after a cut: a gang decided meanwhile is cancelled there too (all or nothing)
        for hj in self.jobs.values():
            if node in hj.nodes and hj.cancel is not None:
                self.tell(node, hj.cancel)
        return link

    def housekeep(self) -> None:
        now = time.monotonic()
        sizes = self.work.log_sizes()
        self.on_logs(self.node, sizes)
        self.on_tails(self.node, self.work.log_tails(sizes))
        for hj in self.jobs.values():
            if hj.tails and hj.done():
                hj.tails.clear()  # a finished job's windows (a lost node's ranks never report an end)
            if hj.state == "running":
                for node in hj.nodes:
                    if node not in hj.lost and not self.up(node, hj.lost_after):
                        link = self.links.get(node)
                        heard = now - link.heard if link else hj.lost_after
                        hj.lost[node] = f"its agent stopped answering for {heard:.0f}s"
                        ranks = ",".join(str(r) for r in hj.nodes[node])
                        reason = f"node {node} (ranks {ranks}) lost: {hj.lost[node]}"
                        fut = hj.started.get(node)
                        if fut is not None and not fut.done():
                            fut.set_result({"rc": None, "out": "", "error": reason})
                        if hj.cancel is None:
                            hj.cause = {"rank": min(hj.nodes[node]), "code": None, "oom": False, "node": node}
                            hj.cause["why"] = reason
                            self.decide(hj, "failed", reason, reason)
                self._hang_check(hj, now)
                if hj.orphan_timeout > 0 and hj.state == "running" and now - hj.contact > hj.orphan_timeout:
                    reason = (
                        f"orphaned: nothing polled this job for {hj.orphan_timeout:.0f}s (Airflow lost it); "
                        "the node killed its processes"
                    )
                    self.decide(hj, "cancelled", reason, reason, orphaned=True)
            elif hj.cancel is not None:
                for node in hj.nodes:  # a node that goes silent after the decision: its ranks are lost
                    if node not in hj.lost and not self.up(node) and not self._node_done(hj, node):
                        hj.lost[node] = "its agent stopped answering"

    def _hang_check(self, hj: HeadJob, now: float) -> None:
        """Hung ranks (``hang_timeout``), timed by the head's clock from the heartbeats' log sizes and
        progress times, so a hang is found on the cluster with or without a watcher. A rank is hung once
        it is surely silent that long; the verdict then also names each rank that may have been (its
        last sign came between two checks, or up to a heartbeat before one: ranks that stopped together
        are seen a beat apart), up to half the timeout, as the per-node path's watcher does."""
        if hj.hang_timeout <= 0 or hj.hanging or hj.state != "running":
            return
        prev, hj.hang_at = hj.hang_at, now
        sure, maybe = [], []
        for r, node in hj.node_of.items():
            rec = hj.ranks.get(r)
            if rec is None or rec.get("state") != "running" or node in hj.lost:
                continue
            sign = hj.logs.get(r, rec.get("log"))
            seen = hj.signs.get(r)
            if seen is None or seen[0] != sign:
                hj.signs[r] = (sign, now, now if prev is None else prev)
                continue
            silent = now - seen[1]
            doubt = min(seen[1] - seen[2] + self.beat, hj.hang_timeout / 2)
            if silent >= hj.hang_timeout:
                sure.append(r)
            elif silent + doubt >= hj.hang_timeout:
                maybe.append(r)
        if sure:
            hj.hanging = True
            self.work._spawn(self._hang(hj, sorted(sure + maybe)))

    async def _hang(self, hj: HeadJob, ranks: list[int]) -> None:
        """Dump the hung ranks' stacks on their nodes (each agent runs the node runtime's dump script),
        then fail the gang with the hang's reason: every agent cancels."""
        reason = hang_reason(hj.hang_timeout, ranks)
        log.warning("Job %s: %s; dumping their stacks, then cancelling the gang", hj.job, reason)
        by_node: dict[str, list[int]] = {}
        for r in ranks:
            by_node.setdefault(hj.node_of[r], []).append(r)
        waits: list[Any] = []
        for node, rs in by_node.items():
            if node == self.node:
                waits.append(self.work.dump(hj.job, rs, reason))
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            hj.dumps[node] = fut
            link = self.links.get(node)
            if link is None or not await link.send(
                {"op": "dump", "job": hj.job, "ranks": rs, "reason": reason}
            ):
                fut.set_result(None)
            waits.append(fut)
        try:
            await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), DUMP_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("Job %s: a stack dump took over %.0fs; cancelling the gang", hj.job, DUMP_TIMEOUT)
        if hj.cancel is None:
            node = hj.node_of[ranks[0]]
            hj.cause = {"rank": ranks[0], "code": None, "oom": False, "node": node, "why": reason}
            self.decide(hj, "failed", reason, reason)

    def on_dumped(self, node: str, job: str) -> None:
        hj = self.jobs.get(job)
        fut = hj.dumps.get(node) if hj else None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _node_done(self, hj: HeadJob, node: str) -> bool:
        return all(hj.ranks.get(r, {}).get("state") in TERMINAL for r in hj.nodes[node])

    async def housekeeping(self) -> None:
        while True:
            await asyncio.sleep(min(self.beat, self.lost_after / 4))
            try:
                self.housekeep()
            except Exception:
                log.exception("Housekeeping failed")

    # the control plane
    async def start(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = str(msg.get("job", ""))
        plan = msg.get("nodes")
        if not JOB_RE.fullmatch(job) or not isinstance(plan, dict) or not plan:
            return {"ok": False, "error": "start needs a job id and a plan per node"}
        if not isinstance(msg.get("cancel_script"), str):
            return {"ok": False, "error": "start needs the node runtime's cancel script"}
        if job in self.jobs:
            return {"ok": False, "error": f"job {job} was started already"}
        missing = sorted(n for n in plan if not self.up(n))
        if missing:
            # nodes the head cannot reach: the control plane uses the per-node path instead
            return {"ok": False, "error": "unreachable", "nodes": missing}
        now = time.monotonic()
        orphan_timeout, hang_timeout = (
            float(msg.get("orphan_timeout") or 0),
            float(msg.get("hang_timeout") or 0),
        )
        dump_script = str(msg.get("dump_script") or "")
        # a node silent this long is lost (never below two heartbeats)
        lost_after = max(2 * self.beat, float(msg.get("lost_after") or self.lost_after))
        first = self.jobs.get(str(msg.get("attempt_of") or ""))
        if msg.get("attempt_of") and first is None:  # the watcher starts it node by node instead
            return {"ok": False, "error": f"no job {msg.get('attempt_of')} on this head"}
        if first is not None:
            # a later attempt of a gang (whole-gang retries): its first attempt's dead-man's switch,
            # hang watch and lost_after, which the watcher starting it does not know
            orphan_timeout, hang_timeout = first.orphan_timeout, first.hang_timeout
            dump_script, lost_after = first.dump_script, first.lost_after
        hj = HeadJob(job, plan, orphan_timeout, now, hang_timeout if dump_script else 0.0)
        hj.dump_script, hj.lost_after = dump_script, lost_after
        self.jobs[job] = hj
        self._forget()
        loop = asyncio.get_running_loop()
        timeout = float(msg.get("timeout") or 120)
        common = {
            "job": job,
            "grace": float(msg.get("grace", 3.0)),
            "cancel_script": msg["cancel_script"],
            "dump_script": dump_script,
            "lost_after": lost_after,
        }
        for node, p in plan.items():
            run = {
                "op": "run",
                **common,
                "ranks": p["ranks"],
                "script": p["script"],
                "args": p.get("args") or [],
                "flag": p.get("flag", ""),
            }
            run["timeout"] = timeout
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            hj.started[node] = fut
            if node == self.node:
                self.work._spawn(_settle(fut, self.work.run(run)))
            else:
                # the agent watches its ranks from this message on: a failure during the start counts
                self.work._spawn(_send_run(fut, self.links[node], run))
        results: dict[str, Any] = {}
        for node, fut in hj.started.items():
            try:
                results[node] = await asyncio.wait_for(
                    asyncio.shield(fut), max(1.0, timeout - (time.monotonic() - now))
                )
            except asyncio.TimeoutError:
                results[node] = {"rc": None, "out": "", "error": "the node did not answer the start"}
        hj.contact = time.monotonic()
        return {"ok": True, "job": job, "nodes": results, "state": hj.state}

    def status(self, job: str, touch: bool = True, logs_from: Any = None, max_log: Any = 0) -> dict[str, Any]:
        """The gang's state and every rank's; with ``logs_from`` (rank -> the watcher's offset in its
        log) also up to ``max_log`` new log bytes of each from the head's windows."""
        hj = self.jobs.get(job)
        if hj is None:
            return {"ok": False, "error": f"no job {job} on this head"}
        if touch:  # a watcher's poll keeps the dead-man's switch away; a one-off look (peek) does not
            hj.contact = time.monotonic()
        logs = self._log_bytes(hj, logs_from, max_log)
        ranks = []
        for r in sorted(hj.node_of):
            rec = dict(hj.ranks.get(r) or {"rank": r, "state": "pending"})
            rec.update(logs.get(r, {}))
            rec["node"] = hj.node_of[r]
            if "log" not in rec and r in hj.logs:
                size = hj.logs[r]
                rec["log"], rec["progress"] = (size[0], size[1]) if isinstance(size, list) else (size, None)
            if rec["node"] in hj.lost and rec.get("state") not in TERMINAL:
                rec["state"], rec["why"] = "lost", f"node {rec['node']} lost: {hj.lost[rec['node']]}"
            ranks.append(rec)
        return {
            "ok": True,
            "job": job,
            "state": hj.state,
            "reason": hj.reason,
            "cause": hj.cause,
            "decided": hj.decided,
            "done": hj.done(),
            "ranks": ranks,
            "nodes": self.nodes(),
            "ships": True,  # the agents ship running ranks' logs here (a head without: read the nodes)
            "hang": hj.hang_timeout,  # the head finds hung ranks (watchers leave that to it)
        }

    def cancel(self, job: str, reason: str) -> dict[str, Any]:
        hj = self.jobs.get(job)
        if hj is None:
            return {"ok": False, "error": f"no job {job} on this head"}
        hj.contact = time.monotonic()
        if hj.cancel is None:
            self.decide(hj, "cancelled", reason or "cancelled", reason or "cancelled")
        return {"ok": True, "job": job, "state": hj.state}

    def nodes(self) -> dict[str, Any]:
        now = time.monotonic()
        return {n: {"up": self.up(n), "heard": round(now - link.heard, 3)} for n, link in self.links.items()}

    def _forget(self) -> None:
        while len(self.jobs) > MAX_JOBS:
            old = next((j for j, hj in self.jobs.items() if hj.done()), None)
            if old is None:
                return
            del self.jobs[old]


async def _settle(fut: asyncio.Future[dict[str, Any]], coro: Any) -> None:
    try:
        res = await coro
    except Exception as exc:
        res = {"rc": None, "out": "", "error": str(exc)}
    if not fut.done():
        fut.set_result(res)


async def _send_run(fut: asyncio.Future[dict[str, Any]], link: Link, run: dict[str, Any]) -> None:
    if not await link.send(run) and not fut.done():
        fut.set_result({"rc": None, "out": "", "error": f"the start could not be sent to node {link.node}"})


# -- the head's server ---------------------------------------------------------------------------


class Server:
    """The head's listener: handshake (bounded: see :data:`MAX_PENDING`), then each connection is an
    agent's link or a control-plane session."""

    def __init__(self, head: Head, token: bytes) -> None:
        self.head, self.token = head, token
        #: per host: the connections that have not proven the token yet, oldest first, with their arrival
        self.by_peer: dict[str, collections.OrderedDict[int, tuple[asyncio.StreamWriter, float]]] = {}
        self.npending = 0
        self.conns = 0
        self.rejected = 0

    def _evict(self, ip: str, key: int) -> None:
        writer, _ = self.by_peer[ip].pop(key)
        if not self.by_peer[ip]:
            del self.by_peer[ip]
        self.npending -= 1
        writer.close()

    def sweep(self) -> None:
        """Drop the silent excess of every host, then the oldest of the busiest while over the total."""
        now = time.monotonic()
        for ip in list(self.by_peer):
            group = self.by_peer[ip]
            while len(group) > PEER_PENDING:
                key, (_, since) = next(iter(group.items()))
                if now - since < PEER_GRACE:
                    break
                self._evict(ip, key)
        while self.npending > MAX_PENDING:
            ip = max(self.by_peer, key=lambda h: len(self.by_peer[h]))
            self._evict(ip, next(iter(self.by_peer[ip])))

    async def sweeping(self) -> None:
        while True:
            await asyncio.sleep(PEER_GRACE / 2)
            self.sweep()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key = id(writer)
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self.by_peer.setdefault(ip, collections.OrderedDict())[key] = (writer, time.monotonic())
        self.npending += 1
        self.sweep()
        try:
            if self.conns >= MAX_CONNS:
                raise ProtocolError("too many connections")
            chan = await asyncio.wait_for(server_handshake(reader, writer, self.token), HANDSHAKE_TIMEOUT)
            hello = await chan.recv(HANDSHAKE_TIMEOUT)
            self._settled(key, ip)
            self.conns += 1
            try:
                await self.session(chan, hello)
            finally:
                self.conns -= 1
        except (
            ProtocolError,
            asyncio.IncompleteReadError,
            asyncio.TimeoutError,
            ConnectionError,
            OSError,
        ) as exc:
            self.rejected += 1
            log.debug("Dropped a connection: %s", exc)
        except Exception:
            log.exception("A connection failed")
        finally:
            self._settled(key, ip)
            writer.close()

    def _settled(self, key: int, ip: str) -> None:
        group = self.by_peer.get(ip)
        if group is not None and key in group:
            del group[key]
            self.npending -= 1
            if not group:
                del self.by_peer[ip]

    async def session(self, chan: Channel, hello: dict[str, Any]) -> None:
        role = hello.get("role")
        if hello.get("op") != "hello" or role not in ("agent", "control"):
            raise ProtocolError("the first message must be a hello")
        if role == "agent":
            node = str(hello.get("node", ""))
            if not NODE_RE.fullmatch(node) or node == self.head.node:
                await chan.send({"op": "refused", "error": f"bad node id {node!r}"})
                return
            await chan.send({"op": "welcome", "node": self.head.node})
            jobs = hello.get("jobs")
            link = self.head.attach(node, chan, jobs if isinstance(jobs, dict) else {})
            log.info("Node %s joined from %s", node, chan.peer)
            while True:
                msg = await chan.recv(max(self.head.lost_after * 3, 30.0))
                if self.head.links.get(node) is not link:
                    return  # replaced by a newer connection of the same agent
                link.heard = time.monotonic()
                op = msg["op"]
                if op == "beat":
                    self.head.on_logs(node, msg.get("logs"))
                    self.head.on_tails(node, msg.get("tails"))
                    await chan.send({"op": "ack"})
                elif op == "report":
                    recs = msg.get("ranks")
                    self.head.on_report(node, str(msg.get("job")), recs if isinstance(recs, list) else [])
                elif op == "dumped":
                    self.head.on_dumped(node, str(msg.get("job")))
                elif op == "ran":
                    hj = self.head.jobs.get(str(msg.get("job")))
                    fut = hj.started.get(node) if hj else None
                    if fut is not None and not fut.done():
                        fut.set_result({k: msg.get(k) for k in ("rc", "out", "error", "skipped") if k in msg})
                else:
                    raise ProtocolError(f"an agent may not send {op!r}")
        await chan.send({"op": "welcome", "node": self.head.node})
        while True:
            msg = await chan.recv(CONTROL_IDLE)
            op = msg["op"]
            if op == "start":
                reply = await self.head.start(msg)
            elif op == "status":
                reply = self.head.status(
                    str(msg.get("job")), not msg.get("peek"), msg.get("logs_from"), msg.get("max_log", 0)
                )
            elif op == "cancel":
                reply = self.head.cancel(str(msg.get("job")), str(msg.get("reason") or ""))
            elif op == "nodes":
                reply = {"ok": True, "head": self.head.node, "nodes": self.head.nodes()}
            else:
                raise ProtocolError(f"the control plane may not send {op!r}")
            reply["op"] = "reply"
            reply["id"] = msg.get("id")
            await chan.send(reply)


# -- a worker: every node but the head -----------------------------------------------------------


class Worker:
    """Connects to the head, reports its node's ranks, runs what the head says, and stops its ranks
    once the head has been silent for ``lost_after`` (a lost head: all or nothing)."""

    def __init__(
        self, node: str, head: tuple[str, int], token: bytes, lost_after: float, beat: float
    ) -> None:
        self.node, self.head, self.token = node, head, token
        self.lost_after, self.beat = lost_after, beat
        self.heard = time.monotonic()
        self.chan: Channel | None = None
        self.work: NodeWork  # set by the caller
        self.head_lost = False
        self.unsent: set = set()  # jobs whose report found no link to the head

    def report(self, job: str, recs: list[dict[str, Any]]) -> None:
        chan = self.chan
        if chan is not None:
            self.work._spawn(self._send(chan, {"op": "report", "job": job, "ranks": recs}))
        else:  # sent again once linked: the next hello may have been read before this change
            self.unsent.add(job)

    async def _send(self, chan: Channel, msg: dict[str, Any]) -> None:
        try:
            await chan.send(msg)
        except Exception as exc:  # the link is re-made; the next hello carries every rank's state
            log.info("Could not send %s to the head: %s", msg.get("op"), exc)
            chan.close()

    async def run(self) -> None:
        backoff = min(0.2, self.beat)
        while True:
            try:
                hello = {"op": "hello", "role": "agent", "node": self.node, "jobs": self.work.state()}
                chan = await connect(self.head[0], self.head[1], self.token, hello, max(self.beat * 2, 2.0))
            except Exception as exc:
                log.debug("The head at %s:%s did not answer: %s", self.head[0], self.head[1], exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.beat)
                continue
            backoff = min(0.2, self.beat)
            self.heard = time.monotonic()
            if self.head_lost:
                log.info("The head answers again")
            self.chan = chan
            # what changed while the link was being made (the hello's records were read before it)
            unsent, self.unsent = self.unsent, set()
            for job in unsent:
                nj = self.work.jobs.get(job)
                if nj is not None:
                    self.report(job, list(nj.recs.values()))
            beats = asyncio.ensure_future(self._beats(chan))
            try:
                while True:
                    msg = await chan.recv(self.lost_after)
                    self.heard = time.monotonic()
                    op = msg["op"]
                    if op == "run":
                        self.work.prepare(msg)
                        self.work._spawn(self._run(chan, msg))
                    elif op == "cancel":
                        self.work.cancel(
                            str(msg.get("job")), str(msg.get("reason")), bool(msg.get("orphaned"))
                        )
                    elif op == "dump":
                        self.work._spawn(self._dump(chan, msg))
                    elif op != "ack":
                        raise ProtocolError(f"the head may not send {op!r}")
            except Exception as exc:
                log.info("Lost the link to the head: %s", exc or type(exc).__name__)
            finally:
                self.chan = None
                beats.cancel()
                chan.close()

    async def _run(self, chan: Channel, msg: dict[str, Any]) -> None:
        try:
            res = await self.work.run(msg)
        except Exception as exc:
            res = {"rc": None, "out": "", "error": str(exc)}
        # on the link of now: one made again while the script ran still gets the answer to the head.
        # Sent from a task of its own, queued after the report of the ranks it started (``run``'s last
        # read): tasks start in order and the channel's lock is fair, so the head hears the ranks
        # running before the start's answer, and a status right after the start never says "pending"
        ran = {"op": "ran", "job": msg.get("job"), **res}
        self.work._spawn(self._send(self.chan or chan, ran))

    async def _dump(self, chan: Channel, msg: dict[str, Any]) -> None:
        job = str(msg.get("job"))
        try:
            await self.work.dump(job, msg.get("ranks"), str(msg.get("reason")))
        finally:
            self.work._spawn(self._send(self.chan or chan, {"op": "dumped", "job": job}))

    async def _beats(self, chan: Channel) -> None:
        while True:
            await asyncio.sleep(self.beat)
            sizes = self.work.log_sizes()
            await self._send(chan, {"op": "beat", "logs": sizes, "tails": self.work.log_tails(sizes)})

    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(self.beat, self.lost_after / 4))
            silent = time.monotonic() - self.heard
            if self.work.stop_lost(silent, self.lost_after) or silent >= self.lost_after:
                if not self.head_lost:
                    log.warning("The head has been silent for %.1fs: stopping this node's ranks", silent)
                self.head_lost = True
            else:
                self.head_lost = False


# -- the program ---------------------------------------------------------------------------------


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def read_token(path: str) -> bytes:
    """The cluster's token: from stdin (``-``, first line) or a file only its owner can read."""
    if path == "-":
        token = sys.stdin.buffer.readline().strip()
    else:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise SystemExit(f"sky-agent: the token file {path} is readable by others: chmod 600 it")
        with open(path, "rb") as f:
            token = f.read().strip()
    if len(token) < 16:
        raise SystemExit("sky-agent: the cluster token must be at least 16 bytes")
    return token


def _more_files() -> None:
    """A head keeps a connection per node: lift the soft limit on open files to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


async def amain(args: argparse.Namespace, token: bytes) -> None:
    if args.head is None:
        head: Head | None = None

        def report(job: str, recs: list[dict[str, Any]]) -> None:
            assert head is not None
            head.on_report(args.node, job, recs)

        work = NodeWork(args.node, report, args.scan)
        head = Head(args.node, work, args.lost_after, args.beat)
        server = Server(head, token)
        host, port = args.listen
        srv = await asyncio.start_server(server.handle, host, port, limit=64 * 1024, backlog=1024)
        bound = srv.sockets[0].getsockname()[1]
        if args.port_file:
            tmp = f"{args.port_file}.{os.getpid()}"
            _write(tmp, f"{bound}\n")
            os.replace(tmp, args.port_file)
        log.info("Head agent of node %s listening on %s:%s", args.node, host, bound)
        duties = [work.watch(), head.housekeeping(), server.sweeping()]
    else:
        worker = Worker(args.node, args.head, token, args.lost_after, args.beat)
        worker.work = NodeWork(args.node, worker.report, args.scan)
        log.info("Agent of node %s reporting to %s:%s", args.node, *args.head)
        duties = [worker.work.watch(), worker.run(), worker.watchdog()]
    if os.getpid() == 1:
        duties.append(reaper())
    # SIGTERM (a pod deleted, a teardown) ends the agent at once; as pid 1 it would be ignored otherwise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(d) for d in duties]
    tasks.append(asyncio.ensure_future(stop.wait()))
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    for t in done:
        exc = t.exception()
        if exc is not None:
            raise exc
    log.info("Agent of node %s stopping", args.node)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="sky-agent", description="airflow-provider-sky's node agent")
    p.add_argument("--node", required=True, help="this node's id")
    p.add_argument("--token-file", required=True, help="the cluster's token: a 0600 file, or - for stdin")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--listen", type=_addr, help="HOST:PORT: this node is the head")
    role.add_argument("--head", type=_addr, help="HOST:PORT of the head's agent")
    p.add_argument("--port-file", help="the head writes the port it listens on here")
    p.add_argument("--beat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument(
        "--lost-after", type=float, default=10.0, help="seconds of silence after which a peer is lost"
    )
    p.add_argument("--scan", type=float, default=0.05, help="seconds between reads of the rank directories")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not NODE_RE.fullmatch(args.node):
        p.error(f"--node {args.node!r} must match {NODE_RE.pattern}")
    if args.beat <= 0 or args.lost_after <= args.beat or args.scan <= 0:
        p.error("--beat and --scan must be positive and --lost-after longer than --beat")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s sky-agent[{args.node}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    token = read_token(args.token_file)
    _more_files()
    try:
        asyncio.run(amain(args, token))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
