# shellcheck shell=sh
# shellcheck source=marked.sh
. "$SKY_SCRIPTS/marked.sh"

cd /
ticks=$1; gs=$2; shift 2
nl="
"
oldifs=$IFS; IFS=$nl; set -f
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $SKY_KILL_MARKS; set +f; IFS=$oldifs
i=0
while [ "$i" -lt "$ticks" ]; do
  up=""
  for pg in $gs; do kill -0 "-$pg" 2>/dev/null && up=1; done
  [ -z "$up" ] && [ -z "$(marked "$@")" ] && exit 0
  sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
# only the groups that still belong to the job (a number freed during the grace may be given to
# another by now), then the marked processes, whatever their group
for pg in $(owngroups "$gs" "$@"); do kill -KILL "-$pg" 2>/dev/null; done
i=0
while [ "$i" -lt 20 ] && [ -n "$(marked "$@")" ]; do
  killmarked KILL "$@"; sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
