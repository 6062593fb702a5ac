#!/usr/bin/env bash
# Triton's serving overhead on the GPU machine (device tool), in calls that fit its 64 MiB per call on one warm machine
# (ignored files stay between calls while it is warm, 30 s):
#   pack     HERE, after `make setup`: make what the two calls carry (.deps/ba, .deps/bb, .deps/tc, .deps/gpu/smollm2)
#   prepare  carry .deps/ba (first half of the Python 3.12 tritonserver bundle: scripts/setup_tritonserver.sh
#            --stubs 3.12 --bundle FILE --bundle-stubs 3.12, then `split -n 2`) and .deps/gpu/smollm2 (SmolLM2's
#            config, tokenizer and drafter_config.json): the SmolLM2-shaped random target and drafter
#   server   carry .deps/bb (the second half) and .deps/tc (tritonclient + python-rapidjson wheels for 3.12): unpack
#            the server and the client; then run perf/stub_probe.py and perf/serve_overhead.py in the same command
# Record the commit: `DDTREE_COMMIT=<sha> bash perf/run_gpu_overhead.sh <stage>` (no .git there).
set -euo pipefail
stage="$1"
case "$stage" in
pack)
  PY=.venv/bin/python
  bash scripts/setup_tritonserver.sh --stubs "$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])'),3.12" \
    --bundle /tmp/tritonserver-py312.tar.xz --bundle-stubs 3.12
  rm -rf .deps/ba .deps/bb .deps/tc .deps/gpu/smollm2 && mkdir -p .deps/ba .deps/bb .deps/tc .deps/gpu/smollm2
  split -n 2 -d /tmp/tritonserver-py312.tar.xz /tmp/tritonserver-py312.part
  mv /tmp/tritonserver-py312.part00 .deps/ba/part && mv /tmp/tritonserver-py312.part01 .deps/bb/part
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .deps/tc \
    "tritonclient==$($PY -c 'import importlib.metadata as m; print(m.version("tritonclient"))')" \
    "python-rapidjson==$($PY -c 'import importlib.metadata as m; print(m.version("python-rapidjson"))')"
  cp models/smollm2-135m-instruct/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} \
    .deps/gpu/smollm2/
  cp models/smollm2-135m-instruct-dflash/config.json .deps/gpu/smollm2/drafter_config.json
  du -sh .deps/ba .deps/bb .deps/tc .deps/gpu/smollm2
  ;;
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
