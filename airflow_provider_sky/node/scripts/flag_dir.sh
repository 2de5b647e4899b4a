# shellcheck shell=sh
# shellcheck disable=SC2154 # gf and g are set by the script that includes this one
gj="${gf%/*}"; [ -d "$gj" ] || mkdir -p "$gj"
printf "%s\n" "$g" > "$gj/.grace"
[ -f "$gj/.cancel.sh" ] || { printf '%s' @sky-quoted:cancel.sh@ > "$gj/.cancel.sh.$$" && mv "$gj/.cancel.sh.$$" "$gj/.cancel.sh"; }
