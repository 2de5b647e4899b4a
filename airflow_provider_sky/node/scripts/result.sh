# shellcheck shell=sh

d="$1/jobs/$2/$3"
if [ -f "$d/result" ]; then
  printf 'RESULT %s\n' "$(wc -c < "$d/result" | tr -d ' ')"
  head -c "$4" "$d/result"
elif [ -f "$d/result.missing" ]; then
  echo MISSING
else
  echo NONE
fi
