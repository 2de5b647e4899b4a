# shellcheck shell=sh

d="$1/jobs/$2/$3"; [ -d "$d" ] || d="$1/jobs/$2.seed/$3"; c="$d/replace.$4"
case "$5" in
claim)
  if mkdir "$c" 2>/dev/null; then printf '%s\n' "$6" > "$c/beat"; echo CLAIMED; exit 0; fi
  if [ -f "$c/done" ]; then echo DONE; cat "$c/done"; exit 0; fi
  b=0; { read -r b < "$c/beat"; } 2>/dev/null || :; echo "BUSY $b" ;;
beat) printf '%s\n' "$6" > "$c/beat" ;;
done) printf '%s\n' "$6" > "$c/done.tmp" && mv "$c/done.tmp" "$c/done" ;;
drop) rm -rf "$c" ;;
read) if [ -f "$c/done" ]; then echo DONE; cat "$c/done"; fi ;;
esac
exit 0
