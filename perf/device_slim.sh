#!/usr/bin/env bash
# The device tool sends the working tree (tracked and untracked-not-ignored files) and the carried paths, 64 MiB in
# all. With the shipped drafter (39 MB) and perf/results (12 MB) tracked, a carried part of the GGUF (~20 MB) or of the
# tritonserver bundle (17 MB) no longer fits beside them. Nothing on the device reads perf/results (the scripts write
# to $OUT), so for a session's device calls:
#   bash perf/device_slim.sh on    # perf/results out of the index and ignored here (.git/info/exclude): it stays
#                                  # on disk but does not travel (results copied into it meanwhile stay untracked)
#   bash perf/device_slim.sh on --drafters
#                                  # drafters/ (the shipped drafter) out too: ~3 MB travel a call, and the drafter
#                                  # goes once as .deps/dr (`run_gpu_training.sh pack`; its short sequence: header)
#   bash perf/device_slim.sh off   # back in the index as committed, the exclusions gone; new results show up untracked
# Commit only with it off: while it is on, a pre-commit hook (.git/hooks/pre-commit, made by `on`, removed by `off`)
# refuses commits (`git commit -a` would commit the removal of every result; `git commit -- <paths>` would leave it out).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
hook="$(git rev-parse --git-path hooks)/pre-commit"
MARK="# device_slim"
case "${1:-}" in
on)
  paths=(perf/results)
  case "${2:-}" in
  "") ;;
  --drafters) paths+=(drafters) ;;
  *) echo "usage: $0 on [--drafters] | off" >&2; exit 2 ;;
  esac
  mkdir -p "$(dirname "$exclude")" "$(dirname "$hook")"
  for path in "${paths[@]}"; do
    git rm -r -q --cached --ignore-unmatch "$path"   # (already out: a second `on`)
    grep -qx "/$path/" "$exclude" 2>/dev/null || echo "/$path/" >> "$exclude"
  done
  if [ ! -e "$hook" ]; then
    printf '#!/bin/sh\n%s: made by perf/device_slim.sh on, removed by off\necho "perf/device_slim.sh is on (the index lacks perf/results): run \\"bash perf/device_slim.sh off\\" before committing" >&2\nexit 1\n' \
      "$MARK" > "$hook"
    chmod +x "$hook"
  elif ! grep -q "^$MARK" "$hook"; then
    echo "WARNING: $hook exists (not ours) and stays: commits are NOT refused while device_slim is on" >&2
  fi
  git ls-files -z | xargs -0 du -cb | tail -1 | awk '{printf "tracked files now travel as %.1f MB\n", $1 / 1e6}'
  ;;
off)
  if [ -f "$exclude" ]; then sed -i '\#^/perf/results/$#d; \#^/drafters/$#d' "$exclude"; fi
  git reset -q -- perf/results drafters
  if [ -f "$hook" ] && grep -q "^$MARK" "$hook"; then rm -f "$hook"; fi
  git status --short -- perf/results drafters | head -20
  ;;
*)
  echo "usage: $0 on [--drafters] | off" >&2
  exit 2 ;;
esac
