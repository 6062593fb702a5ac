#!/usr/bin/env bash
# Our Triton kernels on the GPU machine (device tool), one step per call; carry .deps/xa (the fla wheels:
# `pip download --no-deps -d .deps/xa flash-linear-attention==0.6.0 fla-core==0.6.0`). $OUT on the device.
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh tests    # the kernels' GPU tests (TIMEOUT, default 500 s)
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh ratios   # SHAPES (27B) ratios, VARIANTS beside the default (ROUND_VARIANTS: their whole rounds too; ROUND_TURNS=N: in N turns with the default's)
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh bench    # the tree recurrence's forms at BUDGETS
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh turns    # SHAPE's VARIANTS beside the default in turns (graph_turns)
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh gemv     # the 27B Linears at ROWS input rows: cuBLAS vs ours (FORMS: rows, swap)
#   DDTREE_COMMIT=<sha> OUT=$OUT bash perf/run_gpu_kernels.sh smollm2  # the embedded default's dims in one call (~7 min
#                                                                      # fresh): the llama forms' GPU tests, then whole
#                                                                      # rounds in 3 turns: VARIANTS (default below) beside
#                                                                      # the default and an A/A control
# tests takes TESTS (pytest paths) instead of the kernels' whole list; its log is pytest's whole output (a failure's
# detail is written as it happens: tests/gpu/conftest.py), so a run cut off by TIMEOUT keeps it.
# Results are named with TAG (default h200). The device tool brings back at most 8 files from $OUT: a call that runs
# several steps should write logs into as few files as it can (ratios alone writes 5). gpu_ratios writes its verifies
# as they land, so a call cut off by its time limit keeps them (<name>_qwen36-27b_verify.json).
set -euo pipefail
OUT="${OUT:-perf/results}"
TAG="${TAG:-h200}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .deps/site .deps/xa/*.whl
export PYTHONPATH="$PWD/.deps/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-ratios}" in
  tests)
    # shellcheck disable=SC2086
    timeout "${TIMEOUT:-500}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu/test_tree_kernel.py tests/gpu/test_tree_build_kernel.py \
      tests/gpu/test_attention_kernel.py tests/gpu/test_gemv_kernel.py tests/gpu/test_cuda_graphs.py::test_hybrid_target_graphs_equal_dynamic \
      tests/gpu/test_cuda_graphs.py::test_dense_target_graphs_equal_dynamic \
      tests/gpu/test_cuda_graphs.py::test_ar_lookahead_with_graphs_decodes_what_it_decodes_without \
      tests/gpu/test_cuda_graphs.py::test_static_prefill_with_graphs_decodes_what_the_eager_prefill_decodes} > "$OUT/gpu_tests_$TAG.log" 2>&1 || true
    tail -40 "$OUT/gpu_tests_$TAG.log" ;;
  ratios)
    python3 perf/gpu_ratios.py --device cuda --dtype bfloat16 --forwards static --shapes "${SHAPES:-qwen36-27b}" --budgets 16,64 \
      --batches "" --rounds "${ROUNDS:-12}" --variants "${VARIANTS:-static-noqkv,static-sdpatrees}" \
      --round-variants "${ROUND_VARIANTS:-}" --round-turns "${ROUND_TURNS:-0}" --out "$OUT" --name "gpu_ratios_$TAG" ;;
  bench)
    python3 perf/tree_kernel_bench.py --budgets "${BUDGETS:-64}" --requests 1,8 --peaks peaked=8 --configs 16x1x2 \
      --repeats 10 --out "$OUT" --name "tree_chunks_$TAG" ;;
  turns)
    python3 perf/graph_turns.py --device cuda --dtype bfloat16 --shape "${SHAPE:-qwen36-27b}" \
      --variants "${VARIANTS:-static-noqkv,static-sdpatrees}" --turns "${TURNS:-15}" --out "$OUT" --name "graph_turns_$TAG" ;;
  gemv)
    python3 perf/gemv_bench.py --rows "${ROWS:-16,17,65}" --forms "${FORMS:-rows}" --out "$OUT" --name "gemv_rows_$TAG" ;;
  smollm2)
    # the 31st session's open questions at SmolLM2-135M's dims (perf/RESULTS.md): a Llama's rotary and K/V writes in
    # our kernel (static-llamaqkv), the attention's key split for 264 programs as before f025db1 (static-attn264),
    # the trees through SDPA (static-sdpatrees: why the trained pair's draft stage grew with them through ours), and
    # the tree built on the host as fit_cost_model builds it (static-hosttree)
    timeout "${TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_kernel.py \
      -k "prepare_qkv or llama" > "$OUT/gpu_tests_$TAG.log" 2>&1 || true
    tail -3 "$OUT/gpu_tests_$TAG.log"
    variants="${VARIANTS:-static-llamaqkv,static-attn264,static-sdpatrees,static-hosttree,static-again}"
    python3 perf/gpu_ratios.py --device cuda --dtype bfloat16 --forwards static --shapes smollm2-135m --budgets 16,64 \
      --batches "" --rounds "${ROUNDS:-12}" --variant-env static-attn264:DDTREE_ATTENTION_TREE_PROGRAMS=0 \
      --variants "$variants" --round-variants "$variants" --round-turns "${ROUND_TURNS:-3}" --turns-only --out "$OUT" \
      --name "gpu_ratios_${TAG}_smollm2" > "$OUT/gpu_ratios_${TAG}_smollm2.log" 2>&1 || true
    grep -A24 "whole rounds in turns" "$OUT/gpu_ratios_${TAG}_smollm2.log" || tail -20 "$OUT/gpu_ratios_${TAG}_smollm2.log" ;;
  *)
    echo "usage: $0 tests|ratios|bench|turns|gemv|smollm2" >&2
    exit 2 ;;
esac
