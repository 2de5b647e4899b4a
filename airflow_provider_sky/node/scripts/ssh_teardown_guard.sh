# shellcheck shell=sh

own=$1; shift
cur=; [ -f "$2/.owner" ] && { read -r cur < "$2/.owner" || :; }
if [ -n "$cur" ] && [ "$cur" != "$own" ]; then printf 'NOT_OURS %s\n' "$cur"; exit 0; fi
