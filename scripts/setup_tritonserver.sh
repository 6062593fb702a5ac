#!/usr/bin/env bash
# Unpack a real Triton Inference Server (2.51.0) from the PyPI wheel nvidia-pytriton==0.7.0 into
# .deps/tritonserver/, without Docker and without `pip install` (installing it would pin numpy<2).
#
# Usage: scripts/setup_tritonserver.sh [--stubs 3.11,3.12] [--bundle FILE.tar.xz] [--force]
#   --stubs LIST   Python versions whose backend stub to keep (default: the version of $PYTHON).
#   --bundle FILE  also pack .deps/tritonserver into FILE (tar.xz, ~27 MB with two stubs) for another machine;
#                  unpack there with: mkdir -p .deps && tar -C .deps -xJf FILE
#   --force        unpack again even if already done.
# Env: PYTHON (default .venv/bin/python): its version picks the default stub put in backends/python/.
#      TRITON_WHEEL_CACHE (default .deps/cache/wheels): where the wheel is downloaded.
# Layout (the wheel's own; its RPATHs depend on it):
#   .deps/tritonserver/pytriton/tritonserver/bin/tritonserver
#   .deps/tritonserver/pytriton/tritonserver/backends/python/{libtriton_python.so,triton_python_backend_utils.py,
#                                                             triton_python_backend_stub}
#   .deps/tritonserver/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
#   .deps/tritonserver/nvidia_pytriton.libs/
# scripts/triton_env.py selects the stub matching the interpreter at server start.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEEL_SPEC="nvidia-pytriton==0.7.0"
DEST="$ROOT/.deps/tritonserver"
CACHE="${TRITON_WHEEL_CACHE:-$ROOT/.deps/cache/wheels}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
STUBS="" BUNDLE="" FORCE=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --stubs) STUBS="$2"; shift 2 ;;
    --bundle) BUNDLE="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

log() { echo "[setup_tritonserver] $*" >&2; }

command -v "$PYTHON" >/dev/null 2>&1 || PYTHON="$(command -v python3)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
STUBS="${STUBS:-$PYVER}"
[[ ",$STUBS," == *",$PYVER,"* ]] || STUBS="$STUBS,$PYVER"
TS="$DEST/pytriton/tritonserver"

have_all() {  # the server, the backend and every requested stub are there
  [[ -x "$TS/bin/tritonserver" && -f "$TS/backends/python/libtriton_python.so" ]] || return 1
  local v; for v in ${STUBS//,/ }; do [[ -x "$TS/python_backend_stubs/$v/triton_python_backend_stub" ]] || return 1; done
}

if [[ $FORCE == 0 ]] && have_all; then
  log "already unpacked in $DEST (stubs: $(ls "$TS/python_backend_stubs" | tr '\n' ' '))"
else
  WHEEL="$(ls "$CACHE"/nvidia_pytriton-0.7.0-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$WHEEL" ]]; then
    log "downloading $WHEEL_SPEC into $CACHE"
    mkdir -p "$CACHE"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
      -d "$CACHE" "$WHEEL_SPEC" >&2
    WHEEL="$(ls "$CACHE"/nvidia_pytriton-0.7.0-*.whl | head -n1)"
  fi
  log "unpacking $(basename "$WHEEL") -> $DEST (stubs: $STUBS; default stub: $PYVER)"
  rm -rf "$DEST.tmp"
  # zipfile does not keep permissions; restore the mode bits stored in the wheel.
  SCRIPTS="$ROOT/scripts" "$PYTHON" - "$WHEEL" "$DEST.tmp" "$STUBS" <<'EOF'
import os, sys, zipfile
wheel, dest, stubs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
keep = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/", "nvidia_pytriton.libs/")
keep += tuple(f"pytriton/tritonserver/python_backend_stubs/{v}/" for v in stubs)
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        # libpython3.13 is only used by PyTriton's Python bindings, not by the server or the stubs.
        if info.is_dir() or not name.startswith(keep) or "/libpython3" in name:
            continue
        path = z.extract(info, dest)
        os.chmod(path, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
        n += 1
# The stubs (pybind11 2.10) start Python >= 3.11 with an isolated config that ignores PYTHONPATH.
# triton_python_backend_utils is imported before model.py (and before numpy): honour PYTHONPATH there.
utils = f"{dest}/pytriton/tritonserver/backends/python/triton_python_backend_utils.py"
shim = open(os.path.join(os.environ["SCRIPTS"], "stub_pythonpath_shim.py")).read()
code = open(utils).read()
open(utils, "w").write(shim + "\n" + code)
missing = [v for v in stubs if not os.path.exists(f"{dest}/pytriton/tritonserver/python_backend_stubs/{v}")]
if missing:
    sys.exit(f"no backend stub for Python {missing} in {wheel}")
print(f"[setup_tritonserver] extracted {n} files", file=sys.stderr)
EOF
  rm -rf "$DEST"
  mv "$DEST.tmp" "$DEST"
fi

# The Python backend runs backends/python/triton_python_backend_stub; it must match the model's Python.
if ! cmp -s "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"; then
  log "default stub: Python $PYVER"
  cp -p "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"
fi

# `tritonserver --help` exits 1 even when fine: check that it loads and prints its usage.
USAGE="$(LD_LIBRARY_PATH="$DEST/nvidia_pytriton.libs" "$TS/bin/tritonserver" --help 2>&1 || true)"
[[ "$USAGE" == *"Usage: tritonserver"* ]] || { log "tritonserver does not start:"; echo "$USAGE" | head -n 20 >&2; exit 1; }
log "ok: $DEST/pytriton/tritonserver/bin/tritonserver ($(du -sh "$DEST" | cut -f1))"

if [[ -n "$BUNDLE" ]]; then
  mkdir -p "$(dirname "$BUNDLE")"
  log "packing $DEST -> $BUNDLE"
  tar -C "$(dirname "$DEST")" -cJf "$BUNDLE" "$(basename "$DEST")"
  log "bundle: $BUNDLE ($(du -h "$BUNDLE" | cut -f1)); unpack with: mkdir -p .deps && tar -C .deps -xJf $(basename "$BUNDLE")"
fi
