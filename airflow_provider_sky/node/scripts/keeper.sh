# shellcheck shell=sh
# shellcheck source=marked.sh
. "$SKY_SCRIPTS/marked.sh"
# shellcheck source=rankgroups.sh
. "$SKY_SCRIPTS/rankgroups.sh"
# shellcheck source=unmount.sh
. "$SKY_SCRIPTS/unmount.sh"

tick=$1; tick_ms=$2
nl="
"
oldifs=$IFS; IFS=$nl; set -f
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $SKY_KEEPER_ROOTS; set +f; IFS=$oldifs
cd /
# started after a teardown removed its roots (it ran between the launch and the teardown's look): ends
any=0; for root in "$@"; do [ -d "$root" ] && any=1; done
[ "$any" = 1 ] || exit 0
for root in "$@"; do [ -d "$root" ] && printf '%s\n' "$$" > "$root/keeper.pid"; done
idle=0; launched=-
while :; do
  sleep "$tick" 2>/dev/null || sleep 1
  any=0; active=0
  for root in "$@"; do
    [ -d "$root" ] || continue
    any=1
    for d in "$root"/jobs/*/*; do
      [ -f "$d/pid" ] || continue
      [ -f "$d/exit" ] && continue
      active=1
      [ -f "$d/orphaned" ] && continue
      to=0; [ -f "$d/orphan_timeout" ] && read -r to < "$d/orphan_timeout"
      case "$to" in ''|*[!0-9]*) to=0;; esac
      [ "$to" -gt 0 ] || continue
      pl=-; [ -f "$d/polled" ] && read -r pl < "$d/polled"
      spl=-; sidle=0; [ -f "$d/keeper" ] && read -r spl sidle < "$d/keeper"
      case "$sidle" in ''|*[!0-9]*) sidle=0;; esac
      if [ "$pl" != "$spl" ]; then sidle=0; else sidle=$((sidle + tick_ms)); fi
      printf '%s %s\n' "$pl" "$sidle" > "$d/keeper"
      if [ "$sidle" -ge $((to * 1000)) ]; then
        printf 'orphaned: nothing polled this job for %ss (Airflow lost it); the node killed its processes\n' "$to" > "$d/orphaned"
        pg=''; [ -f "$d/pgid" ] && read -r pg < "$d/pgid"
        case "$pg" in ''|*[!0-9]*) pg='';; esac
        [ -z "$pg" ] || for t in $(rankgroups "$pg $d"); do kill -TERM "$t" 2>/dev/null; done
        killmarked TERM "$d/"
        (sleep 3; for g in $(owngroups "$pg" "$d/"); do kill -KILL "-$g" 2>/dev/null; done; killmarked KILL "$d/") </dev/null >/dev/null 2>&1 &
      fi
    done
  done
  [ "$any" = 1 ] || exit 0
  root=$1
  l=-; [ -f "$root/launched" ] && read -r l < "$root/launched"
  if [ "$active" = 1 ] || [ "$l" != "$launched" ]; then idle=0; launched=$l; continue; fi
  down=0; [ -f "$root/idle_down" ] && read -r down < "$root/idle_down"
  case "$down" in ''|*[!0-9]*) down=0;; esac
  [ "$down" -gt 0 ] || exit 0
  idle=$((idle + tick_ms))
  [ "$idle" -ge $((down * 1000)) ] || continue
  # idle for idle_down: tear the cluster down on this machine (SkyPilot's autodown)
  for r in "$@"; do killmarked KILL "$r/jobs/"; done
  ik=; off=
  for r in "$@"; do
    [ -f "$r/idle_kill" ] && read -r ik < "$r/idle_kill"
    [ -f "$r/idle_off" ] && off=$(cat "$r/idle_off")
    unmount_buckets "$r"
    if [ -f "$r/idle_rm" ]; then while read -r p; do [ -n "$p" ] && rm -rf "$p"; done < "$r/idle_rm"; fi
    rm -rf "$r"
  done
  # the node itself ends with this process (a pod's entrypoint): its resources go back
  # (0: none; "kill 0" would end this keeper's own process group before the power-off below)
  case "$ik" in ''|0|*[!0-9]*) ;; *) kill -TERM "$ik" 2>/dev/null;; esac
  # or the machine powers itself off (an EC2 instance launched to terminate on shutdown)
  [ -n "$off" ] && sh -c "$off" </dev/null >/dev/null 2>&1
  exit 0
done
