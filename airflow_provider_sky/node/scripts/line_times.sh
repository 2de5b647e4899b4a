# shellcheck shell=sh

d="$1/jobs/$2/$3"; a=$4; b=$5
[ -f "$d/times" ] || exit 0
LC_ALL=C awk -v a="$a" -v b="$b" '$1 + 0 > a + 0 { print $1, $2; if ($1 + 0 >= b + 0) exit }' "$d/times"
