# shellcheck shell=sh

rec="$HOME/$1"; had=$2; put=$3; d=$(dirname "$rec"); w=${5:-60}
case "$w" in ''|*[!0-9]*) w=60;; esac
mkdir -p "$d" || exit 3
if [ "$4" != mkdir ] && command -v flock >/dev/null 2>&1; then
  exec 9>>"$d/.lock" || exit 3
  flock -w "$w" 9 || { echo "the cluster records' lock $d/.lock is held for over ${w}s" >&2; exit 3; }
else
  n=0
  while ! mkdir "$d/.lockd" 2>/dev/null; do
    p=; read -r p < "$d/.lockd/pid" 2>/dev/null || true
    if [ -n "$p" ] && ! kill -0 "$p" 2>/dev/null; then rm -rf "$d/.lockd"; continue; fi
    n=$((n + 1))
    [ "$n" -lt $((w * 10)) ] || { echo "the cluster records' lock $d/.lockd is held for over ${w}s" >&2; exit 3; }
    sleep 0.1
  done
  trap 'rm -rf "$d/.lockd"' EXIT
  trap 'exit 1' HUP INT TERM
  echo $$ > "$d/.lockd/pid"
fi
has=0; cur=
if [ -f "$rec" ]; then has=1; cur=$(cat "$rec") || exit 3; fi
old=$(cat <<'__OLD_EOF__'
__OLD__
__OLD_EOF__
)
if [ "$has" != "$had" ] || [ "$cur" != "$old" ]; then
  echo CONFLICT
  [ "$has" = 1 ] && printf '%s\n' "$cur"
  exit 0
fi
if [ "$put" = 1 ]; then
  umask 077
  cat > "$rec.tmp" <<'__NEW_EOF__' || exit 3
__NEW__
__NEW_EOF__
  mv "$rec.tmp" "$rec" || exit 3
else
  rm -f "$rec"
fi
echo OK
