#!/usr/bin/env bash
# Install deploy/ddtree-triton.service for this checkout and enable it at boot.
#   sudo deploy/install.sh [--user USER] [--dir DIR] [--no-start] [--print]
#   --user   account that runs the server (default: the sudo caller); it must own DIR (triton_env.py writes
#            .deps/tritonserver/run/) and read models/
#   --dir    the checkout, after `make setup` (default: the one holding this script)
#   --print  print the rendered unit and change nothing
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_AS="${SUDO_USER:-$(id -un)}"
START=1 PRINT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --user) RUN_AS="$2"; shift 2 ;;
    --dir) DIR="$(realpath -m "$2")"; shift 2 ;;
    --no-start) START=0; shift ;;
    --print) PRINT=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
GROUP="$(id -gn "$RUN_AS")"
UNIT="$(sed -e "s|/opt/ddtree|$DIR|g" -e "s|^User=.*|User=$RUN_AS|" -e "s|^Group=.*|Group=$GROUP|" \
  "$(dirname "${BASH_SOURCE[0]}")/ddtree-triton.service")"
if [[ $PRINT == 1 ]]; then echo "$UNIT"; exit 0; fi
[[ $EUID == 0 ]] || { echo "run as root: sudo $0" >&2; exit 1; }
[[ -x "$DIR/.venv/bin/python" ]] || { echo "no $DIR/.venv: run make setup in $DIR first" >&2; exit 1; }
echo "$UNIT" > /etc/systemd/system/ddtree-triton.service
[[ -f /etc/default/ddtree-triton ]] || install -m 644 "$DIR/deploy/ddtree-triton.env" /etc/default/ddtree-triton
systemctl daemon-reload
systemctl enable ddtree-triton.service
if [[ $START == 1 ]]; then systemctl restart ddtree-triton.service; fi
systemctl --no-pager status ddtree-triton.service || true
