"""The job contract on a node, the same on every backend: POSIX ``sh`` scripts plus their parsers.

Per (job id, rank) a directory ``<root>/jobs/<job id>/<rank>/`` holds ``cmd.sh`` (the user's command),
``env`` and ``secrets`` (0600; the secrets are deleted as soon as the rank's shell has read them),
``mask`` (the secrets' output filter, deleted once the filter has opened it), ``rank.sh`` (the
wrapper), ``pid`` (wrapper), ``pgid`` (the user's process group), ``start``, ``end``, ``exit``
(written to a temp file, then renamed), ``cancel`` (marker holding the reason), ``polled`` (the
last watcher's clock), ``orphaned``, ``progress`` (``$SKY_PROGRESS_FILE``: the rank touches it to
show it is alive), ``hang/`` (made when a watcher found it hung) and ``log``. Every process of a rank carries its mark in its
environment (:data:`MARKED_FUNCS`). The scripts travel on stdin and take only validated ids,
integers and paths as arguments, so nothing a user wrote is ever on a command line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,180}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Every process a rank starts inherits ``SKY_PROVIDER_MARK=<rank dir>/`` in its environment, so a
#: node finds all of them through ``/proc/<pid>/environ`` whatever they did to their process group or
#: session (``setsid``, double forks, ``nohup``). ``marked MARK...`` prints the pids whose environment
#: holds one of the marks (a prefix: ``<root>/jobs/`` is every process of a cluster's node). No single
#: quote in it: it is embedded in single-quoted helper scripts. The patterns go to ``grep -f -`` on
#: stdin: building ``-e`` arguments one ``set --`` at a time is quadratic (6 s for 1,024 marks).
MARKED_FUNCS = r"""
marked() {
  [ -r /proc/self/environ ] || return 0
  [ $# -gt 0 ] || return 0
  printf "SKY_PROVIDER_MARK=%s\n" "$@" | grep -l -F -f - /proc/[0-9]*/environ 2>/dev/null |
    while read -r _f; do _p=${_f#/proc/}; echo "${_p%/environ}"; done
}
killmarked() {
  _s=$1; shift
  for _p in $(marked "$@"); do kill "-$_s" "$_p" 2>/dev/null; done
}
"""

#: The wrapper. It runs the user's command in a child shell (its own session and process group,
#: so a kill reaches the whole tree but not the wrapper), and always records the exit code. The
#: child alone carries the mark; when the job has secrets, its output goes through a ``sed`` that
#: masks them before anything reaches the log on disk.
WRAPPER = r"""#!/bin/sh
# airflow-provider-sky rank wrapper: the user's command runs in a child shell, so an `exit`,
# `exec` or `set -e` in it can never skip recording its exit code.
d=$1
cwd=$2
now() { t=$(date +%s.%N 2>/dev/null); case "$t" in *N*|'') t=$(date +%s);; esac; printf '%s\n' "$t"; }
tick() { sleep 0.05 2>/dev/null || sleep 1; }
sh_=/bin/sh
if command -v bash >/dev/null 2>&1; then sh_=$(command -v bash); fi
cd "$cwd" 2>/dev/null || cd
now > "$d/start"
out="$d/log"
if [ -f "$d/mask" ]; then
  rm -f "$d/out" "$d/filter.done"
  if mkfifo -m 600 "$d/out" 2>/dev/null; then
    u=''
    echo | sed -u p >/dev/null 2>&1 && u=-u
    exec 3<"$d/mask"
    rm -f "$d/mask"
    (LC_ALL=C sed $u -f /dev/fd/3 <"$d/out" >>"$d/log" 2>&1; : > "$d/filter.done") &
    exec 3<&-
    out="$d/out"
  else
    rm -f "$d/mask"
    echo "airflow-provider-sky: could not create a pipe to mask secrets; output is not masked" >>"$d/log"
  fi
fi
# the memory cgroup's OOM-kill count (v2 memory.events, v1 memory.oom_control; a container sees its own at
# the mount's root): a rank SIGKILLed while it grew was killed for memory, not by a person or a cancel
oomk() {
  for f in $(sed -n 's|^[0-9]*:memory:\(.*\)|/sys/fs/cgroup/memory\1/memory.oom_control|p; s|^0::\(.*\)|/sys/fs/cgroup\1/memory.events|p' /proc/self/cgroup 2>/dev/null) \
           /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    [ -r "$f" ] || continue
    while read -r k v; do [ "$k" = oom_kill ] && { printf '%s\n' "$v"; return 0; }; done < "$f"
  done
  echo 0
}
oom0=$(oomk)
if command -v setsid >/dev/null 2>&1; then
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" setsid "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null &
else
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null &
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
# the end is when the command ended: taken first (a cancel wakes every wrapper of a machine at once)
now > "$d/end.tmp"
[ ! -e "$d/secrets" ] || rm -f "$d/secrets"
if [ "$out" != "$d/log" ]; then
  # let the filter flush the last lines (bounded: a leftover background process may hold the pipe)
  i=0; while [ ! -f "$d/filter.done" ] && [ "$i" -lt 40 ]; do tick; i=$((i + 1)); done
  rm -f "$d/out"
fi
mv "$d/end.tmp" "$d/end"
if [ "$rc" = 137 ]; then oom1=$(oomk); [ "$oom1" -gt "$oom0" ] 2>/dev/null && : > "$d/oom"; fi
echo "$rc" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""

#: The first lines of every ``cmd.sh``: the env, then the secrets (sourced and deleted at once),
#: in the rank's own shell, so a value too big for the process environment still reaches ``run``.
CMD_PROLOGUE = """__sky_d=$1; shift
. "$__sky_d/env"
if [ -f "$__sky_d/secrets" ]; then . "$__sky_d/secrets"; rm -f "$__sky_d/secrets"; fi
unset __sky_d
"""

#: One call per machine per poll, covering every rank there (each with its own node root), so it
#: forks as little as it can: ``read`` (a builtin) for the small files, one ``wc`` for every log's size,
#: ``tail | head`` only when there are new log bytes. At 1,024 ranks on one machine a fork per rank
#: per poll is seconds of CPU every interval. The poller's clock (``now``, or ``-``) is left in
#: ``polled``: the node's dead-man's switch and other watchers read it. Arguments: ``now``, then
#: ``root job rank offset max`` per rank. Per rank: a header line, then ``n`` log bytes, ``xn`` bytes
#: of an unreadable exit file and ``cn`` bytes of the cancel reason.
#:
#: A log's size must be read after its rank's exit file was seen (a rank reported over with a short
#: size would lose its last lines), so the batch also says which ranks had exited before it measured;
#: a rank that exits during the call gets its size read again on its own. A log the batch did not
#: list (created since, or a name ``wc`` prints differently) is measured on its own too.
STATUS_SCRIPT = r"""
now=$1; shift
sizes() {
  _x=''; _k=$(($# / 5))
  while [ "$_k" -gt 0 ]; do
    if [ -f "$1/jobs/$2/$3/exit" ]; then _x="${_x}1"; else _x="${_x}0"; fi
    set -- "$@" "$1/jobs/$2/$3/log"; shift 5; _k=$((_k - 1))
  done
  printf '%s\n' "x$_x"
  [ $# -gt 0 ] && wc -c -- "$@" 2>/dev/null
  :
}
sizes_=$(sizes "$@")
{
read -r early <&3 || early=x
early=${early#x}
lsz=''; lname=''; read -r lsz lname <&3 || :
while [ $# -ge 5 ]; do
  root=$1; j=$2; r=$3; off=$4; max=$5; shift 5
  d="$root/jobs/$j/$r"
  ex=-; st=-; en=-; sz=-; c=0; n=0; pl=-; o=0; xn=0; cn=0; m=0; pg=-; h=0
  e1=${early%"${early#?}"}; early=${early#?}
  if [ -n "$lname" ] && [ "$lname" = "$d/log" ]; then
    sz=$lsz; lsz=''; lname=''; read -r lsz lname <&3 || :
  fi
  if [ ! -d "$d" ]; then
    state=missing
  else
    [ -f "$d/cancel" ] && c=1
    [ -f "$d/orphaned" ] && o=1
    [ -d "$d/hang" ] && h=1
    # the rank's progress file (SKY_PROGRESS_FILE): its mtime, a fork only for ranks that touch one
    [ -f "$d/progress" ] && pg=$(date -r "$d/progress" +%s 2>/dev/null)
    [ -f "$d/start" ] && read -r st < "$d/start"
    [ -f "$d/polled" ] && read -r pl < "$d/polled"
    [ "$now" = - ] || printf '%s\n' "$now" > "$d/polled"
    if [ -f "$d/exit" ]; then
      state=exited
    elif [ -f "$d/pid" ] && read -r pid < "$d/pid"; then
      case "$pid" in ''|*[!0-9]*) pid=0;; esac
      if [ "$pid" -gt 0 ] && kill -0 "$pid" 2>/dev/null; then state=running
      elif [ -f "$d/exit" ]; then state=exited
      else state=lost; fi
    else
      state=pending
    fi
    if [ "$state" = exited ]; then
      [ "$e1" = 1 ] || sz=-
      ex=''
      read -r ex < "$d/exit" || :
      v=${ex#-}
      case "$v" in
        ''|*[!0-9]*) state=badexit; ex=-; xn=$(wc -c < "$d/exit"); xn=$((xn + 0)); [ "$xn" -gt 200 ] && xn=200;;
      esac
      [ -f "$d/end" ] && read -r en < "$d/end"
      [ -f "$d/oom" ] && m=1
    fi
    if [ "$sz" = - ] && [ -f "$d/log" ]; then sz=$(wc -c < "$d/log"); sz=$((sz + 0)); fi
    if [ "$c" = 1 ]; then cn=$(wc -c < "$d/cancel"); cn=$((cn + 0)); [ "$cn" -gt 500 ] && cn=500; fi
  fi
  case "$sz" in ''|*[!0-9]*) sz=0;; esac
  case "$st" in ''|*[!0-9.]*) st=-;; esac
  case "$en" in ''|*[!0-9.]*) en=-;; esac
  case "$pl" in ''|*[!0-9.]*) pl=-;; esac
  case "$pg" in ''|*[!0-9]*) pg=-;; esac
  if [ "$sz" -gt "$off" ] && [ "$max" -gt 0 ]; then n=$((sz - off)); [ "$n" -gt "$max" ] && n=$max; fi
  printf '@ %s %s %s %s %s %s %s %s %s %s %s %s %s %s %s %s\n' "$j" "$r" "$state" "$ex" "$st" "$en" "$sz" "$c" "$n" "$pl" "$o" "$xn" "$cn" "$m" "$pg" "$h"
  if [ "$n" -gt 0 ]; then tail -c +$((off + 1)) "$d/log" | head -c "$n"; fi
  if [ "$xn" -gt 0 ]; then head -c "$xn" "$d/exit"; fi
  if [ "$cn" -gt 0 ]; then head -c "$cn" "$d/cancel"; fi
done
} 3<<SKY_SIZES
$sizes_
SKY_SIZES
"""

#: The delayed SIGKILL of a fail-fast cancel, run detached: ``sh -c KILLER sh TICKS GROUPS`` with the
#: marks in ``$SKY_KILL_MARKS`` (one per line). It leaves as soon as everything it watches is gone.
KILLER = (  # no single quote in it: it travels inside one
    MARKED_FUNCS
    + r"""
cd /
ticks=$1; gs=$2; shift 2
nl="
"
oldifs=$IFS; IFS=$nl; set -f; set -- $SKY_KILL_MARKS; set +f; IFS=$oldifs
i=0
while [ "$i" -lt "$ticks" ]; do
  up=""
  for pg in $gs; do kill -0 "-$pg" 2>/dev/null && up=1; done
  [ -z "$up" ] && [ -z "$(marked "$@")" ] && exit 0
  sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
for pg in $gs; do kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null; done
i=0
while [ "$i" -lt 20 ] && [ -n "$(marked "$@")" ]; do
  killmarked KILL "$@"; sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
"""
)

#: TERM every listed rank's process group and every process carrying its mark, SIGKILL what is left
#: after the grace, then wait (bounded) until they are gone. ``reason`` goes in each unfinished rank's
#: cancel marker. A rank that already exited keeps its outcome; processes it left behind are killed.
#: Arguments: ``grace mode reason``, then ``root job rank`` per rank: one call covers every rank of a
#: machine, whatever node root each has (one ``grep`` of ``/proc`` finds all their processes).
CANCEL_SCRIPT = (
    MARKED_FUNCS
    + r"""
grace=$1; mode=$2; reason=$3; shift 3
tick() { sleep 0.1 2>/dev/null || sleep 1; }
groups=''
nl='
'
marks=${extra_mark:-}
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; shift 3
  marks="$marks$nl$d/"
  [ -d "$d" ] || continue
  [ -f "$d/exit" ] && continue
  printf '%s\n' "$reason" > "$d/cancel"
  [ -f "$d/pgid" ] || continue
  read -r pg < "$d/pgid" || continue
  case "$pg" in ''|*[!0-9]*) continue;; esac
  kill -TERM "-$pg" 2>/dev/null || kill -TERM "$pg" 2>/dev/null
  groups="$groups $pg"
  echo "C $d"
done
oldifs=$IFS; IFS=$nl; set -f; set -- $marks; set +f; IFS=$oldifs
killmarked TERM "$@"
if [ "$mode" = nowait ]; then
  # fail-fast: return at once; a detached helper SIGKILLs whatever is left after the grace
  killer='__KILLER__'
  frac=${grace#*.}; ticks=$(( ${grace%.*} * 10 + ${frac%??} ))
  SKY_KILL_MARKS=$marks
  export SKY_KILL_MARKS
  if command -v setsid >/dev/null 2>&1; then setsid sh -c "$killer" sh "$ticks" "$groups" </dev/null >/dev/null 2>&1 &
  else nohup sh -c "$killer" sh "$ticks" "$groups" </dev/null >/dev/null 2>&1 & fi
  exit 0
fi
# A group is alive while it has a member that is not a zombie (a slow init may reap late).
# `kill -0` is a builtin and answers most rounds; `ps` (a fork) only tells zombies apart.
alive() {
  [ -n "$(marked "$@")" ] && return 0
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
while alive "$@" && [ "$i" -lt "$limit" ]; do tick; i=$((i + 1)); done
if alive "$@"; then
  for pg in $groups; do
    kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null
    command -v pkill >/dev/null 2>&1 && pkill -KILL -s "$pg" 2>/dev/null
    echo "K $pg"
  done
  killmarked KILL "$@"
fi
i=0
while alive "$@" && [ "$i" -lt 50 ]; do killmarked KILL "$@"; tick; i=$((i + 1)); done
left=$(marked "$@")
[ -z "$left" ] || echo "LEFT" $left
exit 0
""".replace("__KILLER__", KILLER)
)

#: Ranks the gang start skips because a sibling already failed: each record says cancelled (exit 143,
#: the reason in ``cancel``) without anything having run. ``job reason`` then ``root rank`` pairs; an
#: existing rank directory is left alone (``EXISTS <rank>``, else ``CANCELLED <rank>``).
NEVER_STARTED_SCRIPT = r"""
j=$1; reason=$2; shift 2
umask 077
t=$(date +%s.%N 2>/dev/null); case "$t" in *N*|'') t=$(date +%s);; esac
while [ $# -ge 2 ]; do
  d="$1/jobs/$j/$2"; r=$2; shift 2
  if [ -e "$d" ]; then echo "EXISTS $r"; continue; fi
  mkdir -p "$d"
  printf '%s\n' "$reason" > "$d/cancel"
  printf '%s\n' "$t" > "$d/start"; printf '%s\n' "$t" > "$d/end"
  echo 143 > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
  echo "CANCELLED $r"
done
"""

#: Kill everything any job under the listed roots started (found by the mark, so a lost job directory or
#: exit file loses nothing), stop their keepers, then remove each root (``REMOVED <root>``, or ``ABSENT
#: <root>`` when it was gone already). ``sh -s -- GRACE ROOT...``: the roots of one machine.
TEARDOWN_SCRIPT = r"""
grace=$1; shift
nl="
"
roots=''
for root in "$@"; do
  roots="$roots$root$nl"
  if [ -f "$root/keeper.pid" ] && read -r kp < "$root/keeper.pid"; then
    case "$(tr '\000' ' ' < "/proc/$kp/cmdline" 2>/dev/null)" in *sky-keeper*) kill -KILL "-$kp" 2>/dev/null || kill -KILL "$kp" 2>/dev/null ;; esac
  fi
done
marks=''
triples=''
oldifs=$IFS; IFS=$nl; set -f
for root in $roots; do
  IFS=$oldifs; set +f
  marks="$marks$root/jobs/$nl"
  for d in "$root"/jobs/*/*; do
    [ -d "$d" ] || continue
    r=${d##*/}; j=${d%/*}; j=${j##*/}
    triples="$triples$root$nl$j$nl$r$nl"
  done
  IFS=$nl; set -f
done
set -- $triples
IFS=$oldifs; set +f
(
  extra_mark=${marks%$nl}
  set -- "$grace" wait "torn down" "$@"
  __CANCEL__
)
# a wrapper still alive without an exit code: kill it, but only if that pid is still our wrapper
# (pids are reused; without /proc a reused pid can't be told apart, so it is left alone)
IFS=$nl; set -f
for root in $roots; do
  IFS=$oldifs; set +f
  for d in "$root"/jobs/*/*; do
    [ -f "$d/pid" ] || continue
    [ -f "$d/exit" ] && continue
    read -r pid < "$d/pid" || continue
    [ -r "/proc/$pid/cmdline" ] || continue
    case "$(tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" in
      *"$d/rank.sh"*) kill -KILL "$pid" 2>/dev/null ;;
    esac
  done
  if [ -d "$root" ]; then echo "REMOVED $root"; else echo "ABSENT $root"; fi
  IFS=$nl; set -f
done
set -- $roots
IFS=$oldifs; set +f
[ $# -eq 0 ] || rm -rf -- "$@" || exit 1
"""

#: The node's keeper (one per cluster root, or one for all roots of a machine): a dead-man's switch
#: that kills a job nobody polls any more (``orphan_timeout`` per rank), and SkyPilot's autodown for a
#: cluster left idle (``idle_down``). It counts its own ticks rather than comparing clocks, forks only
#: ``sleep``, and exits when it has nothing left to guard. ``sh -c KEEPER sky-keeper TICK TICK_MS`` with
#: the roots in ``$SKY_KEEPER_ROOTS`` (one per line).
KEEPER_SCRIPT = (
    MARKED_FUNCS
    + r"""
tick=$1; tick_ms=$2
nl="
"
oldifs=$IFS; IFS=$nl; set -f; set -- $SKY_KEEPER_ROOTS; set +f; IFS=$oldifs
cd /
for root in "$@"; do [ -d "$root" ] && printf '%s\n' "$$" > "$root/keeper.pid"; done
idle=0; launched=-
while :; do
  sleep "$tick" 2>/dev/null || sleep 1
  any=0; active=0
  for root in "$@"; do
    [ -d "$root" ] || continue
    any=1
    for d in "$root"/jobs/*/*; do
      [ -f "$d/pid" ] || continue
      [ -f "$d/exit" ] && continue
      active=1
      [ -f "$d/orphaned" ] && continue
      to=0; [ -f "$d/orphan_timeout" ] && read -r to < "$d/orphan_timeout"
      case "$to" in ''|*[!0-9]*) to=0;; esac
      [ "$to" -gt 0 ] || continue
      pl=-; [ -f "$d/polled" ] && read -r pl < "$d/polled"
      spl=-; sidle=0; [ -f "$d/keeper" ] && read -r spl sidle < "$d/keeper"
      case "$sidle" in ''|*[!0-9]*) sidle=0;; esac
      if [ "$pl" != "$spl" ]; then sidle=0; else sidle=$((sidle + tick_ms)); fi
      printf '%s %s\n' "$pl" "$sidle" > "$d/keeper"
      if [ "$sidle" -ge $((to * 1000)) ]; then
        printf 'orphaned: nothing polled this job for %ss (Airflow lost it); the node killed its processes\n' "$to" > "$d/orphaned"
        pg=''; [ -f "$d/pgid" ] && read -r pg < "$d/pgid"
        case "$pg" in ''|*[!0-9]*) pg='';; esac
        [ -n "$pg" ] && kill -TERM "-$pg" 2>/dev/null
        killmarked TERM "$d/"
        (sleep 3; [ -n "$pg" ] && kill -KILL "-$pg" 2>/dev/null; killmarked KILL "$d/") </dev/null >/dev/null 2>&1 &
      fi
    done
  done
  [ "$any" = 1 ] || exit 0
  root=$1
  l=-; [ -f "$root/launched" ] && read -r l < "$root/launched"
  if [ "$active" = 1 ] || [ "$l" != "$launched" ]; then idle=0; launched=$l; continue; fi
  down=0; [ -f "$root/idle_down" ] && read -r down < "$root/idle_down"
  case "$down" in ''|*[!0-9]*) down=0;; esac
  [ "$down" -gt 0 ] || exit 0
  idle=$((idle + tick_ms))
  [ "$idle" -ge $((down * 1000)) ] || continue
  # idle for idle_down: tear the cluster down on this machine (SkyPilot's autodown)
  for r in "$@"; do killmarked KILL "$r/jobs/"; done
  ik=
  for r in "$@"; do
    [ -f "$r/idle_kill" ] && read -r ik < "$r/idle_kill"
    if [ -f "$r/idle_rm" ]; then while read -r p; do [ -n "$p" ] && rm -rf "$p"; done < "$r/idle_rm"; fi
    rm -rf "$r"
  done
  # the node itself ends with this process (a pod's entrypoint): its resources go back
  case "$ik" in ''|*[!0-9]*) ;; *) kill -TERM "$ik" 2>/dev/null;; esac
  exit 0
done
"""
)


def teardown_script() -> str:
    """The teardown script with the cancel logic inlined: ``sh -s -- GRACE ROOT...``, one call for
    every node root of one machine (the local backend's 1,024 nodes: one scan of /proc, not 1,024)."""
    return TEARDOWN_SCRIPT.replace("__CANCEL__", CANCEL_SCRIPT)


def check_job_id(job_id: str) -> str:
    """Job ids become path parts on nodes: allow only a safe alphabet."""
    if not JOB_ID_RE.match(job_id):
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
        if not ENV_NAME_RE.match(name):
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


def _bre(text: str) -> str:
    """``text`` as a literal POSIX basic regular expression (for a ``sed s///`` with ``/``)."""
    return "".join("\\" + c if c in "\\.*[]^$/" else c for c in text)


def mask_script(secrets: Mapping[str, str]) -> str:
    """A ``sed`` script replacing every secret (and every line of one) with ``***``; '' if none."""
    return "".join(f"s/{_bre(v)}/***/g\n" for v in mask_values(secrets))


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


@dataclass(frozen=True)
class Guard:
    """The node-side guards a launch arms (see :data:`KEEPER_SCRIPT`).

    ``orphan_timeout``: seconds without a poll after which the node kills the job (0: off).
    ``idle_down``: seconds a cluster may sit with nothing running before the node tears it down
    (0: never); ``idle_rm``: further paths the node removes then (its cluster record); ``idle_kill``: a
    process the node then ends, whose end ends the node itself (a pod's entrypoint; 0: none).
    ``keeper_roots``: the roots one keeper watches (a machine that hosts several nodes runs one
    keeper for all); empty: this launch starts none. ``now``: the launcher's clock.
    """

    orphan_timeout: int = 0
    idle_down: int = 0
    idle_rm: Sequence[str] = ()
    idle_kill: int = 0
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
        ";;\nesac\n"
    )


def _write(path: str, content: str) -> str:
    """Write ``content`` verbatim to ``path`` with the shell's builtin ``printf`` (no fork: a gang
    start of 1,024 local ranks writes thousands of files)."""
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


def launch_many_script(
    job_id: str, items: Sequence[tuple[str, RankLaunch, Guard]], wait_seconds: float = 20.0
) -> str:
    """One script that writes and starts ranks of one machine, each under its node's root.

    A rank whose directory already exists is not started again (``EXISTS <rank>``), so a retried launch
    can never run a rank twice. Every wrapper is started before the script waits for any of them, then
    it prints ``STARTED <rank> <pid>`` once each wrapper has recorded its pid (``NOSTART <rank>`` if
    one did not within ``wait_seconds``).
    """
    check_job_id(job_id)
    q = shlex.quote
    parts = ["set -e", "umask 077"]
    prepared: set[str] = set()
    keepers: dict[tuple[str, ...], tuple[str, float]] = {}
    started: list[tuple[str, int]] = []
    for root, rl, guard in items:
        if "\n" in root:
            raise ValueError(f"node root {root!r} contains a newline")
        parts.append(f"root={q(root)}")
        if root not in prepared:
            prepared.add(root)
            parts.append('[ -d "$root/jobs" ] || mkdir -p "$root/jobs"')
            parts.append(f'printf "%s\\n" {q(repr(float(guard.now)))} > "$root/launched"')
            if guard.idle_down > 0:
                parts.append(f'echo {int(guard.idle_down)} > "$root/idle_down"')
                parts.append(_write('"$root/idle_rm"', "\n".join(guard.idle_rm)))
                parts.append(f'echo {int(guard.idle_kill)} > "$root/idle_kill"')
            else:
                parts.append(
                    'if [ -e "$root/idle_down" ] || [ -e "$root/idle_rm" ]; then '
                    'rm -f "$root/idle_down" "$root/idle_rm" "$root/idle_kill"; fi'
                )
        d = f'"$root/jobs"/{q(job_id)}/{int(rl.rank)}'
        parts.append(f"d={d}")
        # mkdir of the rank directory is the claim: two launchers of one attempt never both start it
        parts.append('[ -d "${d%/*}" ] || mkdir -p "${d%/*}"')
        parts.append(f'if ! mkdir "$d" 2>/dev/null; then echo "EXISTS {int(rl.rank)}"; else')
        parts.append(_write('"$d/cmd.sh"', CMD_PROLOGUE + rl.command))
        parts.append(_write('"$d/env"', env_file(rl.env)))
        if rl.secrets:
            parts.append(_write('"$d/secrets"', env_file(rl.secrets)))
            mask = mask_script(rl.secrets)
            if mask:
                # read once by the rank's output filter, then deleted: no secret stays on disk
                parts.append(_write('"$d/mask"', mask))
            if rl.keep_secrets:
                parts.append('cp "$d/secrets" "$d/secrets.keep"')
                if mask:
                    parts.append('cp "$d/mask" "$d/mask.keep"')
        parts.append(_write('"$d/rank.sh"', WRAPPER))
        parts.append(f'echo {int(guard.orphan_timeout)} > "$d/orphan_timeout"')
        parts.append(f'printf "%s\\n" {q(repr(float(guard.now)))} > "$d/polled"')
        parts.append(f"cwd={q(rl.cwd)}")
        parts.append('printf "%s\\n" "$cwd" > "$d/cwd"')
        parts.append(
            'if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 &\n'
            'else nohup sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 & fi'
        )
        parts.append("fi")
        started.append((root, int(rl.rank)))
        roots = [root] if guard.keeper_roots is None else list(guard.keeper_roots)
        if roots and (guard.orphan_timeout > 0 or guard.idle_down > 0):
            keepers.setdefault(tuple(roots), (root, guard.keeper_tick))
    if keepers:
        parts.append("set +e")
        for roots_, (root, tick) in keepers.items():
            parts.append(f"root={q(root)}")
            parts.append(_keeper_start(list(roots_), tick))
    ticks = int(wait_seconds * 20)
    for root, r in started:
        parts.append(
            f"d={q(root)}/jobs/{q(job_id)}/{r}; i=0\n"
            f'while [ ! -f "$d/pid" ] && [ ! -f "$d/exit" ] && [ "$i" -lt {ticks} ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done\n'
            f'if [ -f "$d/pid" ] || [ -f "$d/exit" ]; then p=; {{ read -r p < "$d/pid"; }} 2>/dev/null || :; echo "STARTED {r} $p"; else echo "NOSTART {r}"; fi'
        )
    return "\n".join(parts) + "\n"


def status_args(queries: Sequence[tuple[str, str, int, int, int]], now: float | None = None) -> list[str]:
    """Arguments of :data:`STATUS_SCRIPT`: (node root, job id, rank, log offset, max log bytes) per rank.

    The ranks may sit under different node roots of one machine: one call asks them all. ``now``
    (the poller's clock) is left on the node as the last poll; ``None`` polls without leaving a
    trace (a launch-side bridge must not keep an abandoned job alive).
    """
    args = ["-" if now is None else f"{now:.3f}"]
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
    grace: float, targets: Sequence[tuple[str, str, int]], *, wait: bool = True, reason: str = ""
) -> list[str]:
    """Arguments of :data:`CANCEL_SCRIPT`: (node root, job id, rank) per rank, any number of roots of
    one machine; ``wait=False`` returns right after the SIGTERMs."""
    reason = " ".join(reason.split())[:400]  # one line in the marker file
    args = [f"{max(0.0, float(grace)):.3f}", "wait" if wait else "nowait", reason]
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


class StatusParseError(ValueError):
    """The node's status output is not what the status script prints."""


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
        cancel_reason = output[pos : pos + cn].decode("utf-8", "replace").strip()
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
