# shellcheck shell=sh

marked() {
  [ -r /proc/self/environ ] || return 0
  [ $# -gt 0 ] || return 0
  # shellcheck disable=SC2062 # the glob is the files grep reads; the patterns come on stdin
  printf "SKY_PROVIDER_MARK=%s\n" "$@" | grep -l -F -f - /proc/[0-9]*/environ 2>/dev/null |
    while read -r _f; do _p=${_f#/proc/}; echo "${_p%/environ}"; done
}
killmarked() {
  _s=$1; shift
  for _p in $(marked "$@"); do kill "-$_s" "$_p" 2>/dev/null; done
}
