# shellcheck shell=sh

reason=$1; shift
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; e="$1/jobs/$2.seed/$3"; shift 3
  [ -d "$d" ] && printf '%s\n' "$reason" > "$d/stop"
  [ -d "$e" ] && printf '%s\n' "$reason" > "$e/stop"
done
exit 0
