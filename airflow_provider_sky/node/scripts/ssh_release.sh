# shellcheck shell=sh

d="$HOME/.sky_airflow/$1"; cur=
read -r cur < "$d/.owner" 2>/dev/null || :
[ "$cur" = "$2" ] || exit 0
rm -f "$d/.owner"; rmdir "$d" 2>/dev/null; exit 0
