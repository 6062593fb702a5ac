#!/usr/bin/env bash
# Build a python launcher linked against the shared libpython of $PYTHON (default python3): the interpreter Triton's
# Python-backend stub embeds, for perf/serve_overhead.py --shared-python. Needs gcc; no Python headers.
#   bash scripts/build_shared_python.sh [OUT]        (default .deps/pyshared)
set -euo pipefail
out="${1:-.deps/pyshared}"
py="${PYTHON:-python3}"
libdir=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
soname=$("$py" -c "import sysconfig, sys; print(sysconfig.get_config_var('INSTSONAME') or 'libpython%d.%d.so.1.0' % sys.version_info[:2])")
[ -f "$libdir/$soname" ] || { echo "no shared libpython at $libdir/$soname" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
src=$(mktemp --suffix .c)
printf 'int Py_BytesMain(int, char **);\nint main(int argc, char **argv) { return Py_BytesMain(argc, argv); }\n' > "$src"
gcc -O2 -o "$out" "$src" -L"$libdir" "-l:$soname" "-Wl,-rpath,$libdir"
rm -f "$src"
echo "built $out -> $libdir/$soname"
