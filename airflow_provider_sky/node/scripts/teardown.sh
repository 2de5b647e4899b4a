# shellcheck shell=sh
# shellcheck disable=SC2031 # the cancel runs in a subshell so that its variables stay there
# shellcheck source=unmount.sh
. "$SKY_SCRIPTS/unmount.sh"

grace=$1; shift
nl="
"
roots=''
# one keeper guards every root of a machine: each pid is looked at once (not a `tr`, a fork, per node)
seen=' '
# a keeper the launch started a moment ago may not have exec'd yet (its command line is still the
# launcher's): looked at again once the roots are gone, when it has exec'd or finds no root and ends
later=''
for root in "$@"; do
  roots="$roots$root$nl"
  unmount_buckets "$root"
  if [ -f "$root/keeper.pid" ] && read -r kp < "$root/keeper.pid"; then
    case "$seen" in *" $kp "*) continue;; esac
    seen="$seen$kp "
    case "$(tr '\000' ' ' < "/proc/$kp/cmdline" 2>/dev/null)" in
      *sky-keeper*) kill -KILL "-$kp" 2>/dev/null || kill -KILL "$kp" 2>/dev/null ;;
      *) [ ! -e "/proc/$kp" ] || later="$later $kp" ;;
    esac
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
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $triples
IFS=$oldifs; set +f
(
  extra_mark=${marks%"$nl"}
  set -- "$grace" wait "torn down" "$@"
  # shellcheck source=cancel.sh
  . "$SKY_SCRIPTS/cancel.sh"
)
# kill a wrapper (SIGKILL) with its process group when it leads one (started with setsid: its output
# filter and the watchdog subshell, whose `sleep` would outlive a wrapper killed alone by up to 2 s)
kill_wrapper() {
  _g=''
  if { read -r _st < "/proc/$1/stat"; } 2>/dev/null; then
    _st=${_st##*) }
    # shellcheck disable=SC2086 # the fields after the command name: state ppid pgrp ...
    set -- "$1" $_st
    _g=$4
  fi
  [ "$_g" != "$1" ] || kill -KILL "-$1" 2>/dev/null
  kill -KILL "$1" 2>/dev/null
}
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
      *"$d/rank.sh"*) kill_wrapper "$pid" ;;
    esac
  done
  if [ -d "$root" ]; then echo "REMOVED $root"; else echo "ABSENT $root"; fi
  IFS=$nl; set -f
done
IFS=$oldifs; set +f
# wrappers that wrote their exit and are still finishing (their last writes, a watchdog subshell of
# theirs, which has the same command line): gone before their roots are, within 2 s, or killed
pats=''
IFS=$nl; set -f
for root in $roots; do pats="$pats$root/jobs/$nl"; done
IFS=$oldifs; set +f
wrappers() {
  [ -n "$pats" ] || return 0
  # shellcheck disable=SC2062 # the glob is the files grep reads; the patterns come on stdin
  printf '%s' "$pats" | grep -l -F -f - /proc/[0-9]*/cmdline 2>/dev/null |
    while read -r _f; do
      _p=${_f#/proc/}; _p=${_p%/cmdline}
      case "$(tr '\000' ' ' < "/proc/$_p/cmdline" 2>/dev/null)" in *"/rank.sh "*) echo "$_p";; esac
    done
}
remove_roots() {
  _n=0
  until rm -rf -- "$@" 2>/dev/null; do
    _n=$((_n + 1))
    [ "$_n" -lt 20 ] || { rm -rf -- "$@"; return; }
    sleep 0.1 2>/dev/null || sleep 1
  done
}
n=0; w=$(wrappers)
while [ -n "$w" ] && [ "$n" -lt 20 ]; do
  sleep 0.1 2>/dev/null || sleep 1
  n=$((n + 1)); w=$(wrappers)
done
for p in $w; do kill_wrapper "$p"; done
IFS=$nl; set -f
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $roots
IFS=$oldifs; set +f
# the roots go (node_scripts.teardown_script(remove=False) makes this line a no-op). A watcher's status
# call that began before the teardown can still write into its rank's directory (status.sh notes
# `polled`; a watcher that gave up on a call does not wait for the remote script's end): such a write
# into a directory being emptied fails `rm -rf` ("Directory not empty"), so the roots are removed again,
# every 0.1 s for 2 s at most, and only the last try's error counts
[ $# -eq 0 ] || remove_roots "$@" || exit 1
for kp in $later; do
  case "$(tr '\000' ' ' < "/proc/$kp/cmdline" 2>/dev/null)" in *sky-keeper*) kill -KILL "-$kp" 2>/dev/null || kill -KILL "$kp" 2>/dev/null ;; esac
done
