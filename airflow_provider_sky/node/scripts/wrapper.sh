#!/bin/sh
# airflow-provider-sky rank wrapper: the user's command runs in a child shell, so an `exit`,
# `exec` or `set -e` in it can never skip recording its exit code.
d=$1
cwd=$2
# the machine's gang-start flag: a rank that fails on its own appends "rank code" to it, and the
# machine's launchers stop starting its siblings (runtime.launch_many_script)
gf=${3:-}
# Nothing below forks but the command's own start: all ranks of one machine start together, and a
# cancel wakes them all at once, where a `date` or `mv` each would cost a fork. The clock is
# /proc/uptime (monotonic, centiseconds, read with a builtin) counted from the base the launcher read
# once (arguments 4 and 5: epoch and uptime in centiseconds); `date` where either is missing.
cb=${4:-}; cu=${5:-}
# shellcheck source=clock.sh
. "$SKY_SCRIPTS/clock.sh"
# shellcheck source=mask.sh
. "$SKY_SCRIPTS/mask.sh"
sh_=/bin/sh
oldifs=$IFS; IFS=:; set -f
for p_ in $PATH; do [ -f "${p_:-.}/bash" ] && [ -x "${p_:-.}/bash" ] && { sh_=${p_:-.}/bash; break; }; done
set +f; IFS=$oldifs
# shellcheck disable=SC2164 # no working directory: the command runs from HOME, or from here
cd "$cwd" 2>/dev/null || cd
clock; printf '%s\n' "$T" > "$d/start"
# cancelled before its command started (a cancel found no process group yet, or a rank of this machine
# has failed: its gang flag is set): the command never runs, and nothing of it stays on disk
if [ -f "$d/cancel" ] || { [ -n "$gf" ] && [ -s "$gf" ]; }; then
  if [ ! -f "$d/cancel" ]; then
    fr=''; fc=''; { read -r fr fc < "$gf"; } 2>/dev/null || :
    printf '%s\n' "@rank-failed $fr $fc" > "$d/cancel"
  fi
  [ ! -e "$d/secrets" ] && [ ! -e "$d/mask" ] || rm -f "$d/secrets" "$d/mask"
  # it never ran: it ends when it started (as the launchers' never-started records do)
  printf '%s\n' "$T" > "$d/end"; printf '143\n' > "$d/exit"
  exit 0
fi
out="$d/log"
# the secrets reach the command's shell open on fd 5 (cmd.sh sources /dev/fd/5), so their file goes
# before the command starts, in the same rm as the mask (an rm is a fork, and the rank waits on it)
sfd=''
if [ -f "$d/secrets" ] && [ -r /dev/fd/0 ]; then exec 5<"$d/secrets"; sfd=5; fi
fpid=''
if [ -f "$d/mask" ]; then
  [ ! -e "$d/out" ] && [ ! -e "$d/filter.done" ] || rm -f "$d/out" "$d/filter.done"
  if mkfifo -m 600 "$d/out" 2>/dev/null; then
    # held open for writing (fd 6) until the command has opened it, so the read end opens at once
    # (no open of a pipe blocks here); the read end (fd 7) is opened here and the filter has it from
    # its fork: a command that prints and ends before the filter's shell ever ran leaves its output in
    # the pipe, where a filter opening the pipe itself found a new, empty one (or the command a SIGPIPE)
    exec 6<>"$d/out"
    exec 7<"$d/out"
    exec 3<"$d/mask"
    # the result file is masked like the log once the command ended (RESULT below): keep the mask open
    rmask=''; [ ! -f "$d/result_file" ] || { exec 4<"$d/mask"; rmask=1; }
    rm -f "$d/mask" ${sfd:+"$d/secrets"}
    (maskfilter <&7 >>"$d/log" 2>&1; : > "$d/filter.done") 5<&- 6>&- &
    fpid=$!
    exec 3<&- 7<&-
    out="$d/out"
  else
    rm -f "$d/mask" ${sfd:+"$d/secrets"}
    echo "airflow-provider-sky: could not create a pipe to mask secrets; output is not masked" >>"$d/log"
  fi
elif [ -n "$sfd" ]; then
  rm -f "$d/secrets"
fi
# the memory cgroup's OOM-kill count in $ok (v2 memory.events, v1 memory.oom_control; a container sees
# its own at the mount's root): a rank SIGKILLed while it grew was killed for memory, not by a person
oomk() {
  ok=0; _fs=''
  if [ -r /proc/self/cgroup ]; then
    while IFS=: read -r _i _c _p; do
      if [ "$_c" = memory ]; then _fs="$_fs /sys/fs/cgroup/memory$_p/memory.oom_control"
      elif [ "$_i" = 0 ] && [ -z "$_c" ]; then _fs="$_fs /sys/fs/cgroup$_p/memory.events"; fi
    done < /proc/self/cgroup
  fi
  for _f in $_fs /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    [ -r "$_f" ] || continue
    while read -r _k _v; do [ "$_k" = oom_kill ] && { ok=$_v; return 0; }; done < "$_f"
  done
}
oomk; oom0=$ok
if command -v setsid >/dev/null 2>&1; then
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" SKY_SECRETS_FD="$sfd" setsid "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null 4<&- 6>&- &
else
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" SKY_SECRETS_FD="$sfd" "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null 4<&- 6>&- &
fi
child=$!
[ -z "$sfd" ] || exec 5<&-
# the command holds the pipe now (its own open comes before it closes fd 6): the filter sees its end
[ "$out" = "$d/log" ] || exec 6>&-
# written in place (no `mv`): the readers take an empty or partial file as not written yet
printf '%s\n' "$child" > "$d/pgid"
printf '%s\n' "$$" > "$d/pid"
# and in the machine's list of started groups (one append): a failing sibling signals every group listed
# before it reads a file per rank (see the fail-fast below)
[ -z "$gf" ] || printf '%s %s\n' "${d##*/}" "$child" >> "${gf%/*}/.pgids" 2>/dev/null || :
# a cancel that found no pgid above wrote its reason, then read the pgid again: if that read came too
# early, the reason is here now, and this rank stops itself (whichever comes second sends the signal)
[ ! -f "$d/cancel" ] || kill -TERM "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null || :
trap ':' TERM INT HUP
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break
done
# the end is when the command ended: taken first, written once the log is complete
clock; te=$T
# stopped by the machine's own fail-fast (CANCEL_SCRIPT's `first`: signalled before any reason was
# written): the reason goes in the exit file with the code, so no reader sees this rank failed on its own
cr=''
if [ "$rc" != 0 ] && [ -n "$gf" ] && [ ! -f "$d/cancel" ] && [ -f "${gf%/*}/.cancelling/reason" ]; then
  { read -r cr < "${gf%/*}/.cancelling/reason"; } 2>/dev/null || :
  case "$cr" in *[!A-Za-z0-9@\ ._-]*) cr='@rank-failed';; esac
fi
[ ! -e "$d/secrets" ] || rm -f "$d/secrets"
if [ -n "$fpid" ] && [ ! -f "$d/filter.done" ]; then
  # the filter's last read takes a millisecond or two, and the rank's end waits on it: `wait` for its
  # shell, which returns as it ends; a process the rank left behind may hold the pipe open, so a
  # watchdog ends the wait (USR1) and the filter goes on alone: after 2 s while a process of the rank's
  # group is left, else after 10 s (nothing of the group holds the pipe, so the filter is only slow, e.g.
  # still starting on a loaded machine, and the exit must not come before the last line is in the log;
  # the bound is for a process that left the group with setsid and kept the pipe)
  late=''
  wt=2; kill -0 "-$child" 2>/dev/null || wt=10
  trap 'late=1' USR1
  # (killed, it takes its sleep with it: nothing of the rank outlives it; a TERM that comes between the
  # sleep's fork and `s=$!` only sets stop, and the sleep is killed once its pid is known). The sleep gets
  # a KILL: a TERM that reaches it between its fork and its exec finds this subshell's trap, which the
  # exec then drops, and the sleep outlived the rank by 2 s (dash, busybox and bash, under load)
  (
    exec 4<&-; s=''; stop=''
    trap 'stop=1; [ -z "$s" ] || kill -KILL "$s" 2>/dev/null' TERM
    # in sleeps of 2 s, each after a look that the wrapper is still there: a watchdog killed with its
    # wrapper (a cancel's SIGKILL) leaves a sleep of at most 2 s behind
    n=0
    while :; do
      sleep 2 & s=$!
      [ -z "$stop" ] || { kill -KILL "$s" 2>/dev/null; exit 0; }
      wait "$s" && [ -z "$stop" ] && kill -0 "$$" 2>/dev/null || exit 0
      n=$((n + 2)); [ "$n" -lt "$wt" ] || break
    done
    kill -USR1 "$$" 2>/dev/null
    exit 0
  ) </dev/null >/dev/null 2>&1 &
  wd=$!
  while [ -z "$late" ] && [ ! -f "$d/filter.done" ] && kill -0 "$fpid" 2>/dev/null; do wait "$fpid"; done
  kill "$wd" 2>/dev/null
fi
if [ "$rc" = 137 ]; then oomk; [ "$ok" -gt "$oom0" ] 2>/dev/null && : > "$d/oom"; fi
# RESULT: a rank that succeeded keeps (up to 1 MiB + 1 byte of) its result file as "$d/result",
# through the secrets' mask when the job has one, before its exit is written (a reader that saw the
# exit finds it); "~/" is the rank's HOME, a relative path is under its working directory
if [ "$rc" = 0 ] && [ -f "$d/result_file" ]; then
  rf=''; { IFS= read -r rf < "$d/result_file"; } 2>/dev/null || :
  # shellcheck disable=SC2088 # the literal ~/ the user wrote; the env file is the rank's own
  # shellcheck source=/dev/null
  case "$rf" in
    "~/"*) rh=$( . "$d/env" >/dev/null 2>&1; printf '%s' "$HOME"); rf="${rh:-$HOME}/${rf#"~/"}";;
  esac
  if [ -n "$rf" ] && [ -f "$rf" ] && [ -r "$rf" ]; then
    if [ -n "${rmask:-}" ]; then
      head -c 1048577 -- "$rf" 2>/dev/null | maskfilter 3<&4 > "$d/result" 2>/dev/null
    else
      head -c 1048577 -- "$rf" > "$d/result" 2>/dev/null
    fi
  else
    : > "$d/result.missing"
  fi
fi
# code, end and a fail-fast reason in one new file, one write (STATUS_SCRIPT reads all three from it):
# ranks cancelled at once each create it together, and on ext4 a new inode costs a scan of the
# inodes deleted in the last minutes (the last teardown's)
if [ -n "$cr" ]; then printf '%s\n%s\n%s\n' "$rc" "$te" "$cr" > "$d/exit"; else printf '%s\n%s\n' "$rc" "$te" > "$d/exit"; fi
# the filter's pipe goes once the rank is over (a hang dump skips a rank with an exit file)
[ "$out" = "$d/log" ] || rm -f "$d/out"
if [ "$rc" != 0 ] && [ -n "$gf" ] && [ -z "$cr" ] && [ ! -f "$d/cancel" ]; then
  # fail-fast on the node: the machine's first rank to fail on its own cancels every sibling listed
  # here at once (the watchers' poll does the same across machines, a poll later); an orphaned rank
  # was killed by the keeper, which stops its siblings itself. It claims the cancel (.cancelling)
  # before it sets the gang flag: a launcher that sees the flag without the claim cancels its ranks
  # itself (the failure came from elsewhere), with it leaves them to this rank (runtime.launch_many_script)
  j=${gf%/*}; own=''
  if [ ! -f "$d/orphaned" ] && [ -f "$j/.cancel.sh" ] && [ -f "$j/.ranks" ] && mkdir "$j/.cancelling" 2>/dev/null; then own=1; fi
  printf '%s %s\n' "${d##*/}" "$rc" >> "$gf" 2>/dev/null || :
  if [ -n "$own" ]; then
    me=${d##*/}; job=${j##*/}; g=3; [ -f "$j/.grace" ] && read -r g < "$j/.grace"
    m=''; [ -f "$d/oom" ] && m=' oom'
    nl='
'
    # every sibling group in .pgids whose rank has not ended (an ended rank's group number may be
    # another's by now) gets its signal at once, before a file per rank is read; a group whose first
    # process is no longer a child of its rank's wrapper is left to the cancel script (rankgroups)
    early=$(awk -v me="$me" -v job="$job" '
      NR == FNR { r = $1; sub(/^[^ ]* /, ""); root[r] = $0; next }
      $1 != me && ($1 in root) && $2 ~ /^[0-9]+$/ && !(("-" $2) in seen) {
        rd = root[$1] "/jobs/" job "/" $1
        f = rd "/exit"
        if ((getline x < f) >= 0) { close(f); next }
        w = ""; f = rd "/pid"
        if ((getline w < f) > 0) close(f)
        f = "/proc/" $2 "/stat"
        if (w ~ /^[0-9]+$/ && (getline s < f) > 0) {
          close(f); sub(/.*\) /, "", s); split(s, a, " ")
          if (a[2] != w) next
        }
        seen["-" $2] = 1; printf " -%s", $2
      }' "$j/.ranks" "$j/.pgids" 2>/dev/null) || early=''
    # the reason first (whole: written aside, renamed), then the signals: see CANCEL_SCRIPT's `first`
    printf '%s\n' "@rank-failed $me $rc$m" > "$j/.cancelling/reason.$$" && mv "$j/.cancelling/reason.$$" "$j/.cancelling/reason"
    # a group not there yet is a rank whose first process has not run setsid: that process, then
    # shellcheck disable=SC2086 # one kill for every group: the list splits on purpose
    if [ -n "$early" ] && ! kill -TERM $early 2>/dev/null; then
      for pg in $early; do kill -0 "$pg" 2>/dev/null || kill -TERM "${pg#-}" 2>/dev/null; done
    fi
    # then the rest (ranks not started yet, escaped processes, SIGKILL after the grace); no group twice.
    # "root job rank" lines for every other rank listed: one awk (a `read` loop makes a read(2) per byte)
    ts=$(awk -v me="$me" -v job="$job" '{ r = $1; sub(/^[^ ]* /, ""); if (r != me) { print; print job; print r } }' "$j/.ranks" 2>/dev/null) || {
      ts=''
      while read -r r rt; do [ "$r" = "$me" ] || ts="$ts$rt$nl$job$nl$r$nl"; done < "$j/.ranks"
    }
    oldifs=$IFS; IFS=$nl; set -f
    # shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
    set -- $ts; set +f; IFS=$oldifs
    [ $# -eq 0 ] || SKY_SIGNALLED="$early" sh "$j/.cancel.sh" "$g" first "@rank-failed $me $rc$m" "$@" >/dev/null 2>&1 </dev/null
  fi
fi
