# shellcheck shell=sh

umask 077
src=$1; new=$2; attempt=$3; now=$4; ips=$5; gf=$6; shift 6
started=''
if [ -n "$gf" ]; then
  g=3.000; [ -f "${gf%/*/*}/$src/.grace" ] && read -r g < "${gf%/*/*}/$src/.grace"
# shellcheck source=flag_dir.sh
. "$SKY_SCRIPTS/flag_dir.sh"
fi
# shellcheck source=clock_base.sh
. "$SKY_SCRIPTS/clock_base.sh"

nodeips=$(printf '%s' "$ips" | tr ' ' '\n')
while [ $# -ge 2 ]; do
  root=$1; r=$2; shift 2
  s="$root/jobs/$src/$r"; d="$root/jobs/$new/$r"
  [ -f "$s/cmd.sh" ] || [ ! -f "$root/jobs/$src.seed/$r/cmd.sh" ] || s="$root/jobs/$src.seed/$r"
  if [ -f "$s/stop" ]; then echo "STOPPED $r"; continue; fi
  if [ ! -f "$s/cmd.sh" ] || [ ! -f "$s/rank.sh" ]; then echo "NOSRC $r"; continue; fi
  [ -d "$root/jobs/$new" ] || mkdir -p "$root/jobs/$new"
  if ! mkdir "$d" 2>/dev/null; then echo "EXISTS $r"; continue; fi
  cp "$s/cmd.sh" "$s/rank.sh" "$d/"
  grep -v '^export SKY_ATTEMPT=' "$s/env" > "$d/env"
  printf 'export SKY_ATTEMPT=%s\n' "$attempt" >> "$d/env"
  if [ -n "$ips" ]; then
    printf "export SKYPILOT_NODE_IPS='%s'\nexport MASTER_ADDR='%s'\n" "$nodeips" "${ips%% *}" >> "$d/env"
  fi
  [ -f "$s/secrets.keep" ] && cp "$s/secrets.keep" "$d/secrets"
  [ -f "$s/mask.keep" ] && cp "$s/mask.keep" "$d/mask"
  [ -f "$s/orphan_timeout" ] && cp "$s/orphan_timeout" "$d/"
  [ ! -f "$s/result_file" ] || cp "$s/result_file" "$d/"
  printf '%s\n' "$now" > "$d/polled"
  cwd=''; [ -f "$s/cwd" ] && read -r cwd < "$s/cwd"
  cp "$s/cwd" "$d/" 2>/dev/null
  if [ -f "$s/stop" ]; then rm -rf "$d"; echo "STOPPED $r"; continue; fi
  [ -z "$gf" ] || printf '%s %s\n' "$r" "$root" >> "$gj/.ranks"
  if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 &
  else nohup sh "$d/rank.sh" "$d" "$cwd" "$gf" "$cb" "$cu" </dev/null >/dev/null 2>&1 & fi
  started="$started $r:$d"
done
for rd in $started; do
  r=${rd%%:*}; d=${rd#*:}; i=0
  while [ ! -s "$d/pid" ] && [ ! -s "$d/exit" ] && [ "$i" -lt 400 ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done
  if [ -s "$d/pid" ] || [ -s "$d/exit" ]; then p=; { read -r p < "$d/pid"; } 2>/dev/null || :; echo "STARTED $r $p"; else echo "NOSTART $r"; fi
done
