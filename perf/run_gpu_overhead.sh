#!/usr/bin/env bash
# Triton's serving overhead on the GPU machine (device tool), in calls that fit its 64 MiB per call on one warm machine
# (ignored files stay between calls while it is warm, 30 s):
#   prepare  carry .deps/ba (first half of the Python 3.12 tritonserver bundle: scripts/setup_tritonserver.sh
#            --stubs 3.12 --bundle FILE --bundle-stubs 3.12, then `split -n 2`) and .deps/gpu/smollm2 (SmolLM2's
#            config, tokenizer and drafter_config.json): the SmolLM2-shaped random target and drafter
#   server   carry .deps/bb (the second half) and .deps/tc (tritonclient + python-rapidjson wheels for 3.12): unpack
#            the server and the client; then run perf/stub_probe.py and perf/serve_overhead.py in the same command
# Record the commit: `DDTREE_COMMIT=<sha> bash perf/run_gpu_overhead.sh <stage>` (no .git there).
set -euo pipefail
stage="$1"
case "$stage" in
prepare)
  python3 scripts/make_shaped_model.py --like .deps/gpu/smollm2 --out models/smollm2-shaped --dtype bfloat16
  python3 - <<'PY'
import json
from ddtree.models.dflash import init_random_drafter, save_drafter
hf = json.load(open(".deps/gpu/smollm2/drafter_config.json"))
save_drafter("models/smollm2-shaped-dflash", hf, init_random_drafter(hf, seed=0))
PY
  ;;
server)
  if [ ! -d .deps/tritonserver ]; then
    mkdir -p .deps/bundle
    cat .deps/ba/part .deps/bb/part > .deps/bundle/tritonserver-py312.tar.xz
    tar -C .deps -xJf .deps/bundle/tritonserver-py312.tar.xz
  fi
  [ -d .deps/site/tritonclient ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target .deps/site .deps/tc/*.whl
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2 ;;
esac
