# shellcheck shell=sh

marked() {
  [ -r /proc/self/environ ] || return 0
  [ $# -gt 0 ] || return 0
  # -z: an environ file is NUL-separated entries; busybox grep (a busybox image) looks for a fixed
  # string only up to the first NUL of a line, so without -z it saw the first variable alone
  # shellcheck disable=SC2062 # the glob is the files grep reads; the patterns come on stdin
  printf "SKY_PROVIDER_MARK=%s\n" "$@" | grep -l -z -F -f - /proc/[0-9]*/environ 2>/dev/null |
    while read -r _f; do _p=${_f#/proc/}; echo "${_p%/environ}"; done
}
killmarked() {
  _s=$1; shift
  for _p in $(marked "$@"); do kill "-$_s" "$_p" 2>/dev/null; done
}
# The groups among $1 (numbers, space-separated) that still belong to the job, for a SIGKILL after a grace:
# a group number freed meanwhile may be given to another by now (a busy machine with 32768 pids gives them out
# again within minutes). A group holding a process with one of the marks (the rest of the arguments)
# belongs to it; so does one whose leader is gone while members remain (the number stays taken while they
# live). No fork but the one `marked` makes.
owngroups() {
  _g=$1; shift
  [ -n "$_g" ] || return 0
  _in=" "
  for _p in $(marked "$@"); do
    { read -r _l < "/proc/$_p/stat"; } 2>/dev/null || continue
    # "pid (comm) state ppid pgrp ...": the group is the third field after the last ") "
    _l=${_l##*) }; _l=${_l#* }; _l=${_l#* }
    _in="$_in${_l%% *} "
  done
  for _pg in $_g; do
    case "$_in" in *" $_pg "*) echo "$_pg"; continue;; esac
    [ ! -e "/proc/$_pg" ] && kill -0 "-$_pg" 2>/dev/null && echo "$_pg"
  done
  return 0
}
# The signal target of the process group named in a rank pgid file ($2; $1 the rank directory), in
# _t, from builtins: "-PG" while the group is the rank, "PG" while its first process has not run setsid
# yet, empty when the group is gone or its number is another now (a group that ended without an exit
# record, as a crashed wrapper leaves it: a busy machine gives the number out again within minutes).
# The first process is the rank while it is a child of the rank wrapper (the pid file), or carries
# the rank mark (its wrapper was killed: a grep, so only then). No /proc: the group, as named.
rankgroup() {
  _t="-$2"
  [ -r /proc/self/stat ] || return 0
  if { read -r _l < "/proc/$2/stat"; } 2>/dev/null; then
    # "pid (comm) state ppid pgrp ...": ppid and pgrp are the second and third fields after the last ") "
    _l=${_l##*) }; _l=${_l#* }; _pp=${_l%% *}; _l=${_l#* }
    [ "${_l%% *}" = "$2" ] || _t=$2
    _w=""; [ ! -f "$1/pid" ] || { read -r _w < "$1/pid"; } 2>/dev/null || _w=""
    # no wrapper pid yet: the wrapper writes it right after the pgid, so the group is a new one
    case "$_w" in ""|*[!0-9]*) return 0;; esac
    [ "$_pp" != "$_w" ] || return 0
    grep -q -z -F "SKY_PROVIDER_MARK=$1/" "/proc/$2/environ" 2>/dev/null || _t=""
  else
    # the first process is gone: members left keep the number taken; none left, nothing to signal
    kill -0 "-$2" 2>/dev/null || _t=""
  fi
  return 0
}
