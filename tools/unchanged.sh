#!/usr/bin/env bash
# usage: tools/unchanged.sh PATH -- COMMAND [ARGS...]
# Runs COMMAND and fails if it changed, added or removed any file under PATH: this is how `make test`
# checks that committed generated files (seqdist/, cuda/, README.md) are what the notebooks produce.
set -uo pipefail
path=$1; shift; [ "${1:-}" = "--" ] && shift
snapshot() { find "$path" -type f -not -path '*/__pycache__/*' -print0 2>/dev/null | sort -z | xargs -0 -r sha256sum; }
before=$(snapshot)
"$@" || { echo "FAILED: $*"; exit 1; }
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "FAILED: '$*' changed files under $path; the committed files disagree with the notebooks:"
  diff <(echo "$before") <(echo "$after") | grep '^[<>]' | awk '{print "  " $1 " " $3}' | sort -u -k2
  echo "Run the command, review 'git diff', and commit the notebooks and generated files together."
  exit 1
fi
