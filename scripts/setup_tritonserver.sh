#!/usr/bin/env bash
# Unpack a real Triton Inference Server (2.51.0) from the PyPI wheel nvidia-pytriton==0.7.0 into
# .deps/tritonserver/, without Docker and without `pip install` (installing it would pin numpy<2).
#
# Usage: scripts/setup_tritonserver.sh [--stubs 3.11,3.12] [--bundle FILE.tar.xz [--bundle-stubs 3.12]] [--force]
#   --stubs LIST         Python versions to support (default: $PYTHON's, which is always added): their backend
#                        stub and a numpy 1.26.4 for the stub (see below).
#   --bundle FILE        also pack .deps/tritonserver into FILE (tar.xz) for another machine; unpack there with
#                        mkdir -p .deps && tar -C .deps -xJf FILE
#   --bundle-stubs LIST  Python versions to put in the bundle (default: all unpacked).
#   --force              unpack again.
# Env: PYTHON (default .venv/bin/python, else python3): its version gets the default stub in backends/python/.
#      TRITON_WHEEL_CACHE (default .deps/cache/wheels): where wheels are downloaded.
# Layout (the wheel's own; its RPATHs depend on it):
#   .deps/tritonserver/pytriton/tritonserver/bin/tritonserver
#   .deps/tritonserver/pytriton/tritonserver/backends/python/{libtriton_python.so,triton_python_backend_utils.py,
#                                                             triton_python_backend_stub}
#   .deps/tritonserver/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
#   .deps/tritonserver/nvidia_pytriton.libs/
#   .deps/tritonserver/stub_site/3.X/numpy  (numpy 1.26.4: the 2.51 stubs are built with pybind11 2.10, which
#                                            garbles every tensor under numpy 2; triton_env.py puts it first)
# scripts/triton_env.py picks the stub and the environment at server start (it writes under run/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEEL_SPEC="nvidia-pytriton==0.7.0"
NUMPY_SPEC="numpy==1.26.4"  # the last numpy < 2; wheels for Python 3.9 ... 3.12
DEST="$ROOT/.deps/tritonserver"
TS="$DEST/pytriton/tritonserver"
CACHE="${TRITON_WHEEL_CACHE:-$ROOT/.deps/cache/wheels}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
STUBS="" BUNDLE="" BUNDLE_STUBS="" FORCE=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --stubs) STUBS="$2"; shift 2 ;;
    --bundle) BUNDLE="$(realpath -m "$2")"; shift 2 ;;
    --bundle-stubs) BUNDLE_STUBS="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

log() { echo "[setup_tritonserver] $*" >&2; }

[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ ",$STUBS," == *",$PYVER,"* ]] || STUBS="${STUBS:+$STUBS,}$PYVER"
mkdir -p "$CACHE"

# 1. The server, the Python backend and the stubs.
have_all() {
  [[ -x "$TS/bin/tritonserver" && -f "$TS/backends/python/libtriton_python.so" ]] || return 1
  local v; for v in ${STUBS//,/ }; do [[ -x "$TS/python_backend_stubs/$v/triton_python_backend_stub" ]] || return 1; done
}
if [[ $FORCE == 0 ]] && have_all; then
  log "server already in $DEST (stubs: $(ls "$TS/python_backend_stubs" | tr '\n' ' '))"
else
  WHEEL="$(ls "$CACHE"/nvidia_pytriton-0.7.0-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$WHEEL" ]]; then
    log "downloading $WHEEL_SPEC (55 MB) into $CACHE"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
      -d "$CACHE" "$WHEEL_SPEC" >&2
    WHEEL="$(ls "$CACHE"/nvidia_pytriton-0.7.0-*.whl | head -n1)"
  fi
  log "unpacking $(basename "$WHEEL") -> $DEST (stubs: $STUBS)"
  rm -rf "$DEST.tmp"
  "$PYTHON" - "$WHEEL" "$DEST.tmp" "$STUBS" <<'EOF'
import os, sys, zipfile
wheel, dest, stubs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
keep = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/", "nvidia_pytriton.libs/")
keep += tuple(f"pytriton/tritonserver/python_backend_stubs/{v}/" for v in stubs)
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        # libpython3.13 only serves PyTriton's Python bindings, not the server or the stubs.
        if info.is_dir() or not info.filename.startswith(keep) or "/libpython3" in info.filename:
            continue
        path = z.extract(info, dest)  # zipfile drops the mode bits: restore the executable ones
        os.chmod(path, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
        n += 1
missing = [v for v in stubs if not os.path.isdir(f"{dest}/pytriton/tritonserver/python_backend_stubs/{v}")]
if missing:
    sys.exit(f"no backend stub for Python {missing} in {wheel}")
print(f"[setup_tritonserver] extracted {n} files", file=sys.stderr)
EOF
  [[ -d "$DEST/stub_site" ]] && mv "$DEST/stub_site" "$DEST.tmp/"  # keep numpy overlays already unpacked
  rm -rf "$DEST"
  mv "$DEST.tmp" "$DEST"
fi

# The Python backend runs backends/python/triton_python_backend_stub: default to $PYTHON's version.
if ! cmp -s "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"; then
  log "default stub: Python $PYVER"
  cp -p "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"
fi

# 2. numpy 1.26.4 for each stub's Python (without tests, f2py, distutils: not needed in a server).
for v in ${STUBS//,/ }; do
  site="$DEST/stub_site/$v"
  [[ -f "$site/numpy/__init__.py" ]] && continue
  if [[ "${v#3.}" -gt 12 ]]; then log "WARNING: no numpy < 2 for Python $v; its models must not use numpy"; continue; fi
  whl="$(ls "$CACHE"/numpy-1.26.4-cp${v/./}-cp${v/./}-manylinux_2_17_x86_64*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$whl" ]]; then
    log "downloading $NUMPY_SPEC for Python $v"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
      --python-version "$v" -d "$CACHE" "$NUMPY_SPEC" >&2
    whl="$(ls "$CACHE"/numpy-1.26.4-cp${v/./}-cp${v/./}-manylinux_2_17_x86_64*.whl | head -n1)"
  fi
  log "unpacking $(basename "$whl") -> $site"
  "$PYTHON" - "$whl" "$site.tmp" <<'EOF'
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
skip = ("/tests/", "numpy/f2py/", "numpy/distutils/", "numpy/_pyinstaller/", ".pyi")
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if not info.is_dir() and not any(s in info.filename for s in skip):
            os.chmod(z.extract(info, dest), 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
EOF
  rm -rf "$site"; mv "$site.tmp" "$site"
done

# 3. Check that the binary loads (`tritonserver --help` exits 1 even when all is well).
USAGE="$(LD_LIBRARY_PATH="$DEST/nvidia_pytriton.libs" "$TS/bin/tritonserver" --help 2>&1 || true)"
[[ "$USAGE" == *"Usage: tritonserver"* ]] || { log "tritonserver does not start:"; echo "$USAGE" | head -n 20 >&2; exit 1; }
log "ok: $TS/bin/tritonserver ($(du -sh "$DEST" | cut -f1))"

# 4. Optional bundle for another machine (what triton_env.py made at run time under run/ stays out).
if [[ -n "$BUNDLE" ]]; then
  excludes=(--exclude=tritonserver/run)
  if [[ -n "$BUNDLE_STUBS" ]]; then
    for d in "$TS"/python_backend_stubs/* "$DEST"/stub_site/*; do
      [[ ",$BUNDLE_STUBS," == *",$(basename "$d"),"* ]] || excludes+=(--exclude="tritonserver/${d#"$DEST/"}")
    done
  fi
  mkdir -p "$(dirname "$BUNDLE")"
  log "packing $DEST -> $BUNDLE (stubs: ${BUNDLE_STUBS:-all})"
  tar -C "$(dirname "$DEST")" --exclude=__pycache__ "${excludes[@]}" -cf - "$(basename "$DEST")" | xz -T0 -9 > "$BUNDLE"
  log "bundle: $BUNDLE ($(du -h "$BUNDLE" | cut -f1)); unpack with: mkdir -p .deps && tar -C .deps -xJf $(basename "$BUNDLE")"
fi
