# shellcheck shell=sh

root=$1; job=$2; r=$3
s="$root/jobs/$job/$r"; [ -f "$s/cmd.sh" ] || s="$root/jobs/$job.seed/$r"
if [ ! -f "$s/cmd.sh" ] || [ ! -f "$s/rank.sh" ]; then echo NOSRC; exit 0; fi
emit() { if [ -f "$2" ]; then printf '@@FILE %s %s\n' "$1" "$(wc -c < "$2" | tr -d ' ')"; cat "$2"; fi; }
for f in cmd.sh rank.sh env cwd orphan_timeout secrets.keep mask.keep result_file; do emit "run/$f" "$s/$f"; done
# shellcheck disable=SC2012 # newest first; the names are rank directories we made (no newlines)
best=$(ls -t "$root/jobs"/*/"$r"/env 2>/dev/null | while IFS= read -r e; do
  if grep -q '^export SKYPILOT_SETUP_NODE_RANK=' "$e"; then printf '%s\n' "${e%/env}"; break; fi
done)
if [ -n "$best" ]; then for f in cmd.sh env cwd; do emit "setup/$f" "$best/$f"; done; fi
exit 0
