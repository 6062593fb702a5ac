#!/usr/bin/env bash
# The device tool sends the working tree (tracked and untracked-not-ignored files) and the carried paths, 64 MiB in
# all. With the shipped drafter (39 MB) and perf/results (12 MB) tracked, a carried part of the GGUF (~20 MB) or of the
# tritonserver bundle (17 MB) no longer fits beside them. Nothing on the device reads perf/results (the scripts write
# to $OUT), so for a session's device calls:
#   bash perf/device_slim.sh on    # perf/results out of the index and ignored here (.git/info/exclude): it stays
#                                  # on disk but does not travel (results copied into it meanwhile stay untracked)
#   bash perf/device_slim.sh off   # back in the index as committed, the exclusion gone; new results show up untracked
# Commit only with it off (`git commit -- <paths>` with it on leaves the index's removal out of the commit).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
case "${1:-}" in
on)
  git rm -r -q --cached perf/results
  grep -qx '/perf/results/' "$exclude" 2>/dev/null || echo '/perf/results/' >> "$exclude"
  git ls-files -z | xargs -0 du -cb | tail -1 | awk '{printf "tracked files now travel as %.1f MB\n", $1 / 1e6}'
  ;;
off)
  if [ -f "$exclude" ]; then sed -i '\#^/perf/results/$#d' "$exclude"; fi
  git reset -q -- perf/results
  git status --short -- perf/results | head -20
  ;;
*)
  echo "usage: $0 on|off" >&2
  exit 2 ;;
esac
