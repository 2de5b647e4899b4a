"""Node scripts of a gang's later attempts: start attempt k from attempt 1's files, and stop retries.

Why from the nodes' own files: whoever drives the retry (the triggers' shared poll, or the launch-side
bridge) may be a triggerer that restarted and never saw the task spec or its secrets (they never travel
in trigger kwargs). Attempt 1's rank directory already holds what a rank needs (``cmd.sh``, ``env``,
``cwd``, ``rank.sh``, and with retries a 0600 copy of the secrets and of their output mask), so attempt k
is a copy of it under the job id ``<job>.a<k>`` with ``SKY_ATTEMPT=k``. ``mkdir`` of the new rank
directory is the claim, so two watchers retrying at once start each rank once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from airflow_provider_sky.runtime import CLOCK_BASE, FLAG_DIR, MARKED_FUNCS, check_job_id

#: ``src new attempt now ips gf``, then ``root rank`` per rank. ``ips``: the cluster's addresses now, space
#: separated (a replaced node's is new): every rank's ``SKYPILOT_NODE_IPS`` and ``MASTER_ADDR``. ``gf``:
#: the machine's gang flag of the new attempt (``runtime.gang_flag``, empty for a single rank): its
#: ranks are listed there for the node's own fail-fast, as a gang start does. A rank
#: whose node was replaced starts from the seed a replacement wrote (``replace``), ``<src>.seed/<rank>``.
#: Prints per rank ``STARTED <rank> <pid>``,
#: ``EXISTS <rank>`` (this attempt's rank was started already), ``STOPPED <rank>`` (a user stopped the
#: gang: ``stop`` in attempt 1's directory) or ``NOSRC <rank>`` (attempt 1's files are gone).
RELAUNCH_SCRIPT = r"""
umask 077
src=$1; new=$2; attempt=$3; now=$4; ips=$5; gf=$6; shift 6
started=''
if [ -n "$gf" ]; then
  g=3.000; [ -f "${gf%/*/*}/$src/.grace" ] && read -r g < "${gf%/*/*}/$src/.grace"
__FLAG_DIR__
fi
__CLOCK__
nodeips=$(printf '%s' "$ips" | tr ' ' '\n')
while [ $# -ge 2 ]; do
  root=$1; r=$2; shift 2
  s="$root/jobs/$src/$r"; d="$root/jobs/$new/$r"
  [ -f "$s/cmd.sh" ] || [ ! -f "$root/jobs/$src.seed/$r/cmd.sh" ] || s="$root/jobs/$src.seed/$r"
  if [ -f "$s/stop" ]; then echo "STOPPED $r"; continue; fi
  if [ ! -f "$s/cmd.sh" ] || [ ! -f "$s/rank.sh" ]; then echo "NOSRC $r"; continue; fi
  [ -d "$root/jobs/$new" ] || mkdir -p "$root/jobs/$new"
  if ! mkdir "$d" 2>/dev/null; then echo "EXISTS $r"; continue; fi
  cp "$s/cmd.sh" "$s/rank.sh" "$d/"
  grep -v '^export SKY_ATTEMPT=' "$s/env" > "$d/env"
  printf 'export SKY_ATTEMPT=%s\n' "$attempt" >> "$d/env"
  if [ -n "$ips" ]; then
    printf "export SKYPILOT_NODE_IPS='%s'\nexport MASTER_ADDR='%s'\n" "$nodeips" "${ips%% *}" >> "$d/env"
  fi
  [ -f "$s/secrets.keep" ] && cp "$s/secrets.keep" "$d/secrets"
  [ -f "$s/mask.keep" ] && cp "$s/mask.keep" "$d/mask"
  [ -f "$s/orphan_timeout" ] && cp "$s/orphan_timeout" "$d/"
  [ ! -f "$s/result_file" ] || cp "$s/result_file" "$d/"
  printf '%s\n' "$now" > "$d/polled"
  cwd=''; [ -f "$s/cwd" ] && read -r cwd < "$s/cwd"
  cp "$s/cwd" "$d/" 2>/dev/null
  if [ -f "$s/stop" ]; then rm -rf "$d"; echo "STOPPED $r"; continue; fi
  [ -z "$gf" ] || printf '%s %s\n' "$r" "$root" >> "$gj/.ranks"
  if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 &
  else nohup sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 & fi
  started="$started $r:$d"
done
for rd in $started; do
  r=${rd%%:*}; d=${rd#*:}; i=0
  while [ ! -s "$d/pid" ] && [ ! -s "$d/exit" ] && [ "$i" -lt 400 ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done
  if [ -s "$d/pid" ] || [ -s "$d/exit" ]; then p=; { read -r p < "$d/pid"; } 2>/dev/null || :; echo "STARTED $r $p"; else echo "NOSTART $r"; fi
done
""".replace("__FLAG_DIR__", FLAG_DIR).replace("__CLOCK__", CLOCK_BASE)

#: Before attempt k+1: SIGKILL whatever attempt k left (by its mark), then say what still runs.
#: ``root job rank`` triples; prints ``LEFT <pid>...`` when a process of those ranks is still alive.
CLEAN_SCRIPT = (
    MARKED_FUNCS
    + r"""
marks=''
nl='
'
while [ $# -ge 3 ]; do marks="$marks$1/jobs/$2/$3/$nl"; shift 3; done
oldifs=$IFS; IFS=$nl; set -f; set -- $marks; set +f; IFS=$oldifs
i=0
while [ -n "$(marked "$@")" ] && [ "$i" -lt 30 ]; do killmarked KILL "$@"; sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1)); done
left=$(marked "$@")
[ -z "$left" ] || echo "LEFT" $left
exit 0
"""
)

#: A user stopped the gang: ``stop`` (holding the reason) in each listed rank's attempt-1 directory,
#: so no watcher starts a further attempt. ``reason`` then ``root job rank`` triples.
STOP_SCRIPT = r"""
reason=$1; shift
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; e="$1/jobs/$2.seed/$3"; shift 3
  [ -d "$d" ] && printf '%s\n' "$reason" > "$d/stop"
  [ -d "$e" ] && printf '%s\n' "$reason" > "$e/stop"
done
exit 0
"""


#: When the next attempt is due (the watcher's clock): ``attempt due`` then ``root job rank`` triples.
#: The first writer's time stays (``due.<attempt>`` in each rank's attempt-1 directory); prints it.
DUE_SCRIPT = r"""
k=$1; due=$2; shift 2
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; [ -d "$d" ] || d="$1/jobs/$2.seed/$3"; shift 3
  [ -d "$d" ] || continue
  [ -s "$d/due.$k" ] || { printf '%s\n' "$due" > "$d/due.$k.tmp" && mv -n "$d/due.$k.tmp" "$d/due.$k"; }
  cat "$d/due.$k" 2>/dev/null
done
exit 0
"""


#: The gang's outcome is final: drop the kept secrets and masks (``root job rank`` triples).
FORGET_SCRIPT = r"""
while [ $# -ge 3 ]; do
  for d in "$1/jobs/$2/$3" "$1/jobs/$2.seed/$3"; do rm -f "$d/secrets.keep" "$d/mask.keep"; done
  shift 3
done
exit 0
"""


def attempt_job_id(job_id: str, attempt: int) -> str:
    """Attempt 1 is the job id itself; attempt k its ``<job>.a<k>`` (the same ``SKYPILOT_TASK_ID``)."""
    return check_job_id(job_id if attempt <= 1 else f"{job_id}.a{int(attempt)}")


#: what an address of a node may be (it goes into rank env files inside single quotes)
IP_RE = re.compile(r"[A-Za-z0-9.:_%-]{1,255}")


def relaunch_args(
    job_id: str,
    attempt: int,
    now: float,
    targets: Sequence[tuple[str, int]],
    ips: Sequence[str] = (),
    flag: str = "",
) -> list[str]:
    """Arguments of :data:`RELAUNCH_SCRIPT`: ``(node root, rank)`` per rank of one machine; ``ips``: the
    cluster's addresses in rank order (empty: the env of attempt 1 keeps its own); ``flag``: the
    machine's gang flag of the new attempt (:func:`~airflow_provider_sky.runtime.gang_flag`)."""
    for ip in ips:
        if not IP_RE.fullmatch(ip):
            raise ValueError(f"node address {ip!r} is not a host name or IP address")
    args = [
        check_job_id(job_id),
        attempt_job_id(job_id, attempt),
        str(int(attempt)),
        f"{now:.3f}",
        " ".join(ips),
        flag,
    ]
    for root, rank in targets:
        if not root or "\n" in root:
            raise ValueError(f"node root {root!r} must be a non-empty path without a newline")
        args += [root, str(int(rank))]
    return args
