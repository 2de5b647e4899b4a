# shellcheck shell=sh
# shellcheck source=marked.sh
. "$SKY_SCRIPTS/marked.sh"

# a process's command line, whole arguments up to ~300 characters: a cut inside one could leave the
# first part of a secret, which no mask matches
args() {
  tr '\000' '\n' < "/proc/$1/cmdline" 2>/dev/null |
    awk 'NR > 1 && length(s) + length($0) >= 300 { s = s " ..."; exit } { s = s (NR > 1 ? " " : "") $0 } END { print s }'
}
reason=$1; shift
pyspy=$(command -v py-spy 2>/dev/null || :)
to=''; command -v timeout >/dev/null 2>&1 && to='timeout 20'
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; r=$3; shift 3
  [ -d "$d" ] && [ ! -f "$d/exit" ] || continue
  mkdir "$d/hang" 2>/dev/null || continue
  cl=1
  if [ ! -p "$d/out" ]; then exec 4>>"$d/log"
  elif [ ! -f "$d/filter.done" ]; then exec 4<>"$d/out"
  else exec 4>>"$d/log"; cl=''
  fi
  {
  echo "==== airflow-provider-sky: rank $r $reason; stack dump of its processes ===="
  for p in $(marked "$d/"); do
    [ -d "/proc/$p" ] || continue
    if [ -n "$cl" ]; then
      echo "--- process $p ($(cat "/proc/$p/comm" 2>/dev/null)): $(args "$p")"
      if [ -n "$pyspy" ] && $to "$pyspy" dump --pid "$p" 2>/dev/null; then continue; fi
    else
      echo "--- process $p ($(cat "/proc/$p/comm" 2>/dev/null)): command line not shown (the rank's secrets can no longer be masked)"
    fi
    for t in /proc/"$p"/task/[0-9]*; do
      s=$(sed -n 's/^State:[[:space:]]*//p' "$t/status" 2>/dev/null)
      w=$(cat "$t/wchan" 2>/dev/null); [ -n "$w" ] || w='?'
      echo "thread ${t##*/} ($(cat "$t/comm" 2>/dev/null)): state $s, wchan $w"
      k=$(cat "$t/stack" 2>/dev/null)
      if [ -n "$k" ]; then printf '%s\n' "$k" | sed 's/^/    /'; else echo "    (kernel stack not readable here: needs root)"; fi
    done
  done
  echo "==== end of the stack dump of rank $r ===="
  } >&4 2>&1
  exec 4>&-
  echo "DUMPED $r"
done
