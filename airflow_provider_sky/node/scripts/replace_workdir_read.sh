# shellcheck shell=sh

cd "$1" 2>/dev/null && [ -d sky_workdir ] || { echo NONE; exit 0; }
kb=$(du -sk sky_workdir | cut -f1)
if [ "$kb" -gt "$2" ]; then echo "TOOBIG $kb"; exit 0; fi
tar -czf - sky_workdir | base64
