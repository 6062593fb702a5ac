#!/usr/bin/env bash
# Install the real perf_analyzer (PyPI perf-analyzer==2.60.0, a manylinux_2_38 binary) as .deps/bin/perf_analyzer.
# (tritonclient[all] pulls perf-analyzer 0.1.0 on glibc < 2.38: an empty placeholder.)
#
# Usage: scripts/setup_perf_analyzer.sh [--force]
# On glibc < 2.38 (Debian 12) the binary runs through Debian 13 (trixie)'s loader and C/C++ runtime:
# libc6, libstdc++6 and libgcc-s1 are fetched with `apt-get download` under a private apt configuration
# (.deps/apt; the system's apt setup is only read, never changed) from the Debian mirror this machine's
# apt sources already name, and unpacked with `dpkg -x` into .deps/glibc238/.
# On glibc >= 2.38 (Debian 13, Ubuntu 24.04) the wrapper runs the binary as it is.
# Env: PYTHON (default .venv/bin/python, else python3) runs pip; TRITON_WHEEL_CACHE as in setup_tritonserver.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="$ROOT/.deps"
SPEC="perf-analyzer==2.60.0"
PA_DIR="$DEPS/perf_analyzer"
PA_BIN="$PA_DIR/perf_analyzer/bin/perf_analyzer"
GLIBC_DIR="$DEPS/glibc238"
APT_DIR="$DEPS/apt"
WRAPPER="$DEPS/bin/perf_analyzer"
CACHE="${TRITON_WHEEL_CACHE:-$DEPS/cache/wheels}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { echo "[setup_perf_analyzer] $*" >&2; }

# 1. The binary, from the wheel (unzipped: keeps the pip environment untouched).
if [[ $FORCE == 1 || ! -x "$PA_BIN" ]]; then
  mkdir -p "$CACHE"
  WHEEL="$(ls "$CACHE"/perf_analyzer-2.60.0-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$WHEEL" ]]; then
    log "downloading $SPEC into $CACHE"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
      -d "$CACHE" "$SPEC" >&2
    WHEEL="$(ls "$CACHE"/perf_analyzer-2.60.0-*.whl | head -n1)"
  fi
  log "unpacking $(basename "$WHEEL") -> $PA_DIR"
  rm -rf "$PA_DIR"
  "$PYTHON" - "$WHEEL" "$PA_DIR" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if not info.is_dir():
            os.chmod(z.extract(info, sys.argv[2]), 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
EOF
fi

# 2. glibc >= 2.38, from Debian 13 if this system's is older.
GLIBC="$(getconf GNU_LIBC_VERSION | awk '{print $2}')"
if [[ "$(printf '%s\n' 2.38 "$GLIBC" | sort -V | head -n1)" == 2.38 ]]; then
  log "system glibc $GLIBC >= 2.38: perf_analyzer runs as it is"
  LOADER=""
else
  LOADER="$GLIBC_DIR/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  if [[ $FORCE == 1 || ! -x "$LOADER" || ! -e "$GLIBC_DIR/usr/lib/x86_64-linux-gnu/libstdc++.so.6" ]]; then
    # The Debian mirror this machine already uses (deb822 .sources or one-line .list files).
    MIRROR="$(
      { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true
        grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
          | sed -E 's/\[[^]]*\] //' | awk '{print $2}' || true
      } | grep -E '/debian/?$' | head -n1 || true
    )"
    [[ -n "$MIRROR" ]] || { log "no Debian mirror in /etc/apt sources: cannot fetch trixie's libc6"; exit 1; }
    log "system glibc $GLIBC < 2.38: fetching trixie's libc6 libstdc++6 libgcc-s1 from $MIRROR"
    mkdir -p "$APT_DIR"/{lists/partial,cache/archives/partial,parts,prefs,debs}
    KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
    echo "deb [arch=amd64 signed-by=$KEYRING] ${MIRROR%/} trixie main" > "$APT_DIR/sources.list"
    APT_OPTS=(
      -o Dir::Etc::SourceList="$APT_DIR/sources.list" -o Dir::Etc::SourceParts="$APT_DIR/parts"
      -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts="$APT_DIR/prefs"
      -o Dir::State::Lists="$APT_DIR/lists" -o Dir::Cache="$APT_DIR/cache"
      -o Dir::State::status=/dev/null -o APT::Sandbox::User=root
      -o Acquire::Languages=none
    )
    apt-get -q "${APT_OPTS[@]}" update >&2
    rm -f "$APT_DIR"/debs/*.deb
    (cd "$APT_DIR/debs" && apt-get -q "${APT_OPTS[@]}" download libc6 libstdc++6 libgcc-s1 >&2)
    rm -rf "$GLIBC_DIR"
    for deb in "$APT_DIR"/debs/*.deb; do
      log "dpkg -x $(basename "$deb")"
      dpkg -x "$deb" "$GLIBC_DIR"
    done
  else
    log "system glibc $GLIBC < 2.38: using trixie's runtime already in $GLIBC_DIR"
  fi
fi

# 3. The wrapper.
mkdir -p "$(dirname "$WRAPPER")"
if [[ -n "$LOADER" ]]; then
  LIBS="$GLIBC_DIR/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"
  cat > "$WRAPPER" <<EOF
#!/bin/sh
# Made by scripts/setup_perf_analyzer.sh: perf_analyzer 2.60 needs glibc 2.38; run it through Debian 13's.
exec "$LOADER" --library-path "$LIBS" "$PA_BIN" "\$@"
EOF
else
  cat > "$WRAPPER" <<EOF
#!/bin/sh
# Made by scripts/setup_perf_analyzer.sh.
exec "$PA_BIN" "\$@"
EOF
fi
chmod +x "$WRAPPER"

OUT="$("$WRAPPER" --version 2>&1 || true)"
[[ "$OUT" == *"Perf Analyzer Version"* ]] || { log "perf_analyzer does not start:"; echo "$OUT" | tail -n 20 >&2; exit 1; }
log "ok: $WRAPPER ($OUT)"
