"""The job contract on a node, the same on every backend: POSIX ``sh`` scripts plus their parsers.

Per (job id, rank) a directory ``<root>/jobs/<job id>/<rank>/`` holds ``cmd.sh`` (the user's command),
``env`` and ``secrets`` (0600), ``rank.sh`` (the wrapper), ``pid`` (wrapper), ``pgid`` (the user's
process group), ``start``, ``end``, ``exit`` (written to a temp file, then renamed), ``cancel``
(marker) and ``log``. The scripts travel on stdin and take only validated ids and integers as
arguments, so nothing a user wrote is ever on a command line.
"""

from __future__ import annotations

import json
import re
import secrets as _secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,180}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: The wrapper. It runs the user's command in a child shell (its own session and process group,
#: so a kill reaches the whole tree but not the wrapper), and always records the exit code.
WRAPPER = r"""#!/bin/sh
# airflow-provider-sky rank wrapper: the user's command runs in a child shell, so an `exit`,
# `exec` or `set -e` in it can never skip recording its exit code.
d=$1
cwd=$2
now() { t=$(date +%s.%N 2>/dev/null); case "$t" in *N*|'') t=$(date +%s);; esac; printf '%s\n' "$t"; }
sh_=/bin/sh
if command -v bash >/dev/null 2>&1; then sh_=$(command -v bash); fi
child_cmd='cd "$1" 2>/dev/null || cd; . "$2/env"; if [ -f "$2/secrets" ]; then . "$2/secrets"; rm -f "$2/secrets"; fi; exec "$0" "$2/cmd.sh"'
now > "$d/start"
if command -v setsid >/dev/null 2>&1; then
  setsid "$sh_" -c "$child_cmd" "$sh_" "$cwd" "$d" >>"$d/log" 2>&1 </dev/null &
else
  "$sh_" -c "$child_cmd" "$sh_" "$cwd" "$d" >>"$d/log" 2>&1 </dev/null &
fi
child=$!
echo "$child" > "$d/pgid.tmp" && mv "$d/pgid.tmp" "$d/pgid"
echo "$$" > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid"
trap ':' TERM INT HUP
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break
done
now > "$d/end.tmp" && mv "$d/end.tmp" "$d/end"
echo "$rc" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""

#: One call per node per poll, so it forks as little as it can: ``read`` (a builtin) for the small
#: files, one ``wc`` for the log size, ``tail | head`` only when there are new log bytes.
STATUS_SCRIPT = r"""
root=$1; shift
while [ $# -ge 4 ]; do
  j=$1; r=$2; off=$3; max=$4; shift 4
  d="$root/jobs/$j/$r"
  ex=-; st=-; en=-; sz=0; c=0; n=0
  if [ ! -d "$d" ]; then
    state=missing
  else
    [ -f "$d/cancel" ] && c=1
    [ -f "$d/start" ] && read -r st < "$d/start"
    if [ -f "$d/exit" ]; then
      state=exited
    elif [ -f "$d/pid" ] && read -r pid < "$d/pid"; then
      if kill -0 "$pid" 2>/dev/null; then state=running
      elif [ -f "$d/exit" ]; then state=exited
      else state=lost; fi
    else
      state=pending
    fi
    if [ "$state" = exited ]; then
      read -r ex < "$d/exit"
      [ -f "$d/end" ] && read -r en < "$d/end"
    fi
    [ -f "$d/log" ] && sz=$(wc -c < "$d/log") && sz=$((sz + 0))
  fi
  if [ "$sz" -gt "$off" ] && [ "$max" -gt 0 ]; then n=$((sz - off)); [ "$n" -gt "$max" ] && n=$max; fi
  printf '@ %s %s %s %s %s %s %s %s %s\n' "$j" "$r" "$state" "${ex:--}" "${st:--}" "${en:--}" "$sz" "$c" "$n"
  if [ "$n" -gt 0 ]; then tail -c +$((off + 1)) "$d/log" | head -c "$n"; fi
done
"""

#: TERM every listed rank's process group, SIGKILL what is left after the grace, then wait
#: (bounded) for the wrappers to record the exit codes. Ranks that already exited are left alone.
CANCEL_SCRIPT = r"""
root=$1; grace=$2; mode=$3; shift 3
tick() { sleep 0.1 2>/dev/null || sleep 1; }
groups=''
while [ $# -ge 2 ]; do
  d="$root/jobs/$1/$2"; shift 2
  [ -d "$d" ] || continue
  [ -f "$d/exit" ] && continue
  : > "$d/cancel"
  [ -f "$d/pgid" ] || continue
  pg=$(cat "$d/pgid")
  kill -TERM "-$pg" 2>/dev/null || kill -TERM "$pg" 2>/dev/null
  groups="$groups $pg"
  echo "C $d"
done
if [ "$mode" = nowait ]; then
  # fail-fast: return at once; a detached helper SIGKILLs whatever is left after the grace
  [ -n "$groups" ] || exit 0
  killer="cd /; sleep $grace; for pg in $groups; do kill -KILL -\$pg 2>/dev/null || kill -KILL \$pg 2>/dev/null; done"
  if command -v setsid >/dev/null 2>&1; then setsid sh -c "$killer" </dev/null >/dev/null 2>&1 &
  else nohup sh -c "$killer" </dev/null >/dev/null 2>&1 & fi
  exit 0
fi
# A group is alive while it has a member that is not a zombie (a slow init may reap late).
# `kill -0` is a builtin and answers most rounds; `ps` (a fork) only tells zombies apart.
alive() {
  any=''
  for pg in $groups; do
    if kill -0 "-$pg" 2>/dev/null || kill -0 "$pg" 2>/dev/null; then any="$any $pg"; fi
  done
  [ -n "$any" ] || return 1
  if out=$(ps -eo pgid=,stat= 2>/dev/null); then
    printf '%s\n' "$out" | awk -v g="$any" 'BEGIN { n = split(g, a, " "); for (i = 1; i <= n; i++) w[a[i]] = 1 }
      ($1 in w) && $2 !~ /^Z/ { f = 1 } END { exit !f }'
    return $?
  fi
  return 0
}
limit=$(awk "BEGIN{print int($grace * 10)}")
i=0
while alive && [ "$i" -lt "$limit" ]; do tick; i=$((i + 1)); done
if alive; then
  for pg in $groups; do
    kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null
    command -v pkill >/dev/null 2>&1 && pkill -KILL -s "$pg" 2>/dev/null
    echo "K $pg"
  done
fi
i=0
while alive && [ "$i" -lt 50 ]; do tick; i=$((i + 1)); done
exit 0
"""

#: Kill everything any job under ``root`` started, then remove ``root`` (teardown of one node).
TEARDOWN_SCRIPT = r"""
root=$1; grace=$2
[ -d "$root" ] || { echo "ABSENT"; exit 0; }
set --
for d in "$root"/jobs/*/*; do
  [ -f "$d/pgid" ] || continue
  [ -f "$d/exit" ] && continue
  j=$(basename "$(dirname "$d")"); r=$(basename "$d")
  set -- "$@" "$j" "$r"
done
if [ $# -gt 0 ]; then
  __CANCEL__
fi
# a wrapper still alive without an exit code: kill it, but only if that pid is still our wrapper
# (pids are reused; without /proc a reused pid can't be told apart, so it is left alone)
for d in "$root"/jobs/*/*; do
  [ -f "$d/pid" ] || continue
  [ -f "$d/exit" ] && continue
  read -r pid < "$d/pid" || continue
  [ -r "/proc/$pid/cmdline" ] || continue
  case "$(tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" in
    *"$d/rank.sh"*) kill -KILL "$pid" 2>/dev/null ;;
  esac
done
rm -rf "$root"
echo "REMOVED"
"""


#: print the secret values of a job (rank 0's copy) for log masking; nothing if it has none
REDACT_SCRIPT = r"""
f="$1/jobs/$2/0/redact"
[ -f "$f" ] && cat "$f"
exit 0
"""


def teardown_script() -> str:
    """The teardown script with the cancel logic inlined (one remote call per node)."""
    body = '(\n  set -- "$root" "$grace" wait "$@"\n' + CANCEL_SCRIPT + "\n)"
    return TEARDOWN_SCRIPT.replace("__CANCEL__", body)


def check_job_id(job_id: str) -> str:
    """Job ids become path parts on nodes: allow only a safe alphabet."""
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"job id {job_id!r} must match {JOB_ID_RE.pattern}")
    return job_id


def _heredoc(path: str, content: str) -> str:
    """A quoted here-document writing ``content`` verbatim to ``path`` (no expansion happens)."""
    if not content.endswith("\n"):
        content += "\n"
    while True:
        delim = "SKY_EOF_" + _secrets.token_hex(8)
        if delim not in content:
            break
    return f"cat > {path} <<'{delim}'\n{content}{delim}\n"


def env_file(env: Mapping[str, str]) -> str:
    """``export NAME='value'`` lines; names are validated, values single-quoted (no expansion)."""
    lines = []
    for name, value in env.items():
        if not ENV_NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
        if "\x00" in value:
            raise ValueError(f"environment variable {name} contains a NUL byte")
        lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RankLaunch:
    """Everything one rank needs on its node."""

    rank: int
    command: str
    env: Mapping[str, str]
    secrets: Mapping[str, str]
    cwd: str


def launch_script(root: str, job_id: str, ranks: Sequence[RankLaunch], wait_seconds: float = 20.0) -> str:
    """One script that writes and starts every listed rank on one node.

    A rank whose directory already exists is not started again (``EXISTS``), so a retried launch can
    never run a rank twice. Prints ``STARTED <rank> <pid>`` once each wrapper has recorded its pid.
    """
    check_job_id(job_id)
    q = shlex.quote
    parts = ["set -e", "umask 077", f"root={q(root)}", 'mkdir -p "$root/jobs"']
    started = []
    for rl in ranks:
        d = f'"$root/jobs"/{q(job_id)}/{int(rl.rank)}'
        parts.append(f"d={d}")
        parts.append(f'if [ -e "$d" ]; then echo "EXISTS {int(rl.rank)}"; else')
        parts.append('mkdir -p "$d"')
        parts.append(_heredoc('"$d/cmd.sh"', rl.command))
        parts.append(_heredoc('"$d/env"', env_file(rl.env)))
        if rl.secrets:
            parts.append(_heredoc('"$d/secrets"', env_file(rl.secrets)))
            # the values, so whoever shows this rank's log can mask them (kept 0600 until teardown)
            parts.append(_heredoc('"$d/redact"', json.dumps(sorted(set(rl.secrets.values())))))
        parts.append(_heredoc('"$d/rank.sh"', WRAPPER))
        parts.append(f"cwd={q(rl.cwd)}")
        parts.append(
            'if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 &\n'
            'else nohup sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 & fi'
        )
        parts.append("fi")
        started.append(int(rl.rank))
    ticks = int(wait_seconds * 20)
    for r in started:
        parts.append(
            f'd="$root/jobs"/{q(job_id)}/{r}; i=0\n'
            f'while [ ! -f "$d/pid" ] && [ "$i" -lt {ticks} ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done\n'
            f'if [ -f "$d/pid" ]; then echo "STARTED {r} $(cat "$d/pid")"; else echo "NOSTART {r}"; fi'
        )
    return "\n".join(parts) + "\n"


def status_args(root: str, queries: Sequence[tuple[str, int, int, int]]) -> list[str]:
    """Arguments of :data:`STATUS_SCRIPT`: (job id, rank, log offset, max log bytes) per rank."""
    args = [root]
    for job_id, rank, offset, max_bytes in queries:
        args += [check_job_id(job_id), str(int(rank)), str(max(0, int(offset))), str(max(0, int(max_bytes)))]
    return args


def cancel_args(
    root: str, grace: float, targets: Sequence[tuple[str, int]], *, wait: bool = True
) -> list[str]:
    """Arguments of :data:`CANCEL_SCRIPT`; ``wait=False`` returns right after the SIGTERMs."""
    args = [root, f"{max(0.0, float(grace)):.3f}", "wait" if wait else "nowait"]
    for job_id, rank in targets:
        args += [check_job_id(job_id), str(int(rank))]
    return args


@dataclass(frozen=True)
class RawRankStatus:
    """One rank as the node reports it, before the gang policy classifies it."""

    job_id: str
    rank: int
    state: str  # missing | pending | running | exited | lost
    exit_code: int | None
    start: float | None
    end: float | None
    log_size: int
    cancel_requested: bool
    log_offset: int
    log_chunk: bytes


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_status(output: bytes, offsets: Mapping[tuple[str, int], int] | None = None) -> list[RawRankStatus]:
    """Parse :data:`STATUS_SCRIPT` output: a header line per rank, then exactly ``n`` bytes of log."""
    out: list[RawRankStatus] = []
    pos = 0
    while pos < len(output):
        nl = output.find(b"\n", pos)
        if nl < 0:
            break
        header = output[pos:nl].decode("utf-8", "replace").split(" ")
        pos = nl + 1
        if len(header) != 10 or header[0] != "@":
            continue
        _, job_id, rank_s, state, ex, st, en, sz, c, n_s = header
        n = int(n_s)
        chunk = output[pos : pos + n]
        pos += n
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
            )
        )
    return out
