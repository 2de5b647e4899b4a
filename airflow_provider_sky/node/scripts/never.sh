# shellcheck shell=sh
# shellcheck disable=SC2154 # gf and d are set by the script that includes this one
why_=''
never() {
  if [ -z "$why_" ]; then fr=; fc=; { read -r fr fc < "$gf"; } 2>/dev/null || :; why_="@rank-failed $fr $fc"; fi
  [ -d "$d" ] || mkdir -p "$d"
  if claim "$d"; then
    clock
    printf '%s\n' "$why_" > "$d/cancel"; printf '%s\n' "$T" > "$d/start"; printf '%s\n' "$T" > "$d/end"
    printf '143\n' > "$d/exit"
    echo "CANCELLED $1"
  else
    echo "EXISTS $1"
  fi
}
