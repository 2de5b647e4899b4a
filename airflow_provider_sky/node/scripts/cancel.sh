# shellcheck shell=sh
# shellcheck source=marked.sh
. "$SKY_SCRIPTS/marked.sh"
# shellcheck source=rankgroups.sh
. "$SKY_SCRIPTS/rankgroups.sh"

grace=$1; mode=$2; reason=$3; shift 3
# "after:JOBDIR" (a watcher's fail-fast): nothing to do once a rank of this machine claimed the machine's
# own cancel there; it covers every rank of the machine, and a second cancel writes a reason file per
# rank while the first one's victims need the CPU
case "$mode" in
  after:*) [ ! -d "${mode#after:}/.cancelling" ] || exit 0; mode=nowait;;
esac
tick() { sleep 0.1 2>/dev/null || sleep 1; }
groups=''; term=''; read_groups=''
nl='
'
marks=${extra_mark:-}
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; shift 3
  marks="$marks$nl$d/"
  [ -d "$d" ] || continue
  [ -f "$d/exit" ] && continue
  pg=''
  [ ! -f "$d/pgid" ] || { read -r pg < "$d/pgid"; } 2>/dev/null || pg=''
  case "$pg" in
    ''|*[!0-9]*)
      # no process group yet: the reason first, then the pgid once more (its wrapper, writing its pgid
      # meanwhile, checks for the reason right after: one of the two sends the signal; see WRAPPER)
      printf '%s\n' "$reason" > "$d/cancel"
      [ ! -f "$d/pgid" ] || { read -r pg < "$d/pgid"; } 2>/dev/null || pg=''
      case "$pg" in ''|*[!0-9]*) continue;; esac;;
    *) [ "$mode" = first ] || printf '%s\n' "$reason" > "$d/cancel";;
  esac
  echo "C $d"
  read_groups="$read_groups$nl$pg $d"
done
# only the groups that are still their ranks' (see rankgroups): a number read from a rank that ended
# without an exit record may be another process group now
for t in $(rankgroups "$read_groups"); do
  pg=${t#-}
  groups="$groups $pg"
  # signalled already by the failing rank (SKY_SIGNALLED: " -PGID ..."): a group gets one SIGTERM
  case "${SKY_SIGNALLED:-} " in *" -$pg "*) ;; *) term="$term $t";; esac
done
# every reason first, then every group in one kill: many ranks signalled one by one would wake and
# take the CPU this loop needs before the last one is signalled
# shellcheck disable=SC2086 # one kill for every group: the list splits on purpose
[ -z "$term" ] || kill -TERM $term 2>/dev/null || :
oldifs=$IFS; IFS=$nl; set -f
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $marks; set +f; IFS=$oldifs
# then the marked processes outside those groups (escaped: setsid, a daemon, an orphan of an ended
# rank); a group's own members had their SIGTERM, and a second one runs a handler twice
outside=$(marked "$@")
if [ -n "$outside" ] && [ -n "$groups" ] && tab=$(ps -eo pid=,pgid= 2>/dev/null); then
  # shellcheck disable=SC2086,SC2116 # echo joins the pids onto one line
  outside=$(printf '%s\n' "$tab" | awk -v m="$(echo $outside)" -v g="$groups" 'BEGIN {
    n = split(m, a, " "); for (i = 1; i <= n; i++) w[a[i]] = 1
    n = split(g, b, " "); for (i = 1; i <= n; i++) x[b[i]] = 1 }
    ($1 in w) && !($2 in x) { print $1 }')
fi
for p in $outside; do kill -TERM "$p" 2>/dev/null; done
if [ "$mode" != wait ]; then
  # fail-fast: return at once; a detached helper SIGKILLs whatever is left after the grace
  killer='@sky:killer.sh@'
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
  # only the groups that still belong to the job: one that ended during the grace may have its number reused
  for pg in $(owngroups "$groups" "$@"); do
    kill -KILL "-$pg" 2>/dev/null
    command -v pkill >/dev/null 2>&1 && pkill -KILL -s "$pg" 2>/dev/null
    echo "K $pg"
  done
  killmarked KILL "$@"
fi
i=0
while alive "$@" && [ "$i" -lt 50 ]; do killmarked KILL "$@"; tick; i=$((i + 1)); done
left=$(marked "$@")
# shellcheck disable=SC2086 # the pids, one word each
[ -z "$left" ] || echo "LEFT" $left
exit 0
