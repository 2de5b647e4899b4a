# shellcheck shell=sh
__sky_d=$1; shift
# shellcheck source=/dev/null
. "$__sky_d/env"
# the secrets: open on fd 5 (the wrapper deleted their file already), else their file, deleted once read
if [ -n "${SKY_SECRETS_FD:-}" ]; then
  # shellcheck source=/dev/null
  . /dev/fd/5; exec 5<&-
elif [ -f "$__sky_d/secrets" ]; then
  # shellcheck source=/dev/null
  . "$__sky_d/secrets"; rm -f "$__sky_d/secrets"
fi
unset __sky_d SKY_SECRETS_FD
