# shellcheck shell=sh

d=$1; cwd=$2
if [ -f "$d/pid" ] || [ -f "$d/exit" ]; then echo STARTED; exit 0; fi
if command -v setsid >/dev/null 2>&1; then setsid sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 &
else nohup sh "$d/rank.sh" "$d" "$cwd" </dev/null >/dev/null 2>&1 & fi
i=0
while [ ! -s "$d/pid" ] && [ ! -s "$d/exit" ] && [ "$i" -lt 400 ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done
if [ -f "$d/pid" ] || [ -f "$d/exit" ]; then echo STARTED; else echo NOSTART; fi
