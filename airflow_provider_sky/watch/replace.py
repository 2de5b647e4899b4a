"""Lost nodes replaced between two attempts of a gang: the healthy nodes are kept.

Why here (the gang layer) and not in a backend: the backend only makes a node (``Backend.replace_nodes``);
what a rank needs on it is the job's, and the job lives on the nodes. A replacement node gets, from a
healthy rank's node (the donor), attempt 1's files (``cmd.sh``, ``rank.sh``, ``env``, the 0600 copy of
the secrets and their mask) under ``<job>.seed/<rank>`` with its own rank in ``env``, and the cluster's
newest setup (command, env) is run on it as job ``<job>.r<attempt>`` before the attempt starts. The next
attempt's ``SKYPILOT_NODE_IPS`` and ``MASTER_ADDR`` list the new address on every rank
(``runtime_retry.RELAUNCH_SCRIPT``). Whoever watches the gang may be a triggerer that never saw the task
spec: the nodes' own files are all it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from airflow_provider_sky.backends.base import BackendError, ClusterHandle, node_devices, recorded_resources
from airflow_provider_sky.model.gang import BAD, CUDA_VISIBLE_DEVICES, LOST, GangStatus
from airflow_provider_sky.node import runtime
from airflow_provider_sky.node.scripts import load
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.watch.jobs import GangClient, fan_out

log = logging.getLogger(__name__)

#: seconds a probe of a lost rank's node may take before the node counts as gone
PROBE_TIMEOUT = 10.0
#: seconds setup may run on a replacement node
SETUP_TIMEOUT = 3600.0
#: a synced ``workdir`` larger than this (KiB on the donor) is not copied node to node
WORKDIR_MAX_KB = 256 * 1024
#: ``home``: the donor's ``sky_workdir`` as a gzipped tar in base64, or ``TOOBIG <kb>`` / ``NONE``
WORKDIR_READ = load("replace_workdir_read.sh")
#: the node answers and still has its runtime directory: it is kept (a lost rank there is relaunched)
PROBE_SCRIPT = '[ -d "$1/jobs" ] && echo ALIVE; exit 0'

#: ``root job rank``: attempt 1's files of that rank (or its seed on a replacement node) and the node's
#: newest setup, as ``@@FILE <name> <bytes>`` blocks; ``NOSRC`` when attempt 1's files are gone
BUNDLE_SCRIPT = load("replace_bundle.sh")


@dataclass
class Bundle:
    """What a donor node holds of the job: ``run/<file>`` and ``setup/<file>`` contents."""

    files: dict[str, bytes] = field(default_factory=dict)
    #: the donor node's home: its working directories are moved under a new node's own
    home: str = ""
    #: the donor's ``sky_workdir`` (a gzipped tar in base64), when the job runs in one
    workdir: str = ""

    @classmethod
    def parse(cls, out: bytes) -> Bundle:
        files: dict[str, bytes] = {}
        pos = 0
        while True:
            at = out.find(b"@@FILE ", pos)
            if at < 0:
                break
            eol = out.index(b"\n", at)
            _, name, size = out[at:eol].decode().split(" ")
            start = eol + 1
            files[name] = out[start : start + int(size)]
            pos = start + int(size)
        return cls(files)

    def text(self, name: str) -> str:
        return self.files.get(name, b"").decode("utf-8", "replace")

    def cwd(self, name: str, home: str) -> str:
        """The donor's working directory ``name`` on a node whose home is ``home``."""
        cwd = self.text(name).rstrip("\n")
        old = self.home
        if old and (cwd == old or cwd.startswith(old.rstrip("/") + "/")):
            cwd = home.rstrip("/") + cwd[len(old.rstrip("/")) :] if cwd != old else home
        return cwd


@dataclass
class Replaced:
    """What a replacement did: rank -> (old ip, new ip); '' error when it went well."""

    swaps: dict[int, tuple[str, str]] = field(default_factory=dict)
    error: str = ""
    #: the note as the watcher that did the replacement wrote it on the nodes (read by the others)
    said: str = ""

    def note(self) -> str:
        if self.said or not self.swaps:
            return self.said
        return "; " + "; ".join(
            f"rank {r}'s node {old} was replaced by {new}" for r, (old, new) in sorted(self.swaps.items())
        )


def lost_ranks(status: GangStatus) -> list[int]:
    """The ranks an attempt reported lost (their node stopped answering or lost its directory)."""
    return [r.rank for r in status.ranks if r.state == LOST]


async def _probe(client: GangClient, rank: int) -> bool:
    """The node is there: it answers with its runtime directory, and its backend does not say it ended
    (an EC2 instance terminated: something else may answer at its address)."""
    node = client.node_of(rank)
    try:
        res = await client.runner(node).arun_script(PROBE_SCRIPT, [node.root], timeout=PROBE_TIMEOUT)
    except (RunnerError, OSError, asyncio.TimeoutError) as exc:
        log.info("Rank %s's node %s does not answer: %s", rank, node.ip, exc)
        return False
    if "ALIVE" not in res.text:
        return False
    try:
        ended = await asyncio.to_thread(client.backend.lost_reason, node)
    except Exception as exc:  # the backend could not tell: the node answered, so it stays
        log.info("Could not ask the backend about rank %s's node %s: %s", rank, node.ip, exc)
        return True
    if ended:
        log.info("Rank %s's node %s answers, but %s", rank, node.ip, ended)
    return not ended


async def gone_nodes(client: GangClient, ranks: Sequence[int]) -> list[int]:
    """Those of ``ranks`` whose node is gone (does not answer, or lost its runtime directory)."""
    alive = await fan_out(lambda r: _probe(client, r), list(ranks))
    return [r for r, ok in zip(ranks, alive, strict=True) if ok is not True]


async def refresh_handle(client: GangClient) -> None:
    """Take the cluster's recorded nodes when a lost node was replaced since ``client.handle`` was made
    (a watcher that restarted holds the handle the cluster task pushed)."""
    try:
        found = await asyncio.to_thread(client.backend.find, client.handle.name)
    except Exception as exc:  # the record may be on a lost head: keep what we have
        log.info("Could not read cluster %s's record: %s", client.handle.name, exc)
        return
    if found is None or not found.extra.get("replaced") or len(found.nodes) != client.num_ranks:
        return
    _swap_handle(client, found)


def _key(node: object) -> tuple[object, ...]:
    return (getattr(node, "ip", None), getattr(node, "node_id", None), getattr(node, "root", None))


def _swap_handle(client: GangClient, new: ClusterHandle) -> None:
    old = client.handle
    for a, b in zip(old.nodes, new.nodes, strict=True):
        if _key(a) != _key(b):
            runner = client._runners.pop(a.node_id, None)
            if runner is not None:
                runner.close()
            client._runners.pop(b.node_id, None)
    client.handle = new


def _lines(env: dict[str, str]) -> bytes:
    return runtime.env_file(env).encode()


def _seed_script(root: str, seed: str, files: dict[str, bytes]) -> str:
    """Write ``files`` into ``<root>/jobs/<seed>`` unless it exists (its ``mkdir`` is the claim)."""
    q = shlex.quote
    parts = [
        "set -e",
        "umask 077",
        f"root={q(root)}",
        f'd="$root/jobs"/{q(seed)}',
        '[ -d "${d%/*}" ] || mkdir -p "${d%/*}"',
        'if ! mkdir "$d" 2>/dev/null; then echo EXISTS; exit 0; fi',
    ]
    for name, data in files.items():
        parts.append(f"printf '%s' {q(data.decode('utf-8', 'replace'))} > \"$d\"/{q(name)}")
    parts.append("echo SEEDED")
    return "\n".join(parts) + "\n"


#: start a seeded setup rank (``dir cwd``) detached, as a gang start does; prints its pid once recorded
START_SCRIPT = load("replace_start.sh")


async def replace_lost(
    client: GangClient, job_id: str, status: GangStatus, attempt: int, poll_interval: float = 0.5
) -> Replaced:
    """Before attempt ``attempt``: a new node for each lost rank whose node is gone, seeded with the job
    and set up. Nodes that answer are kept (their lost rank is just started again)."""
    lost = lost_ranks(status)
    if not lost:
        return Replaced()
    gone = await gone_nodes(client, lost)
    if not gone:
        return Replaced()
    healthy = [r for r in range(client.num_ranks) if r not in gone]
    if not healthy:
        return Replaced(
            error=f"every node of the cluster was lost (ranks {gone}): nothing to start again from"
        )
    donor = healthy[0]
    dnode = client.node_of(donor)
    try:
        res = await client.runner(dnode).arun_script(
            BUNDLE_SCRIPT, [dnode.root, runtime.check_job_id(job_id), str(donor)], timeout=60
        )
    except RunnerError as exc:
        return Replaced(error=f"could not read the job from rank {donor}'s node {dnode.ip}: {exc}")
    if res.returncode != 0 or b"NOSRC" in res.stdout[:16]:
        return Replaced(error=f"rank {donor}'s node {dnode.ip} no longer holds the job's files")
    bundle = Bundle.parse(res.stdout)
    old = client.handle
    try:
        new = await asyncio.to_thread(client.backend.replace_nodes, old, gone)
    except BackendError as exc:
        where = ", ".join(f"rank {r} ({old.nodes[r].ip})" for r in gone)
        return Replaced(error=f"lost node(s) of {where} not replaced: {exc}")
    _swap_handle(client, new)
    done = Replaced(swaps_between(old, new))
    for r, (was, now) in sorted(done.swaps.items()):
        log.info("Job %s: rank %s's node %s replaced by %s", job_id, r, was, now)
    bundle.home = dnode.home
    if bundle.cwd("run/cwd", dnode.home).endswith("/sky_workdir"):  # the job runs in a synced workdir
        try:
            res = await client.runner(dnode).arun_script(
                WORKDIR_READ, [dnode.home, str(WORKDIR_MAX_KB)], timeout=300
            )
        except RunnerError as exc:
            return Replaced(done.swaps, f"could not read the workdir on rank {donor}'s node: {exc}")
        if res.text.startswith("TOOBIG"):
            kb = res.text.split()[1]
            return Replaced(
                done.swaps,
                f"the workdir ({kb} KiB) is over {WORKDIR_MAX_KB} KiB: not copied to a new node (fetch it in setup)",
            )
        if not res.text.startswith("NONE"):
            bundle.workdir = res.text
    errors = await fan_out(lambda r: _prepare(client, job_id, bundle, r, attempt, poll_interval), gone)
    said = [str(e) for e in errors if isinstance(e, BaseException)] + [
        e for e in errors if isinstance(e, str) and e
    ]
    done.error = "; ".join(said)
    return done


async def _prepare(
    client: GangClient, job_id: str, bundle: Bundle, rank: int, attempt: int, poll_interval: float
) -> str:
    """Seed rank ``rank``'s new node with the job and run the cluster's setup there: '' or why not."""
    h = client.handle
    node = client.node_of(rank)
    res_ = recorded_resources(h)
    devices = node_devices(node, res_.accelerators if res_ else None)
    mine = {"SKYPILOT_NODE_RANK": str(rank), "NODE_RANK": str(rank), "RANK": str(rank)}
    if devices is not None:
        mine[CUDA_VISIBLE_DEVICES] = ",".join(str(d) for d in devices)
    run = {k[4:]: v for k, v in bundle.files.items() if k.startswith("run/")}
    run["env"] = run.get("env", b"") + _lines(mine)
    run["cwd"] = (bundle.cwd("run/cwd", node.home) + "\n").encode()
    runner = client.runner(node)
    if bundle.workdir:
        script = f"mkdir -p {shlex.quote(node.home)} && cd {shlex.quote(node.home)} && base64 -d <<'SKY_EOF' | tar -xzf -\n{bundle.workdir}\nSKY_EOF\n"
        out = await runner.arun_script(script, timeout=300)
        if out.returncode != 0:
            return f"rank {rank}'s new node {node.ip}: could not copy the workdir there: {out.error_text}"
    seed = runtime.check_job_id(f"{job_id}.seed")
    out = await runner.arun_script(_seed_script(node.root, f"{seed}/{rank}", run), timeout=60)
    if out.returncode != 0:
        return f"rank {rank}'s new node {node.ip}: could not write the job there: {out.error_text}"
    if "setup/cmd.sh" not in bundle.files:
        return ""
    setup_id = runtime.check_job_id(f"{job_id}.r{int(attempt)}")
    senv = {"SKYPILOT_SETUP_NODE_RANK": str(rank), "SKYPILOT_SETUP_NODE_IPS": "\n".join(h.ips)}
    if devices is not None:
        senv[CUDA_VISIBLE_DEVICES] = mine[CUDA_VISIBLE_DEVICES]
    files = {
        "cmd.sh": bundle.files["setup/cmd.sh"],
        "rank.sh": bundle.files["run/rank.sh"],
        "env": bundle.files.get("setup/env", b"") + _lines(senv),
        "cwd": (bundle.cwd("setup/cwd", node.home) + "\n").encode(),
        "orphan_timeout": bundle.files.get("run/orphan_timeout", b"0\n"),
        "polled": f"{time.time():.3f}\n".encode(),
    }
    if "run/secrets.keep" in bundle.files:  # the run's secrets are the setup's (one task spec)
        files["secrets"] = bundle.files["run/secrets.keep"]
    if "run/mask.keep" in bundle.files:
        files["mask"] = bundle.files["run/mask.keep"]
    out = await runner.arun_script(_seed_script(node.root, f"{setup_id}/{rank}", files), timeout=60)
    if out.returncode != 0:
        return f"rank {rank}'s new node {node.ip}: could not write its setup: {out.error_text}"
    cwd = bundle.cwd("setup/cwd", node.home)
    d = f"{node.root}/jobs/{setup_id}/{rank}"
    out = await runner.arun_script(START_SCRIPT, [d, cwd], timeout=60)
    if "STARTED" not in out.text:
        return f"rank {rank}'s new node {node.ip}: setup did not start: {out.error_text or out.text.strip()}"
    log.info("Job %s: running setup on rank %s's new node %s (job %s)", job_id, rank, node.ip, setup_id)
    deadline = time.monotonic() + SETUP_TIMEOUT
    while True:
        st = (await client.apoll(setup_id, max_log=0, ranks=[rank])).status.by_rank(rank)
        if st.terminal:
            break
        if time.monotonic() > deadline:
            await client.acancel(setup_id, [rank], grace=1.0, reason="setup took too long")
            return f"rank {rank}'s new node {node.ip}: setup still ran after {SETUP_TIMEOUT:g}s"
        await asyncio.sleep(poll_interval)
    tail = ""
    try:
        tail = await client.alog_tail(setup_id, rank, st.log_size)
    except RunnerError:
        pass
    for line in tail.splitlines()[-20:]:
        log.info("(setup on rank %s's new node) %s", rank, line)
    if st.state in BAD:
        return (
            f"setup failed on rank {rank}'s new node {node.ip} (exit code {st.exit_code}: {st.reason}); "
            f"its last lines: {tail.strip()[-1000:]}"
        )
    return ""


#: seconds without a heartbeat after which another watcher takes over a replacement (its watcher died)
CLAIM_STALE = 60.0
#: seconds between two heartbeats of the watcher doing a replacement
CLAIM_BEAT = 5.0
#: The replacement before attempt ``k`` is done once, by the watcher whose ``mkdir`` of ``replace.<k>``
#: (in a kept rank's attempt-1 directory) succeeds; the others wait for its ``done`` (``OK`` or ``ERR
#: <why>``), so no two watchers replace one node twice or start an attempt before a new node's setup
#: ended. ``root job rank k verb value``: verbs ``claim now`` (prints ``CLAIMED``, ``DONE`` + the result
#: or ``BUSY <last beat>``), ``beat now``, ``done result``, ``drop``, ``read`` (``DONE`` + the result,
#: or nothing).
CLAIM_SCRIPT = load("replace_claim.sh")


def swaps_between(old: ClusterHandle, new: ClusterHandle) -> dict[int, tuple[str, str]]:
    """rank -> (old ip, new ip) for each node that differs (a replacement another watcher made)."""
    if len(old.nodes) != len(new.nodes):
        return {}
    return {
        r: (a.ip, b.ip)
        for r, (a, b) in enumerate(zip(old.nodes, new.nodes, strict=True))
        if _key(a) != _key(b)
    }


async def replace_once(
    client: GangClient, job_id: str, status: GangStatus, attempt: int, poll_interval: float = 0.5
) -> Replaced:
    """:func:`replace_lost`, done by one watcher of all those retrying the gang (the others wait for it,
    then read the cluster's new nodes); a watcher that died doing it is taken over after
    :data:`CLAIM_STALE` seconds without its heartbeat."""
    lost = lost_ranks(status)
    kept = [r for r in range(client.num_ranks) if r not in lost]
    if not lost:
        return Replaced()
    if not kept:
        return Replaced(
            error=f"every node of the cluster was lost (ranks {lost}): nothing to start again from"
        )
    donor, before = kept[0], client.handle
    node = client.node_of(donor)

    async def call(verb: str, value: str = "") -> str:
        args = [node.root, runtime.check_job_id(job_id), str(donor), str(int(attempt)), verb, value]
        return (await client.runner(node).arun_script(CLAIM_SCRIPT, args, timeout=60)).text

    async def beat() -> None:
        while True:
            await asyncio.sleep(CLAIM_BEAT)
            try:
                await call("beat", f"{time.time():.3f}")
            except RunnerError as exc:
                log.warning("Job %s: the replacement's heartbeat failed: %s", job_id, exc)

    while True:
        try:
            said = await call("claim", f"{time.time():.3f}")
        except RunnerError as exc:
            return Replaced(error=f"could not coordinate the replacement on rank {donor}'s node: {exc}")
        if said.startswith("CLAIMED"):
            beating = asyncio.ensure_future(beat())
            try:
                done = await replace_lost(client, job_id, status, attempt, poll_interval)
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
            with contextlib.suppress(RunnerError):
                await call("done", f"ERR {done.error}" if done.error else f"OK{done.note()}")
            return done
        if said.startswith("DONE"):
            result = said.split("\n", 1)[1].strip() if "\n" in said else ""
            await refresh_handle(client)
            if result.startswith("ERR"):
                return Replaced(swaps_between(before, client.handle), result[4:])
            return Replaced(swaps_between(before, client.handle), said=result[2:])
        words = said.split()
        last = float(words[1]) if len(words) > 1 and words[0] == "BUSY" else 0.0
        if time.time() - last > CLAIM_STALE:
            log.warning(
                "Job %s: the replacement before attempt %s was left unfinished: taking it over",
                job_id,
                attempt,
            )
            await call("drop")
            continue
        await asyncio.sleep(max(0.2, poll_interval))


async def recorded_note(client: GangClient, job_id: str, status: GangStatus, attempt: int) -> str:
    """What the replacement before ``attempt`` did, as its watcher wrote it on the nodes ('' if none):
    a watcher that follows an attempt another one started says it at the boundary too."""
    lost = lost_ranks(status)
    kept = [r for r in range(client.num_ranks) if r not in lost]
    if not lost or not kept:
        return ""
    node = client.node_of(kept[0])
    args = [node.root, runtime.check_job_id(job_id), str(kept[0]), str(int(attempt)), "read", ""]
    try:
        said = (await client.runner(node).arun_script(CLAIM_SCRIPT, args, timeout=60)).text
    except RunnerError:
        return ""
    result = said.split("\n", 1)[1].strip() if said.startswith("DONE") and "\n" in said else ""
    return result[2:] if result.startswith("OK") else ""
