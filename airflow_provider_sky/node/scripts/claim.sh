# shellcheck shell=sh
claim() { set -C; { true > "$1/claim"; } 2>/dev/null; _c=$?; set +C; return $_c; }
