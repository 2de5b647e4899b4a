"""The job contract on a node, the same on every backend: POSIX ``sh`` scripts plus their parsers.

Per (job id, rank) a directory ``<root>/jobs/<job id>/<rank>/`` holds ``cmd.sh`` (the user's command),
``env`` and ``secrets`` (0600; deleted once the wrapper has opened them for the rank's shell),
``mask`` (the secrets' output filter, deleted once the filter has opened it), ``rank.sh`` (the
wrapper), ``pid`` (wrapper), ``pgid`` (the user's process group), ``start``, ``exit`` (written in
place, so empty a moment: lines of exit code, end time and, when the machine's own fail-fast stopped
the rank, its reason; a record another script writes has its end in ``end``), ``cancel`` (marker
holding the reason of a cancel that reached the rank from outside), ``polled`` (the
last watcher's clock), ``orphaned``, ``progress`` (``$SKY_PROGRESS_FILE``: the rank touches it to
show it is alive), ``hang/`` (made when a watcher found it hung), ``times`` (when the log grew, by
the watchers' clocks; ``tsz`` its last size) and ``log``. Every process of a rank carries its mark in its
environment (:data:`MARKED_FUNCS`). The scripts travel on stdin and take only validated ids,
integers and paths as arguments, so nothing a user wrote is ever on a command line.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_provider_sky.errors import StatusParseError as StatusParseError
from airflow_provider_sky.node.exitcodes import describe_exit
from airflow_provider_sky.node.scripts import load
from airflow_provider_sky.node.shell import CANCEL_SCRIPT as CANCEL_SCRIPT
from airflow_provider_sky.node.shell import CLAIM_FUNC as CLAIM_FUNC
from airflow_provider_sky.node.shell import CMD_PROLOGUE, KEEPER_SCRIPT, WRAPPER
from airflow_provider_sky.node.shell import MARKED_FUNCS as MARKED_FUNCS
from airflow_provider_sky.node.shell import NEVER_STARTED_SCRIPT as NEVER_STARTED_SCRIPT
from airflow_provider_sky.node.shell import STATUS_SCRIPT as STATUS_SCRIPT
from airflow_provider_sky.node.shell import TEARDOWN_SCRIPT as TEARDOWN_SCRIPT
from airflow_provider_sky.node.shell import teardown_script as teardown_script

JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,180}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_job_id(job_id: str) -> str:
    """Job ids become path parts on nodes: allow only a safe alphabet."""
    if not JOB_ID_RE.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} must match {JOB_ID_RE.pattern}")
    return job_id


#: Linux refuses to exec a process with one environment string longer than this (``MAX_ARG_STRLEN``,
#: 32 pages), failing with "Argument list too long"
MAX_ENV_STRING = 128 * 1024


def env_file(env: Mapping[str, str]) -> str:
    """``export NAME='value'`` lines; names are validated, values single-quoted (no expansion).

    A value too long for the process environment is set in the rank's shell without ``export``
    (with a note in the rank's log), so the rank still starts and ``run`` still sees it.
    """
    lines = []
    for name, value in env.items():
        if not ENV_NAME_RE.fullmatch(name):
            raise ValueError(f"invalid environment variable name {name!r}")
        if "\x00" in value:
            raise ValueError(f"environment variable {name} contains a NUL byte")
        size = len(name) + len(value.encode()) + 2
        if size <= MAX_ENV_STRING:
            lines.append(f"export {name}={shlex.quote(value)}")
        else:
            lines.append(f"{name}={shlex.quote(value)}")
            note = (
                f"airflow-provider-sky: {name} is {size} bytes, over Linux's {MAX_ENV_STRING // 1024} KiB "
                "limit for one environment variable: it is set in this shell but not exported to the "
                "programs it starts (pass it through a file for those)"
            )
            lines.append(f"printf '%s\\n' {shlex.quote(note)} >&2")
    return "\n".join(lines) + "\n"


#: Airflow's masker ignores values this short (``[logging] min_length_masked_secret``): they would
#: mask ordinary words. The same floor applies to each line of a multi-line secret.
MIN_MASKED = 5


def mask_values(secrets: Mapping[str, str]) -> list[str]:
    """What to mask: each value and each line of a multi-line value, longest first."""
    found: set[str] = set()
    for value in secrets.values():
        for part in [value, *value.splitlines()]:
            part = part.strip("\r\n")
            if len(part) >= MIN_MASKED and "\n" not in part:
                found.add(part)
    return sorted(found, key=lambda v: (-len(v), v))


def mask_file(secrets: Mapping[str, str]) -> str:
    """The rank's mask: every value to hide, one a line, longest first ('' if none); the node's output
    filter (:data:`~airflow_provider_sky.node.shell.MASK_FUNC`) replaces each with ``***``."""
    return "".join(f"{v}\n" for v in mask_values(secrets))


@dataclass(frozen=True)
class RankLaunch:
    """Everything one rank needs on its node."""

    rank: int
    command: str
    env: Mapping[str, str]
    secrets: Mapping[str, str]
    cwd: str
    #: keep the secrets (0600) for a later attempt of the gang (``runtime_retry``) until the job is torn down
    keep_secrets: bool = False
    #: the file the wrapper keeps as the rank's ``result`` once the command exited 0 (None: none)
    result_file: str | None = None


@dataclass(frozen=True)
class Guard:
    """The node-side guards a launch arms (see :data:`KEEPER_SCRIPT`).

    ``orphan_timeout``: seconds without a poll after which the node kills the job (0: off).
    ``idle_down``: seconds a cluster may sit with nothing running before the node tears it down
    (0: never); ``idle_rm``: further paths the node removes then (its cluster record); ``idle_kill``: a
    process the node then ends, whose end ends the node itself (a pod's entrypoint; 0: none);
    ``idle_poweroff``: a command the node runs last, as its user, to power itself off (an EC2 instance
    launched with shutdown behaviour ``terminate`` is then terminated by EC2; '': none).
    ``keeper_roots``: the roots one keeper watches (a machine that hosts several nodes runs one
    keeper for all); empty: this launch starts none. ``now``: the launcher's clock.
    """

    orphan_timeout: int = 0
    idle_down: int = 0
    idle_rm: Sequence[str] = ()
    idle_kill: int = 0
    idle_poweroff: str = ""
    keeper_roots: Sequence[str] | None = None
    keeper_tick: float = 5.0
    now: float = 0.0


def _keeper_start(roots: Sequence[str], tick: float) -> str:
    """Start the keeper unless one runs for ``$root`` (its pid checked against its command line)."""
    tick = max(0.05, float(tick))
    return (
        'kp=""; [ -f "$root/keeper.pid" ] && read -r kp < "$root/keeper.pid"\n'
        "case \"$(tr '\\000' ' ' < \"/proc/$kp/cmdline\" 2>/dev/null)\" in\n"
        "*sky-keeper*) ;;\n*)\n"
        f"SKY_KEEPER_ROOTS={shlex.quote(chr(10).join(roots))}\nexport SKY_KEEPER_ROOTS\n"
        + "ks=$(cat <<'SKY_KEEPER_EOF'\n"
        + KEEPER_SCRIPT
        + "\nSKY_KEEPER_EOF\n)\n"
        + "(cd / && if command -v setsid >/dev/null 2>&1; then\n"
        f'  exec setsid sh -c "$ks" sky-keeper {tick:.3f} {int(tick * 1000)}\n'
        f'else exec nohup sh -c "$ks" sky-keeper {tick:.3f} {int(tick * 1000)}; fi) </dev/null >/dev/null 2>&1 &\n'
        # the pid is known now (setsid execs in place): written before the launch returns, so a teardown
        # that comes before the keeper has run a line still finds and kills it
        + "kp=$!\n"
        + "".join(
            f'[ -d {shlex.quote(r)} ] && printf "%s\\n" "$kp" > {shlex.quote(r + "/keeper.pid")}\n'
            for r in roots
        )
        + ";;\nesac\n"
    )


def _write(path: str, content: str) -> str:
    """Write ``content`` verbatim to ``path`` with the shell's builtin ``printf`` (no fork: a gang
    start of a big local gang writes thousands of files)."""
    if not content.endswith("\n"):
        content += "\n"
    return f"printf '%s' {shlex.quote(content)} > {path}"


def launch_script(
    root: str,
    job_id: str,
    ranks: Sequence[RankLaunch],
    wait_seconds: float = 20.0,
    guard: Guard | None = None,
) -> str:
    """One script that writes and starts every listed rank on one node (see :func:`launch_many_script`)."""
    guard = guard or Guard()
    return launch_many_script(job_id, [(root, rl, guard) for rl in ranks], wait_seconds)


#: The wrappers' clock base, read once per launch: ``cb`` the epoch and ``cu`` /proc/uptime, both in
#: centiseconds (empty without /proc or a ``date`` that prints nanoseconds: the wrappers then fork
#: ``date``). See :data:`~airflow_provider_sky.node.shell.WRAPPER`. ``date`` is a fork: on a busy
#: machine its answer came tenths of a second before the uptime read after it, and every rank that call
#: started told its times that much early (a sibling "ended" 0.3 s before the failure that ended it).
#: So the uptime is read on both sides, and the tightest of three tries is kept.
CLOCK_BASE = load("clock_base.sh")


#: ``never RANK`` (``$d`` its directory): a launcher's record of a rank it does not start because a
#: rank of its machine failed, cancelled with that rank's failure as the reason (as
#: :data:`NEVER_STARTED_SCRIPT` records them for the launch side); prints ``CANCELLED``, or ``EXISTS``
#: when another launcher claimed the rank first.
_NEVER_FUNC = load("never.sh").rstrip("\n")


#: With ``$gf`` (a machine's gang flag) and ``$g`` (the cancel grace) set: the flag's directory with what
#: the machine's own fail-fast needs (``.grace``, and ``.cancel.sh``: one copy per machine and job, written
#: aside and renamed so a wrapper never reads half of it); ``$gj`` is that directory. The gang start and
#: a retry's relaunch both run it.
FLAG_DIR = load("flag_dir.sh").rstrip("\n")


def flag_failure(flag: str, rank: int, code: int | None) -> str:
    """Shell lines that write a failure seen elsewhere into a machine's gang flag (:func:`gang_flag`),
    unless a rank of the machine wrote one first: its launchers then start no more ranks.

    They end the script when a rank of the machine has claimed its own cancel (``.cancelling``, see
    :data:`~airflow_provider_sky.node.shell.WRAPPER`): that cancel covers every rank started there,
    and every start call cancelling its ranks again takes the CPU that cancel needs."""
    return (
        f"gf={shlex.quote(flag)}\n"
        '[ -d "${gf%/*}" ] || mkdir -p "${gf%/*}"\n'
        f'[ -s "$gf" ] || printf "%s %s\\n" {int(rank)} {"-" if code is None else int(code)} >> "$gf"\n'
        '[ ! -d "${gf%/*}/.cancelling" ] || exit 0\n'
    )


def gang_flag(root: str, job_id: str) -> str:
    """The file a machine's ranks of a job report a failure in while its gang starts (one per machine:
    the root of its first node); a dot name, so no loop over a job's rank directories sees it."""
    return f"{_check_root(root)}/jobs/{check_job_id(job_id)}/.failed"


#: ``sh -s -- FLAG``: ``SET`` once a rank of the machine wrote its gang flag (:func:`gang_flag`), else
#: ``CLEAR``; what a gang start looks at while it runs, before it reads any rank's status.
FLAG_SET_SCRIPT = 'if [ -s "$1" ]; then echo SET; else echo CLEAR; fi\n'


#: the launch script's test that a rank is not started: a launch-side record (``halt``), or a rank of the
#: machine has failed (its gang flag is set)
_HALTED = '[ -n "$halt" ] || { [ -n "$gf" ] && [ -s "$gf" ]; }'


def launch_many_script(
    job_id: str,
    items: Sequence[tuple[str, RankLaunch, Guard]],
    wait_seconds: float = 20.0,
    flag: str | None = None,
    grace: float = 3.0,
    halt: str | None = None,
) -> str:
    """One script that writes and starts ranks of one machine, each under its node's root.

    A rank whose directory already exists is not started again (``EXISTS <rank>``), so a retried launch
    can never run a rank twice. Every wrapper is started before the script waits for any of them, then
    it prints ``STARTED <rank> <pid>`` once each wrapper has recorded its pid (``NOSTART <rank>`` if
    one did not within ``wait_seconds``).

    ``flag`` (:func:`gang_flag`, shared by every launcher of the machine): once a rank started there has
    failed on its own, the ranks not started yet are not: each is recorded cancelled right there, as
    never started (``CANCELLED <rank>``, :data:`NEVER_STARTED_SCRIPT`'s record), the ranks this script
    started are cancelled on the node once it has waited for their pids (one may have slipped past the
    failing rank's own cancel), and the script ends with ``GANGFAILED rank=R code=C``, the first failure
    written there. A big gang's start takes seconds; without it, a rank failing in its first second
    would let the others start for nothing.

    With ``flag``, the machine also cancels by itself (fail-fast on the node): each started rank is
    listed in the flag's directory (``.ranks``, ``rank root`` lines) beside the cancel script
    (``.cancel.sh``) and ``grace``; the first rank of the machine that fails on its own cancels every
    sibling listed there at once (:data:`~airflow_provider_sky.node.shell.WRAPPER`), with the reason
    :func:`node_cancel_reason` reads. Across machines the watchers' poll still does it.

    ``halt`` (a cancel reason): start none, record each rank cancelled with that reason, as never
    started: the launch side's record of the ranks it did not start because a sibling failed first.
    A rank that later attempts start from its files (``keep_secrets``) gets them whether it starts
    or not: attempt k copies attempt 1's rank directory.
    """
    check_job_id(job_id)
    q = shlex.quote
    parts = ["set -e", "umask 077"]
    if flag:
        parts.append(f"gf={q(flag)}")
        parts.append(f"g={max(0.0, float(grace)):.3f}")
        parts.append(FLAG_DIR)
    else:
        parts.append("gf=")
    parts.append(CLOCK_BASE)
    parts.append(CLAIM_FUNC)
    parts.append(_NEVER_FUNC)
    if halt is not None:
        parts.append(f"halt=1; why_={q(' '.join(halt.split())[:400] or 'a rank failed first')}")
    else:
        parts.append("halt=")
    prepared: set[str] = set()
    keepers: dict[tuple[str, ...], tuple[str, float]] = {}
    started: list[tuple[str, int]] = []
    for root, _, _ in items:
        if "\n" in root:
            raise ValueError(f"node root {root!r} contains a newline")
    # every rank directory of the call in one `mkdir -p` (the claim is a file in it, see CLAIM_FUNC):
    # each local node has a root of its own, and three `mkdir`s per rank (root, job, rank) were three
    # of its seven execs, a large share of a big gang's start
    rank_dirs = " ".join(f"{q(root)}/jobs/{q(job_id)}/{int(rl.rank)}" for root, rl, _ in items)
    if rank_dirs:
        parts.append(f"mkdir -p -- {rank_dirs}")
    for root, rl, guard in items:
        parts.append(f"root={q(root)}")
        if root not in prepared:
            prepared.add(root)
            parts.append(f'printf "%s\\n" {q(repr(float(guard.now)))} > "$root/launched"')
            if guard.idle_down > 0:
                parts.append(f'echo {int(guard.idle_down)} > "$root/idle_down"')
                parts.append(_write('"$root/idle_rm"', "\n".join(guard.idle_rm)))
                parts.append(f'echo {int(guard.idle_kill)} > "$root/idle_kill"')
                if guard.idle_poweroff:
                    parts.append(_write('"$root/idle_off"', guard.idle_poweroff))
                else:
                    parts.append('rm -f "$root/idle_off"')
            else:
                parts.append(
                    'if [ -e "$root/idle_down" ] || [ -e "$root/idle_rm" ]; then '
                    'rm -f "$root/idle_down" "$root/idle_rm" "$root/idle_kill" "$root/idle_off"; fi'
                )
        r = int(rl.rank)
        parts.append(f'd="$root/jobs"/{q(job_id)}/{r}')
        if not rl.keep_secrets:
            # nothing run later needs its files: a rank not started is only its record
            parts.append(f"if {_HALTED}; then never {r}; sk_{r}=1; else")
        # the claim: two launchers of one attempt (or a launcher and a never-started record) never
        # both take a rank
        parts.append(f'if ! claim "$d"; then echo "EXISTS {r}"; else')
        parts.append(_write('"$d/cmd.sh"', CMD_PROLOGUE + rl.command))
        parts.append(_write('"$d/env"', env_file(rl.env)))
        mask = mask_file(rl.secrets) if rl.secrets else ""
        if rl.keep_secrets:
            # later attempts start from these files, a rank never started too (a sibling failed before
            # its start): 0600 copies of the secrets and their mask, dropped once the gang's outcome is
            # final; the started rank's own copies are read once and deleted
            if rl.secrets:
                parts.append(_write('"$d/secrets.keep"', env_file(rl.secrets)))
                if mask:
                    parts.append(_write('"$d/mask.keep"', mask))
        if rl.result_file:
            parts.append(_write('"$d/result_file"', rl.result_file))
        parts.append(_write('"$d/rank.sh"', WRAPPER))
        parts.append(f'echo {int(guard.orphan_timeout)} > "$d/orphan_timeout"')
        parts.append(f'printf "%s\\n" {q(repr(float(guard.now)))} > "$d/polled"')
        parts.append(f"cwd={q(rl.cwd)}")
        parts.append('printf "%s\\n" "$cwd" > "$d/cwd"')
        if rl.keep_secrets:
            parts.append(f"if {_HALTED}; then never_rec {r}; sk_{r}=1; else")
        # listed before it starts: a sibling failing from now on cancels it on the node (one short
        # append, atomic with O_APPEND, whatever other launchers of the machine append meanwhile)
        parts.append(f'[ -z "$gf" ] || printf "%s %s\n" {r} "$root" >> "$gj/.ranks"')
        if rl.secrets and rl.keep_secrets:
            parts.append('cp "$d/secrets.keep" "$d/secrets"')
            if mask:
                parts.append('cp "$d/mask.keep" "$d/mask"')
        elif rl.secrets:
            parts.append(_write('"$d/secrets"', env_file(rl.secrets)))
            if mask:
                # read once by the rank's output filter, then deleted: no secret stays on disk
                parts.append(_write('"$d/mask"', mask))
        parts.append(
            'if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 &\n'
            'else nohup sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 & fi'
        )
        parts.append("fi")
        parts.append("fi")
        started.append((root, int(rl.rank)))
        roots = [root] if guard.keeper_roots is None else list(guard.keeper_roots)
        if roots and (guard.orphan_timeout > 0 or guard.idle_down > 0):
            keepers.setdefault(tuple(roots), (root, guard.keeper_tick))
    if keepers and halt is None:
        parts.append("set +e")
        for roots_, (root, tick) in keepers.items():
            parts.append(f"root={q(root)}")
            parts.append(_keeper_start(list(roots_), tick))
    ticks = int(wait_seconds * 20)
    for root, r in started:
        parts.append(
            f"d={q(root)}/jobs/{q(job_id)}/{r}; i=0\n"
            f'if [ -z "${{sk_{r}-}}" ] && [ -f "$d/rank.sh" ]; then\n'  # not one recorded never started
            f'while [ ! -s "$d/pid" ] && [ ! -s "$d/exit" ] && [ "$i" -lt {ticks} ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done\n'
            f'if [ -s "$d/pid" ] || [ -s "$d/exit" ]; then p=; {{ read -r p < "$d/pid"; }} 2>/dev/null || :; echo "STARTED {r} $p"; else echo "NOSTART {r}"; fi\n'
            "fi"
        )
    triples = " ".join(f"{q(root)} {q(job_id)} {r}" for root, r in started)
    parts.append(
        'if [ -n "$gf" ] && [ -s "$gf" ]; then fr=; fc=; { read -r fr fc < "$gf"; } 2>/dev/null || :\n'
        # the failure came from elsewhere (flag_failure) or the failing rank could not cancel on the node:
        # the ranks started here are cancelled here (the cancel skips ranks with an exit code, so the
        # never-started records and the failed rank stay as they are). Not when a rank of the machine
        # claimed the cancel (.cancelling, made before it set the flag): it reads the list after the
        # flag is set, so it covers every rank listed by then, and a rank listed later saw the flag and
        # never ran. Every launcher cancelling again would take the CPU that cancel needs while a big
        # gang is still starting.
        '  g=3; { read -r g < "$gj/.grace"; } 2>/dev/null || :\n'
        f'  [ ! -f "$gj/.cancel.sh" ] || [ -d "$gj/.cancelling" ] || sh "$gj/.cancel.sh" "$g" nowait "@rank-failed $fr $fc" {triples} '
        ">/dev/null 2>&1 </dev/null || :\n"
        '  echo "GANGFAILED rank=$fr code=$fc"\nfi'
    )
    return "\n".join(parts) + "\n"


def status_args(queries: Sequence[tuple[str, str, int, int, int]], now: float | None = None) -> list[str]:
    """Arguments of :data:`STATUS_SCRIPT`: (node root, job id, rank, log offset, max log bytes) per rank.

    The ranks may sit under different node roots of one machine: one call asks them all. ``now``
    (the poller's clock) is left on the node as the last poll; ``None`` polls without leaving a
    trace (a launch-side bridge must not keep an abandoned job alive). Either way the clock dates
    the log bytes the node holds (``times``, :class:`~airflow_provider_sky.model.logtext.LineClock`).
    """
    args = [f"-{time.time():.3f}" if now is None else f"{now:.3f}"]
    for root, job_id, rank, offset, max_bytes in queries:
        args += [
            _check_root(root),
            check_job_id(job_id),
            str(int(rank)),
            str(max(0, int(offset))),
            str(max(0, int(max_bytes))),
        ]
    return args


def cancel_args(
    grace: float,
    targets: Sequence[tuple[str, str, int]],
    *,
    wait: bool = True,
    reason: str = "",
    unless_claimed: str | None = None,
) -> list[str]:
    """Arguments of :data:`CANCEL_SCRIPT`: (node root, job id, rank) per rank, any number of roots of
    one machine; ``wait=False`` returns right after the SIGTERMs. ``unless_claimed``: the machine's gang
    flag (:func:`gang_flag`); the call does nothing when a rank there has claimed the machine's own
    cancel (``.cancelling`` beside the flag), which covers every rank of the machine."""
    reason = " ".join(reason.split())[:400]  # one line in the marker file
    mode = "wait" if wait else "nowait"
    if unless_claimed and not wait:
        mode = f"after:{_check_root(unless_claimed.rsplit('/', 1)[0])}"
    args = [f"{max(0.0, float(grace)):.3f}", mode, reason]
    for root, job_id, rank in targets:
        args += [_check_root(root), check_job_id(job_id), str(int(rank))]
    return args


def _check_root(root: str) -> str:
    """A node root is a path the scripts build job directories under: never empty, never a newline
    (the status script reads ``wc`` output line by line)."""
    if not root or "\n" in root:
        raise ValueError(f"node root {root!r} must be a non-empty path without a newline")
    return root


@dataclass(frozen=True)
class RawRankStatus:
    """One rank as the node reports it, before the gang policy classifies it."""

    job_id: str
    rank: int
    state: str  # missing | pending | running | exited | badexit | lost
    exit_code: int | None
    start: float | None
    end: float | None
    log_size: int
    cancel_requested: bool
    log_offset: int
    log_chunk: bytes
    polled_at: float | None = None
    orphaned: bool = False
    exit_text: str = ""
    cancel_reason: str = ""
    #: SIGKILLed while its memory cgroup counted an OOM kill: out of memory, not a person's kill
    oom: bool = False
    #: mtime (node clock, whole seconds) of the rank's progress file, None without one
    progress: float | None = None
    #: a watcher found the rank hung and dumped its stacks (``hang.DUMP_SCRIPT``)
    hung: bool = False


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


#: the cancel reason a rank's wrapper writes in its machine's siblings when it failed first there
_NODE_CANCEL = re.compile(r"@rank-failed (\d+) (-?\d+|-)( oom)?")


def node_cancel_reason(text: str) -> str:
    """A cancel reason as users read it: the node's fail-fast writes ``@rank-failed RANK CODE [oom]``
    (a shell has no table of exit codes), told here as the watchers tell theirs (``rank 2 failed
    first: exited with code 1``, :func:`~airflow_provider_sky.model.gang.cancel_reason`)."""
    m = _NODE_CANCEL.fullmatch(text)
    if m is None:
        return text
    # "-": a failure seen elsewhere that had no exit code (a lost node)
    code = None if m.group(2) == "-" else int(m.group(2))
    return failed_first(int(m.group(1)), code, oom=bool(m.group(3)))


def failed_first(rank: int, code: int | None, *, oom: bool = False) -> str:
    """``rank 2 failed first: exited with code 1``: the siblings' cancel reason for a failure known by
    its rank and exit code (no code: ``rank 2 failed first``)."""
    if code is None and not oom:
        return f"rank {rank} failed first"
    return f"rank {rank} failed first: {describe_exit(code, 'OOMKilled' if oom else None)}"


def parse_status(output: bytes, offsets: Mapping[tuple[str, int], int] | None = None) -> list[RawRankStatus]:
    """Parse :data:`STATUS_SCRIPT` output: a header line per rank, then its payloads."""
    out: list[RawRankStatus] = []
    pos = 0
    while pos < len(output):
        nl = output.find(b"\n", pos)
        if nl < 0:
            raise StatusParseError(f"truncated status output: {output[pos : pos + 200]!r}")
        header = output[pos:nl].decode("utf-8", "replace").split(" ")
        pos = nl + 1
        if len(header) != 17 or header[0] != "@":
            raise StatusParseError(f"unexpected status line: {' '.join(header)[:200]!r}")
        _, job_id, rank_s, state, ex, st, en, sz, c, n_s, pl, o, xn_s, cn_s, m, pg, h = header
        n, xn, cn = int(n_s), int(xn_s), int(cn_s)
        chunk = output[pos : pos + n]
        pos += n
        exit_text = output[pos : pos + xn].decode("utf-8", "replace")
        pos += xn
        cancel_reason = node_cancel_reason(output[pos : pos + cn].decode("utf-8", "replace").strip())
        pos += cn
        rank = int(rank_s)
        code = int(ex) if ex.lstrip("-").isdigit() else None
        out.append(
            RawRankStatus(
                job_id=job_id,
                rank=rank,
                state=state,
                exit_code=code,
                start=_num(st),
                end=_num(en),
                log_size=int(sz),
                cancel_requested=c == "1",
                log_offset=(offsets or {}).get((job_id, rank), 0),
                log_chunk=chunk,
                polled_at=_num(pl),
                orphaned=o == "1",
                exit_text=exit_text,
                cancel_reason=cancel_reason,
                oom=m == "1",
                progress=_num(pg),
                hung=h == "1",
            )
        )
    return out
