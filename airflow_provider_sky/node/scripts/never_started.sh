# shellcheck shell=sh
# shellcheck source=claim.sh
. "$SKY_SCRIPTS/claim.sh"
j=$1; reason=$2; shift 2
umask 077
t=$(date +%s.%N 2>/dev/null); case "$t" in *N*|'') t=$(date +%s);; esac
while [ $# -ge 2 ]; do
  d="$1/jobs/$j/$2"; r=$2; shift 2
  [ -d "$d" ] || mkdir -p "$d"
  if ! claim "$d"; then echo "EXISTS $r"; continue; fi
  printf '%s\n' "$reason" > "$d/cancel"
  printf '%s\n' "$t" > "$d/start"; printf '%s\n' "$t" > "$d/end"
  printf '143\n' > "$d/exit"
  echo "CANCELLED $r"
done
