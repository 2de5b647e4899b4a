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
