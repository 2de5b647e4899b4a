# shellcheck shell=sh
# shellcheck source=marked.sh
. "$SKY_SCRIPTS/marked.sh"

marks=''
nl='
'
while [ $# -ge 3 ]; do marks="$marks$1/jobs/$2/$3/$nl"; shift 3; done
oldifs=$IFS; IFS=$nl; set -f
# shellcheck disable=SC2086 # split on purpose: IFS is a newline, globbing is off
set -- $marks; set +f; IFS=$oldifs
i=0
while [ -n "$(marked "$@")" ] && [ "$i" -lt 30 ]; do killmarked KILL "$@"; sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1)); done
left=$(marked "$@")
# shellcheck disable=SC2086 # the pids, one word each
[ -z "$left" ] || echo "LEFT" $left
exit 0
