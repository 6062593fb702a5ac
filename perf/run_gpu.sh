#!/usr/bin/env bash
# Run the issue-2 benchmark on the GPU machine (device tool), from what a call can carry:
#   carry: .deps/bundle (tritonserver for Python 3.12), .deps/gpu (perf_analyzer + SmolLM2 config/tokenizer)
# The SmolLM2-135M weights (98 MB as GGUF) cannot travel, so the target there has SmolLM2's exact
# shapes and tokenizer with random weights (scripts/make_shaped_model.py): every request decodes
# a fixed number of tokens, so tokens/s depends on the shapes alone.
# Record the commit: the device copy has no .git, so call it as `DDTREE_COMMIT=<sha> bash perf/run_gpu.sh`.
set -euo pipefail
OUT="${OUT:-perf/results}"
mkdir -p .deps "$OUT"
tar -C .deps -xJf .deps/bundle/tritonserver-py312.tar.xz
tar -C .deps -xJf .deps/gpu/perf_analyzer.tar.xz
mkdir -p .deps/bin
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PWD/.deps/perf_analyzer/perf_analyzer/bin/perf_analyzer" > .deps/bin/perf_analyzer
chmod +x .deps/bin/perf_analyzer
python3 scripts/make_shaped_model.py --like .deps/gpu/smollm2 --out models/smollm2-shaped --dtype bfloat16
python3 - <<'PY'
import json
from ddtree.models.dflash import init_random_drafter, save_drafter
hf = json.load(open(".deps/gpu/smollm2/drafter_config.json"))
save_drafter("models/smollm2-shaped-dflash", hf, init_random_drafter(hf, seed=0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 perf/bench.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \
  --drafter models/smollm2-shaped-dflash --max-tokens "${MAX_TOKENS:-128}" --num-prompts "${NUM_PROMPTS:-8}" \
  --out "$OUT" --name "${NAME:-bench_h200}" "$@"
