# shellcheck shell=sh

# The signal targets of the process groups named in ranks' pgid files: $1 holds one "PG RANKDIR" line
# per rank; a target is printed for each group that is still its rank's: "-PG" while the group is the
# rank, "PG" while its first process has not run setsid yet. Nothing is printed for a group that is
# gone or whose number is another's now (a group that ended without an exit record, as a crashed
# wrapper leaves it: a busy machine gives the number out again within minutes).
# The first process is the rank while it is a child of the rank's wrapper (the pid file), or carries the
# rank's mark (its wrapper was killed: a grep, so only then); a first process gone with members left
# keeps the number taken. No /proc: every group, as named.
# One awk reads every rank's two files: `read` in dash takes a byte per system call, which at 1,024
# ranks made a cancel a second slower.
rankgroups() {
  [ -n "$1" ] || return 0
  if [ ! -r /proc/self/stat ]; then
    printf '%s\n' "$1" | while read -r _g _d; do [ -z "$_g" ] || echo "-$_g"; done
    return 0
  fi
  printf '%s\n' "$1" | awk '
    NF >= 2 {
      g = $1; d = substr($0, length($1) + 2); st = "/proc/" g "/stat"; line = ""
      if ((getline line < st) <= 0) { close(st); print "Z", g, d; next }
      close(st)
      # "pid (comm) state ppid pgrp ...": ppid and pgrp are the second and third fields after the last ") "
      sub(/.*\) /, "", line); split(line, f, " ")
      t = (f[3] == g) ? "-" g : g
      w = ""; if ((getline w < (d "/pid")) <= 0) w = ""; close(d "/pid")
      # no wrapper pid yet: the wrapper writes it right after the pgid, so the group is a new one
      if (w !~ /^[0-9]+$/ || f[2] == w) print "T", t, d; else print "M", t, d
    }' | while read -r _k _t _d; do
    case "$_k" in
      T) echo "$_t";;
      M) grep -q -z -F "SKY_PROVIDER_MARK=$_d/" "/proc/${_t#-}/environ" 2>/dev/null && echo "$_t";;
      Z) kill -0 "-$_t" 2>/dev/null && echo "-$_t";;
    esac
  done
  return 0
}
