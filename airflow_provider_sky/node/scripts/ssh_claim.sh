# shellcheck shell=sh

d="$HOME/.sky_airflow/$1"; o="$d/.owner"; t="$d/.owner.$$"
mkdir -p "$d" || exit 3
printf '%s\n' "$2" > "$t" || exit 3
if ln "$t" "$o" 2>/dev/null; then rm -f "$t"; echo CLAIMED; exit 0; fi
rm -f "$t"
cur=; read -r cur < "$o" || :
if [ "$cur" = "$2" ]; then echo OURS; else printf 'TAKEN %s\n' "$cur"; fi
