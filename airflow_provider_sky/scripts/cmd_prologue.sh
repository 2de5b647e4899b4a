# shellcheck shell=sh
__sky_d=$1; shift
# shellcheck source=/dev/null
. "$__sky_d/env"
# shellcheck source=/dev/null
if [ -f "$__sky_d/secrets" ]; then . "$__sky_d/secrets"; rm -f "$__sky_d/secrets"; fi
unset __sky_d
