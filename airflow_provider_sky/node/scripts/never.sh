# shellcheck shell=sh
# shellcheck disable=SC2154 # gf and d are set by the script that includes this one
why_=''
# the record in $d, claimed already: cancelled at once, nothing run
never_rec() {
  if [ -z "$why_" ]; then fr=; fc=; { read -r fr fc < "$gf"; } 2>/dev/null || :; why_="@rank-failed $fr $fc"; fi
  clock
  printf '%s\n' "$why_" > "$d/cancel"; printf '%s\n' "$T" > "$d/start"; printf '%s\n' "$T" > "$d/end"
  printf '143\n' > "$d/exit"
  echo "CANCELLED $1"
}
never() {
  [ -d "$d" ] || mkdir -p "$d"
  if claim "$d"; then never_rec "$1"; else echo "EXISTS $1"; fi
}
