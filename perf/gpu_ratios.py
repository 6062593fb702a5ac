"""Issue 6's ratio table: how far one `ar` step and one DDTree round are from the physical floor, at batch 1.

For each target shape (random weights, real dimensions) with a random 5-layer DFlash drafter of the
published shape, in one run on one machine:
  - floor: bytes one decode step must stream (every weight but the embedding table) / the device
    copy bandwidth measured in the same run;
  - the target's `ar` step (forward only, read back per call) against that floor (goal: <= 1.10x), and the engine's
    whole `ar` round against it (what a served step costs: with ar_lookahead the next step is queued before the
    token's read, so no per-step read separates the steps);
  - whole engine rounds (draft + tree build + verify + commit, the engine's own stage counters) for
    ar, dflash, ddtree-16 and ddtree-64, against the `ar` round (goals: ddtree-16 <= 1.15x,
    ddtree-64 <= 1.30x), and each round's host share = (round - draft - verify) / round (goal <= 5%);
  - the verify-time curve against budget 16..1024 (what the budget policy's cost model needs).
Writes perf/results/<name>.{json,md} and <name>.png (verify time against budget).

    python perf/gpu_ratios.py --device cuda --dtype bfloat16 --shapes qwen36-27b,qwen3-8b --name gpu_ratios_h200
    python perf/gpu_ratios.py --shapes tiny-hybrid,tiny-dense --budgets 16,64 --name gpu_ratios_cpu_tiny   # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models import fused, qwen3_5  # noqa: E402
from ddtree.models.dense import DenseConfig, DenseTarget  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, header, write_cost_model, write_results  # noqa: E402
from perf.hybrid_verify import (  # noqa: E402
    DRAFTERS,
    _fill_random,
    copy_bandwidth,
    measure_batched_rounds,
    measure_rounds,
    measure_rounds_in_turns,
    measure_verify,
    random_drafter,
    random_target,
    weight_bytes,
)

DENSE_SHAPES = {
    # Qwen3-8B (36 layers); its z-lab drafter Qwen3-8B-DFlash-b16: 5 layers, block 16, taps [1, 9, 17, 25, 33]
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny-dense": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # the embedded default's (SmolLM2-135M-Instruct: Llama, no q/k norms, 30 layers; its shipped drafter: 5 layers,
    # block 16, taps [1, 8, 14, 20, 27]): rounds paced by kernel latency, not bytes (0.27 GB of weights). Its lm_head is
    # tied to the embeddings, a separate Linear here (the same product). The thirtieth session first built it as Qwen3 (q/k norms and
    # their kernel): gpu_ratios_h100_smollm2{,_treeattn}.md
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5,
                         rms_norm_eps=1e-5, eos_token_id=2),
}
DENSE_DRAFTERS = {
    "qwen3-8b": dict(num_layers=5, block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                     layer_types=None, sliding_window=None, heads=(32, 8, 128)),
    "tiny-dense": dict(num_layers=2, block_size=8, mask_token_id=1023, target_layer_ids=[0, 2], layer_types=None,
                       sliding_window=None, heads=(4, 2, 32)),
    "smollm2-135m": dict(num_layers=5, block_size=16, mask_token_id=16, target_layer_ids=[1, 8, 14, 20, 27],
                         layer_types=None, sliding_window=None, heads=(9, 3, 64)),
}
HYBRID_ALIASES = {"qwen36-27b": "qwen36-27b", "tiny-hybrid": "tiny"}
VARIANTS = ("static-masked", "static-flapaths", "static-uncompiled", "static-sdpa", "static-sdpatrees", "static-treeattn",
            "static-cublas", "static-treepaths", "static-normfirst", "static-noqkv", "static-convchain", "static-gemv1",
            "static-gemv128", "static-swap32", "static-gemv32", "static-gemv16", "static-hosttree", "static-pdl",
            "static-pdlwait", "static-pdlall", "static-pdlours", "static-norowsglu", "static-notreegates")
VARIANT_ENV = {   # the static forward's variants that differ from it by environment alone (read at capture)
    "static-sdpa": {"DDTREE_ATTENTION_KERNEL": "0"}, "static-sdpatrees": {"DDTREE_ATTENTION_KERNEL": "1"},
    "static-treeattn": {"DDTREE_ATTENTION_KERNEL": "128"},
    "static-cublas": {"DDTREE_GEMV_KERNEL": "0"}, "static-treepaths": {"DDTREE_TREE_CHUNKS": "0"},
    "static-normfirst": {"DDTREE_GEMV_NORM_FIRST": "1"}, "static-noqkv": {"DDTREE_QKV_KERNEL": "0"},
    "static-convchain": {"DDTREE_TREE_CONV_KERNEL": "0"}, "static-gemv1": {"DDTREE_GEMV_ROWS": "1"},
    "static-gemv128": {"DDTREE_GEMV_ROWS": "128"}, "static-swap32": {"DDTREE_GEMV_ROWS": "32"},
    "static-gemv32": {"DDTREE_GEMV_ROWS": "32", "DDTREE_GEMV_SWAP": "0"}, "static-gemv16": {"DDTREE_GEMV_ROWS": "16"},
    "static-treeops": {"DDTREE_TREE_BUILD_KERNEL": "0"}, "static-pdl": {"DDTREE_PDL": "1"},
    "static-pdlwait": {"DDTREE_PDL": "1", "DDTREE_PDL_PEEL": "0"},
    "static-pdlall": {"DDTREE_PDL": "1", "DDTREE_PDL_PEEL": "all"},
    "static-pdlours": {"DDTREE_PDL": "1", "DDTREE_PDL_CHAINS": "0"},
    "static-norowsglu": {"DDTREE_ROWS_GLU": "0"}, "static-notreegates": {"DDTREE_TREE_GATES": "0"},
    "static-chunkk16": {"DDTREE_CHUNK_SHAPES": "16:64:4:16,32:64:4:16,64:64:4:16"},
    "static-chunkk32": {"DDTREE_CHUNK_SHAPES": "16:64:4:32,32:64:4:32,64:64:4:32"},
    "static-noglugates": {"DDTREE_ROWS_GLU": "0", "DDTREE_TREE_GATES": "0"},
    "static-noviews": {"DDTREE_PROLOGUE_VIEWS": "0"}, "static-noreplay": {"DDTREE_REPLAY_KERNEL": "0"},
    "static-noviewsreplay": {"DDTREE_PROLOGUE_VIEWS": "0", "DDTREE_REPLAY_KERNEL": "0"},
    "static-attn132": {"DDTREE_ATTENTION_TREE_PROGRAMS": "132"},
    "static-noattnrows": {"DDTREE_ATTENTION_TREE_PROGRAMS": "0"},
    "static-draftqkv": {"DDTREE_DRAFT_QKV_KERNEL": "1"}, "static-nonormparts": {"DDTREE_NORM_PARTS": "0"},
    "static-drafttop": {"DDTREE_DRAFT_TOP_KERNEL": "1"}, "static-llamaqkv": {"DDTREE_QKV_KERNEL": "all"}}
# whole-round forms (--round-variants with --round-turns) that differ from the static forward by an engine setting
ROUND_SETTINGS = {"static-hosttree": {"device_tree": False}, "static-vocab32k": {"draft_vocab": 32768},
                  "static-arahead": {"ar_lookahead": True}, "static-noahead": {"ar_lookahead": False},
                  "static-draftahead": {"draft_ahead": True},
                  # an A/A control: a second engine of the default form (its rounds against the first's: the spread of
                  # two identical engines in the same turns; the 25th session's turns saw one form's commit host time
                  # twice another's whatever the switch: gpu_ratios_h100_draftqkv.json's commit_parts_ms)
                  "static-again": {}}
GOALS = {"ar_over_floor": 1.10, "ar_round_over_floor": 1.10, "ddtree-16_over_ar": 1.15, "ddtree-64_over_ar": 1.30, "host_share": 0.05,
         "gpu_idle_share": 0.05}   # host_share from the stage counters; gpu_idle_share from the kernels (CUDA)


def dense_target(shape: str, dtype: torch.dtype, device: str) -> DenseTarget:
    hf = {"model_type": "qwen3", "rope_theta": 1e6, "rms_norm_eps": 1e-6, "eos_token_id": 151645,
          "tie_word_embeddings": False, **DENSE_SHAPES[shape]}
    with torch.device("meta"):
        model = DenseTarget(DenseConfig.from_hf(hf)).to(dtype)
        model.fuse_projections()                                    # as from_pretrained serves them
    model = model.to_empty(device=device)
    _fill_random(model, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)    # plain RMSNorm: weights start at 1
    model.rotary = type(model.rotary)(model.config.head_dim, model.config.rope_theta)
    return model.eval()


def build(shape: str, dtype: torch.dtype, device: str):
    """(target, drafter) of random weights for a shape name."""
    if shape in HYBRID_ALIASES:
        name = HYBRID_ALIASES[shape]
        target = random_target(name, dtype, device)
        return target, random_drafter(DRAFTERS[name], target, dtype, device)
    target = dense_target(shape, dtype, device)
    return target, random_drafter(DENSE_DRAFTERS[shape], target, dtype, device)


def checkpoint(args, shape: str, verify: dict) -> None:
    """The verify measurements so far as <out>/<name>_<shape>_verify.json (a run cut off by a time limit keeps them;
    the whole result follows when the shape completes)."""
    table_ = {form: {"ar_step_ms": entry["ar_step_ms"], "ar_replay_ms": entry.get("ar_replay_ms"),
                     "budgets_ms": {b: e["verify_ms"] for b, e in entry["budgets"].items()},
                     "budgets_replay_ms": {b: e.get("replay_ms") for b, e in entry["budgets"].items()}}
              for form, entry in verify.items()}
    write_partial(args, shape, "verify", {"verify_ms": table_})


def checkpoint_turns(args, shape: str, runs: dict) -> None:
    """The whole rounds in turns so far (form -> method -> each finished turn's round ms) as
    <out>/<name>_<shape>_turns.json, for a run cut off by a time limit."""
    table_ = {form: {name: [entry["round_ms"] for entry in entries] for name, entries in methods.items()}
              for form, methods in runs.items()}
    write_partial(args, shape, "turns", {"turns_round_ms": table_})


def write_partial(args, shape: str, part: str, payload: dict) -> None:
    """A shape's measurements so far as <out>/<name>_<shape>_<part>.json, with the run's header."""
    path = Path(args.out) / f"{args.name}_{shape}_{part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header(), **payload}, indent=2) + "\n")


def diagnostic(errors: dict, name: str, env: dict[str, str], measure: Callable[..., dict], *args, **kwargs
               ) -> dict | None:
    """measure(*args, **kwargs) under env, for comparison: a failure is recorded as errors[name] (and printed) instead
    of ending the run, whose other measurements stand; None then."""
    try:
        with mock.patch.dict(os.environ, env):
            return measure(*args, **kwargs)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"{name} failed: {errors[name]}", flush=True)
        return None


def measure_shape(shape: str, args, bandwidth: float) -> dict:
    dtype = getattr(torch, args.dtype)
    target, drafter = build(shape, dtype, args.device)
    floor_bytes = weight_bytes(target)
    # a drafting round also streams the drafter's own weights and, for its logits, the target's lm_head again
    draft_bytes = weight_bytes(drafter) + target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    # the engine's static forward (CUDA graphs on CUDA) is what it serves batch 1 with; the dynamic forward is
    # measured beside it to show what the graphs buy
    forwards, errors, variants = args.forwards.split(","), {}, set(args.variants.split(","))
    if args.turns_only:   # the whole rounds in turns alone: no verify curve, no variants' verifies, no separate rounds
        forwards, variants = [], set()
    verify = {forward: measure_verify(target, args.device, args.budgets, args.prompt_len, args.repeats,
                                      static=forward == "static", profile=(16, 64))
              for forward in forwards}
    if "static-masked" in variants and hasattr(target, "uses_paths") and target.uses_paths(17, torch.device(args.device)):
        # small hybrid trees went through the paths form (fla): the ancestor-masked form beside it, for comparison
        with mock.patch.object(qwen3_5, "PATHS_MAX_ROWS", 0):
            verify["static-masked"] = measure_verify(target, args.device, args.budgets, args.prompt_len, args.repeats,
                                                     static=True, profile=(16, 64))
    if "static-flapaths" in variants and hasattr(target, "uses_paths") and target.uses_paths(17, torch.device(args.device)):
        # the paths form through fla's kernel per request (a state copy per path; at most FLA_PATHS_MAX_ROWS rows)
        # instead of ours (ddtree.models.tree_kernel, the default), for comparison
        result = diagnostic(errors, "static-flapaths", {"DDTREE_TREE_KERNEL": "0"}, measure_verify, target, args.device,
                            [b for b in args.budgets if b < qwen3_5.FLA_PATHS_MAX_ROWS], args.prompt_len, args.repeats,
                            static=True, profile=(16,))
        if result is not None:
            verify["static-flapaths"] = result
    if "static-uncompiled" in variants and args.device.startswith("cuda") and fused.enabled():
        # the same static forward with the elementwise chains uncompiled (ddtree.models.fused), for comparison
        with mock.patch.dict(os.environ, {"DDTREE_COMPILE": "0"}):
            verify["static-uncompiled"] = measure_verify(target, args.device, [b for b in args.budgets if b in (16, 64)],
                                                         args.prompt_len, args.repeats, static=True)
    if args.device.startswith("cuda"):
        # the same static forward with one default kernel swapped for the form before it (VARIANT_ENV; the table's
        # preamble says what each one is), for comparison; measured one after another, so a difference of a few tenths
        # of a millisecond can be drift: perf/graph_turns.py times them in turns
        for form, env in args.env_forms.items():
            if form not in variants:
                continue
            result = diagnostic(errors, form, env, measure_verify, target, args.device,
                                [b for b in args.budgets if b in (16, 64)], args.prompt_len, args.repeats, static=True,
                                profile=(16,))
            if result is not None:
                verify[form] = result
            checkpoint(args, shape, verify)
    checkpoint(args, shape, verify)
    round_budgets = [b for b in (16, 64) if b in args.budgets] or args.budgets[:1]
    rounds = {forward: measure_rounds(target, drafter, args.device, args.dtype, round_budgets, args.prompt_len,
                                      args.rounds, static_forward="on" if forward == "static" else "off")
              for forward in forwards}
    if "static-hosttree" in variants and "static" in forwards:
        # rounds with the draft's top-k read and the tree built on the host (two reads a round), for comparison
        rounds["static-hosttree"] = measure_rounds(target, drafter, args.device, args.dtype, round_budgets,
                                                   args.prompt_len, args.rounds, static_forward="on",
                                                   **ROUND_SETTINGS["static-hosttree"])
    round_forms = [f for f in args.round_variants.split(",") if f in args.env_forms or f in ROUND_SETTINGS]
    round_turns, failed = {}, {}
    if args.round_turns and ("static" in forwards or args.turns_only):
        # the static forward's rounds and its variants' in turns (pairs under the same machine state)
        round_turns = diagnostic(errors, "round turns", {}, measure_rounds_in_turns, target, drafter, args.device,
                                 args.dtype, round_budgets, args.prompt_len, args.rounds,
                                 {"static": {}, **{f: args.env_forms.get(f, {}) for f in round_forms}}, args.round_turns,
                                 ROUND_SETTINGS, lambda runs: checkpoint_turns(args, shape, runs), failed,
                                 args.freeze_heap) or {}
        errors.update({f"{form} rounds": error for form, error in failed.items()})
        round_forms = []
    for form in (f for f in round_forms if args.device.startswith("cuda") and f in args.env_forms):
        # whole rounds under a variant's environment, otherwise as the static forward's, for comparison with them
        result = diagnostic(errors, f"{form} rounds", args.env_forms[form], measure_rounds, target, drafter, args.device,
                            args.dtype, round_budgets, args.prompt_len, args.rounds, static_forward="on")
        if result is not None:
            rounds[form] = result
    batched = (measure_batched_rounds(target, drafter, args.device, args.dtype, args.batches, args.prompt_len,
                                      args.rounds) if args.batches else {})
    if batched and hasattr(target, "uses_paths") and qwen3_5.tree_gdn_kernel(torch.device(args.device)) is not None:
        # a hybrid's `ar` steps through fla's kernel on gathered states (scattered back after), as before our kernel ran
        # them in place in the pool (DDTREE_TREE_KERNEL=0; a fresh engine: programs are captured per engine)
        with mock.patch.dict(os.environ, {"DDTREE_TREE_KERNEL": "0"}):
            batched["ar (fla steps)"] = measure_batched_rounds(target, drafter, args.device, args.dtype, args.batches,
                                                               args.prompt_len, args.rounds, modes=(("ar", 1),))["ar"]
    floor_ms = floor_bytes / bandwidth * 1e3
    ar_step_ms = verify["static"]["ar_step_ms"] if "static" in verify else float("nan")   # NaN: --turns-only
    ratios = {"ar_over_floor": ar_step_ms / floor_ms,
              "dynamic_ar_over_floor": verify["dynamic"]["ar_step_ms"] / floor_ms if "dynamic" in verify else float("nan")}
    if "static-uncompiled" in verify:
        ratios["uncompiled_ar_over_floor"] = verify["static-uncompiled"]["ar_step_ms"] / floor_ms
    for forward, table_ in [*rounds.items(), *round_turns.items()]:
        for name, entry in table_.items():
            entry["host_share"] = max(0.0, entry["round_ms"] - entry["draft_ms"] - entry["verify_ms"]) / entry["round_ms"]
    static_rounds = rounds["static"] if "static" in rounds else round_turns.get("static", {})   # the turns': --turns-only
    if "ar" in static_rounds:
        ratios["ar_round_over_floor"] = static_rounds["ar"]["round_ms"] / floor_ms
    round_floor_ms = (floor_bytes + draft_bytes) / bandwidth * 1e3   # a drafting round's bytes
    for name, entry in static_rounds.items():
        if name != "ar":
            ratios[f"{name}_over_ar"] = entry["round_over_ar"]
            ratios[f"{name}_over_its_floor"] = entry["round_ms"] / round_floor_ms
    ratios["host_share"] = max((entry["host_share"] for entry in static_rounds.values()), default=float("nan"))
    idle = [entry["gpu_idle_share"] for entry in static_rounds.values() if "gpu_idle_share" in entry]
    if idle:   # measured from the device side: the share of a round the GPU waits for the host
        ratios["gpu_idle_share"] = max(idle)
    del target, drafter
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"weight_bytes": floor_bytes, "floor_ms": floor_ms, "ar_step_ms": ar_step_ms,
            "draft_bytes": draft_bytes, "round_floor_ms": round_floor_ms,
            "verify": verify, "rounds": rounds, "round_turns": round_turns, "batched": batched, "ratios": ratios,
            "errors": errors}


def stage(entry: dict, name: str) -> str:
    """A stage's host ms, with its GPU timeline in parentheses where measured (CUDA)."""
    gpu = entry.get(f"{name}_gpu_ms", 0.0)
    return f"{entry[f'{name}_ms']:.1f}" + (f" ({gpu:.1f})" if gpu else "")


def table(result: dict) -> str:
    lines = [f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s (bytes read + written, measured in this run)", "",
             "Static forward (CUDA graphs on CUDA; what the engine serves batch 1 with) unless marked dynamic; "
             "static-masked: small hybrid trees on the ancestor-masked GDN form instead of the paths form; "
             "static-flapaths: the paths form through fla's kernel per request instead of ours (DDTREE_TREE_KERNEL=0); "
             "static-uncompiled: the elementwise chains between matrix products not compiled (DDTREE_COMPILE=0); "
             "static-sdpa: every attention call through PyTorch's SDPA (DDTREE_ATTENTION_KERNEL=0; by default `ar` steps' "
             "go through our split-KV kernel, and trees' too (up to 128 query rows a request, prefills too) where heads are 256 "
             "wide or 16-64 wide); static-sdpatrees: only `ar` steps' through our kernel (DDTREE_ATTENTION_KERNEL=1); "
             "static-treeattn: trees' through it too whatever the head dim (DDTREE_ATTENTION_KERNEL=128: the default "
             "itself at 256- and 16-64-wide heads); static-cublas: every Linear through cuBLAS, the chains before them "
             "separate, instead of our GEMV (one row, the chains in its prologue) and few-rows kernel (up to 17 rows, "
             "the residual add in its epilogue) (DDTREE_GEMV_KERNEL=0); static-gemv1: only one-row Linears through ours "
             "(DDTREE_GEMV_ROWS=1); static-gemv128: up to 128 rows (DDTREE_GEMV_ROWS=128); static-swap32: up to 32 "
             "rows (DDTREE_GEMV_ROWS=32; by default 17, a budget-16 tree's, through the few-rows kernel's swapped form, "
             "the weight's columns the tile's long side); static-gemv32: the same in its rows-first form "
             "(DDTREE_GEMV_SWAP=0); static-gemv16: up to 16 (DDTREE_GEMV_ROWS=16: a budget-16 tree's 17 through cuBLAS); "
             "static-treeops (whole rounds: --round-variants): the device tree's program as build_tree_device's "
             "tensor operations (DDTREE_TREE_BUILD_KERNEL=0) instead of two Triton launches; "
             "static-pdl: our Triton kernels and the compiled chains launched with Programmatic Dependent Launch "
             "(DDTREE_PDL=1, Hopper: each kernel's launch and, in the GEMV and the rows-first few-rows kernel, its "
             "first weight tile overlapping the previous kernel's tail) instead of one after another; "
             "static-pdlwait: the same with every kernel waiting before its first weight tile (DDTREE_PDL_PEEL=0); "
             "static-pdlall: the swapped few-rows kernel peeling its first tile too (DDTREE_PDL_PEEL=all, the form "
             "measured as static-pdl at ad578d8); static-pdlours: PDL for our kernels only, the compiled chains "
             "launched as before (DDTREE_PDL_CHAINS=0); static-norowsglu: a few rows' silu(gate) * up "
             "as the chain's own kernel after each MLP's gate/up product (DDTREE_ROWS_GLU=0) instead of in its "
             "epilogue; static-notreegates: a tree batch's GDN gates in a compiled kernel of their own "
             "(DDTREE_TREE_GATES=0) instead of computed by the conv's kernel (both on by default since 27d901e; "
             "static-rowsglu, static-treegates, static-glugates in earlier results: the same switches turned on); "
             "static-chunkk16, static-chunkk32: "
             "the tree chunk kernel's passes over the key dim 16 or 32 columns a step (DDTREE_CHUNK_SHAPES' fourth "
             "field; 32 the form before 0fd61e1's measurement as static-chunkk64) instead of 64; static-noglugates: "
             "both of those off, the default before 27d901e; static-noviews: the gated norm's and the sigmoid gate's "
             "chains before the few-rows kernel reading their strided gates after a copy (DDTREE_PROLOGUE_VIEWS=0) "
             "instead of as views; static-noreplay: a paths-form commit's recurrence through fla's kernel into new "
             "states copied back (DDTREE_REPLAY_KERNEL=0) instead of our replay kernel writing them where they lie; "
             "static-noviewsreplay: both, the default before the 23rd session (static-views, static-replay in "
             "earlier results: the switches turned on); static-attn132: our attention kernel's calls of several rows "
             "(trees, draft blocks) splitting their keys for ~132 programs whatever their rows "
             "(DDTREE_ATTENTION_TREE_PROGRAMS=132) instead of 132 up to 32 rows and 66 above; static-noattnrows: for "
             "264 like one-row calls (=0; the default before the 24th session; static-attnrows in earlier results: "
             "132,66 turned on); static-draftqkv: the drafter's q/k "
             "norms, rotary and block K/V writes in our one kernel (DDTREE_DRAFT_QKV_KERNEL=1) instead of two compiled "
             "chains and two index writes a layer; static-nonormparts: a hybrid's norms of the stream each a kernel "
             "of its own (DDTREE_NORM_PARTS=0; the default before the 25th session; static-normparts in earlier "
             "results: the switch turned on) instead of taken in the epilogues of the products around them (all but "
             "the first and the final one); static-drafttop (whole rounds): the draft's log-probabilities' top k in the tree "
             "program in two launches of ours (DDTREE_DRAFT_TOP_KERNEL=1) instead of log_softmax then torch.topk; "
             "static-llamaqkv: heads without q/k norms (a Llama's: smollm2-135m) rotated and their K/V written in our "
             "one kernel too (DDTREE_QKV_KERNEL=all) instead of a compiled rotary chain per tensor and two index writes; "
             "static-treepaths: the trees' GDN through our kernel's root-to-leaf path walks instead of the chunk form "
             "(DDTREE_TREE_CHUNKS=0); "
             "static-normfirst: the GEMV's norm prologues with the row's statistic in a pass before the product "
             "(DDTREE_GEMV_NORM_FIRST=1) instead of gathered in its loop and applied to its sum; static-noqkv: the "
             "attention layers' q/k norms, rotary and K/V writes as compiled chains and index writes "
             "(DDTREE_QKV_KERNEL=0) instead of our one kernel; static-convchain: a tree batch's GDN conv as the compiled "
             "chain (DDTREE_TREE_CONV_KERNEL=0) instead of our kernel; static-hosttree (whole rounds only): the draft's "
             "top-k read and the tree built on the host, two reads a round (device_tree off), instead of the tree and the "
             "verify's inputs built on the device and one read; static-vocab32k (whole rounds in turns only): the drafter "
             "proposing only the first 32,768 ids and the EOS ids (draft_vocab), its logits from those rows of the "
             "lm_head; static-arahead (whole rounds in turns only): a lone greedy `ar` request's next step queued "
             "before its token is read (ar_lookahead=True; on CUDA the default); static-noahead: without it "
             "(ar_lookahead=False); static-draftahead (whole rounds in turns only): a lone request's next draft launched as soon "
             "as its round's acceptance is known, before that round's commit (draft_ahead=True)."
             + "".join(f" {name} (this run's own, --variant-env): {env}." for name, env in result.get("variant_env", {}).items()),
             "",
             "| shape | weights GB | floor ms | ar step ms | ar / floor | ar round / floor | uncompiled ar / floor | "
             "dynamic ar / floor | ddtree-16 / ar | ddtree-64 / ar | max host share (stages) | max GPU idle share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, r in result["shapes"].items():
        q = r["ratios"]
        lines.append(f"| {shape} | {r['weight_bytes'] / 1e9:.2f} | {r['floor_ms']:.2f} | {r['ar_step_ms']:.2f} | "
                     f"{q['ar_over_floor']:.2f} | {q.get('ar_round_over_floor', float('nan')):.2f} | "
                     f"{q.get('uncompiled_ar_over_floor', float('nan')):.2f} | "
                     f"{q['dynamic_ar_over_floor']:.2f} | "
                     f"{q.get('ddtree-16_over_ar', float('nan')):.2f} | "
                     f"{q.get('ddtree-64_over_ar', float('nan')):.2f} | {q['host_share']:.0%} | "
                     f"{q.get('gpu_idle_share', float('nan')):.0%} |")
    for shape, r in result["shapes"].items():
        if "round_floor_ms" not in r:
            continue
        q = r["ratios"]
        lines += ["", f"{shape}: a drafting round streams the target's {r['weight_bytes'] / 1e9:.2f} GB and the drafter's "
                  f"{r['draft_bytes'] / 1e9:.2f} GB (its own weights and the lm_head again for its logits): floor "
                  f"{r['round_floor_ms']:.2f} ms, {r['round_floor_ms'] / r['floor_ms']:.3f}x the `ar` floor; each "
                  "drafting round / that floor: " + ", ".join(
                      f"{k[: -len('_over_its_floor')]} {v:.2f}" for k, v in q.items() if k.endswith("_over_its_floor"))]
    lines += ["", "Goals (issue 6): " + ", ".join(f"{k} <= {v:g}" for k, v in GOALS.items()) + "; met: "
              + "; ".join(f"{shape} {sorted(k for k, v in r['ratios'].items() if k in GOALS and v <= GOALS[k])}"
                          for shape, r in result["shapes"].items()), ""]
    for shape, r in result["shapes"].items():
        if r["rounds"]:   # none with --turns-only
            lines += [f"{shape}: whole engine rounds (ms)", "",
                      "| forward | method | round | / ar | draft | tree build | verify | commit | host share | device ms | "
                      "GPU idle |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for forward, rounds in r["rounds"].items():
                for name, e in rounds.items():
                    lines.append(f"| {forward} | {name} | {e['round_ms']:.1f} | {e['round_over_ar']:.2f} | {stage(e, 'draft')} | "
                                 f"{e['tree_build_ms']:.1f} | {stage(e, 'verify')} | {stage(e, 'commit')} | {e['host_share']:.0%} | "
                                 f"{e.get('device_ms', float('nan')):.1f} | {e.get('gpu_idle_share', float('nan')):.0%} |")
            lines += ["", "(draft, verify, commit: host time (the stage's GPU timeline, CUDA events at its bounds); "
                      "static commits: " + ", ".join(f"{name} {e['static_commit_share']:.0%}" for forward, rounds in r["rounds"].items()
                                                     for name, e in rounds.items() if "static_commit_share" in e and forward == "static")
                      + " of rounds (graphs.StaticCommit; the others commit eagerly); trees built on the device (one read a round): "
                      + ", ".join(f"{forward} {name} {e['device_tree_share']:.0%}" for forward, rounds in r["rounds"].items()
                                  for name, e in rounds.items() if e.get("device_tree_share") and name != "ar")
                      + "; programs whose CUDA graph capture "
                      "failed (they run eagerly): " + (", ".join(sorted({k for rounds in r["rounds"].values() for e in rounds.values()
                                                                      for k in e.get("eager_programs", [])})) or "none")]
        if r.get("round_turns"):
            turns = len(next(iter(next(iter(r["round_turns"].values())).values()))["turns_ms"])
            lines += ["", f"{shape}: whole rounds in turns ({turns} turns, every form's engine built first; medians over "
                      "turns, ms; / ar: the median of each turn's ratio to the form's own `ar`; against static: the "
                      "form's round over the static forward's in the same turn, median [min, max])", "",
                      "| form | method | round | / ar | draft | verify | commit | against static |",
                      "|---|---|---|---|---|---|---|---|"]
            for form, methods in r["round_turns"].items():
                for name, e in methods.items():
                    paired = e.get("over_first")
                    lines.append(f"| {form} | {name} | {e['round_ms']:.2f} | {e['round_over_ar']:.3f} | {stage(e, 'draft')} | "
                                 f"{stage(e, 'verify')} | {stage(e, 'commit')} | "
                                 + (f"{paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}] |" if paired else "- |"))
            # by part: in the 24th and 25th sessions' H100 turns these differed up to 2x between forms of one run,
            # every part alike, whatever the switch (perf/RESULTS.md)
            lines += ["", "the turns' commit stage host time by part, ms per round, median over turns (acceptance walks / "
                      "cache commits / kept features / token bookkeeping): " + "; ".join(
                          f"{form} {name} " + " / ".join(f"{v:.3f}" for v in e["commit_parts_ms"].values())
                          for form, methods in r["round_turns"].items() for name, e in methods.items()
                          if name != "ar" and "commit_parts_ms" in e)]
            # the static programs' runs (the inputs' copy and the graph's launch) by kind: whether the launches are
            # what differs between engines
            lines += ["", "the turns' static program runs' host time by kind (inputs copied, graph launched), ms per round, "
                      "median over turns: " + "; ".join(
                          f"{form} {name} " + ", ".join(f"{k} {v:.3f}" for k, v in e["program_host_ms"].items())
                          for form, methods in r["round_turns"].items() for name, e in methods.items()
                          if e.get("program_host_ms"))]
        if r["rounds"]:
            lines += ["", "commit stage's host time by part, ms per round (acceptance walks / cache commits / kept features / "
                      "token bookkeeping): " + "; ".join(
                          f"{forward} {name} " + " / ".join(f"{v:.2f}" for v in e["commit_parts_ms"].values())
                          for forward, rounds in r["rounds"].items() for name, e in rounds.items() if "commit_parts_ms" in e)]
        for forward, rounds in r["rounds"].items():
            for name, e in rounds.items():
                if e.get("round_kernels"):
                    lines += ["", f"{shape}, {forward} {name}: a whole round's kernels (a request's less its prefill's, "
                              "per round): the drafter's layers run 5 times a round, the target's 64 (27B)", "",
                              "| kernel | per round | ms per round |", "|---|---|---|"]
                    lines += [f"| `{k}` | {n} | {ms:.3f} |" for k, n, ms in e["round_kernels"]]
                if e.get("round_gaps"):
                    lines += ["", f"{shape}, {forward} {name}: where the GPU waits in a round (idle gaps over 3 us between "
                              "one activity's end and the next one's start, a request's less its prefill's, per round; "
                              "by the kernel or copy before the gap and the one after it; the profiler's own host cost is "
                              "in them)", "", "| before | after | gaps per round | ms per round |", "|---|---|---|---|"]
                    lines += [f"| `{b}` | `{a}` | {n} | {ms:.3f} |" for b, a, n, ms in e["round_gaps"]]
                if e.get("programs"):
                    lines += ["", f"{shape}, {forward} {name}: the static programs of a round, each replayed alone (span: "
                              "its first kernel's start to its last one's end; span less device time is idle inside "
                              "the graph)", "", "| program | calls per round | kernels | device ms | span ms | idle |",
                              "|---|---|---|---|---|---|"]
                    lines += [f"| {' '.join(p['key'])} | {p['calls_per_round']:.2f} | {p.get('kernels', '-')} | "
                              f"{p.get('device_ms', float('nan')):.3f} | {p.get('span_ms', float('nan')):.3f} | "
                              f"{1 - p.get('device_ms', float('nan')) / p.get('span_ms', float('nan')):.0%} |"
                              for p in e["programs"]]
                tail = e.get("draft_tail")
                if tail and "error" not in tail:
                    lines += ["", f"{shape}, {forward} {name}: the draft stage's eager tail (lm_head over 15 depths, "
                              f"top-k or argmax, read to the host): {tail['kernels']} kernels, {tail['device_ms']:.3f} ms "
                              f"of device time in a span of {tail.get('span_ms', float('nan')):.3f} ms", "",
                              "| kernel | per call | ms per call |", "|---|---|---|"]
                    lines += [f"| `{k}` | {n} | {ms:.3f} |" for k, n, ms in tail["top"]]
        if r.get("batched"):
            sizes = list(next(iter(r["batched"].values())))
            lines += ["", f"{shape}: R concurrent requests, whole rounds (static forwards): ms per round / tokens per s",
                      "", "| method | " + " | ".join(f"R={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
            for name, per in r["batched"].items():
                lines.append(f"| {name} | " + " | ".join(f"{e['round_ms']:.1f} / {e['tokens_per_s']:.0f}" for e in per.values())
                             + " |")
        budgets = list(r["verify"]["static"]["budgets"]) if "static" in r["verify"] else []
        if r["verify"]:   # none with --turns-only
            lines += ["", f"{shape}: target verify alone (ms)", "",
                      "| forward | ar step | " + " | ".join(f"budget {b}" for b in budgets) + " |",
                      "|---|---|" + "---|" * len(budgets)]
            for forward, v in r["verify"].items():
                cells = " | ".join(f"{v['budgets'][b]['verify_ms']:.2f}" if b in v["budgets"] else "-" for b in budgets)
                lines.append(f"| {forward} | {v['ar_step_ms']:.2f} | {cells} |")
            lines += ["", f"{shape}: the same forwards' captured graphs replayed alone (ms; no host work: the GPU's own time "
                      "per forward, idle gaps between kernels included)", "",
                      "| forward | ar step | " + " | ".join(f"budget {b}" for b in budgets) + " |",
                      "|---|---|" + "---|" * len(budgets)]
            for forward, v in r["verify"].items():
                cells = " | ".join(f"{v['budgets'][b].get('replay_ms', float('nan')):.2f}" if b in v["budgets"] else "-"
                                   for b in budgets)
                lines.append(f"| {forward} | {v.get('ar_replay_ms', float('nan')):.2f} | {cells} |")
        lines.append("")
        for forward, v in r["verify"].items():
            for name, p in v.get("profile", {}).items():
                if "error" in p:
                    lines += [f"{shape}, {forward} {name}: no kernel profile ({p['error']})", ""]
                    continue
                lines += [f"{shape}, {forward} {name}: {p['kernels']} kernels, {p['device_ms']:.2f} ms of device time "
                          f"in a GPU span of {p.get('span_ms', float('nan')):.2f} ms (first kernel's start to the last "
                          f"one's end; floor {r['floor_ms']:.2f} ms)", "", "| kernel | per call | ms per call |",
                          "|---|---|---|"]
                lines += [f"| `{k}` | {n} | {ms:.3f} |" for k, n, ms in p["top"]] + [""]
        if r.get("errors"):
            lines += [f"{shape}: variants that failed: " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items()), ""]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for shape, r in result["shapes"].items():
        for forward, v in r["verify"].items():
            budgets = [int(b) for b in v["budgets"]]
            ax.plot(budgets, [e["verify_over_ar"] for e in v["budgets"].values()], marker="o",
                    linestyle="-" if forward == "static" else "--", label=f"{shape} {forward}")
    ax.axhline(1.0, color="gray", linestyle=":", label="ar step")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tree budget", ylabel="verify time / ar step", title=f"verify cost, {result['device']} {result['dtype']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def shape_cost_model(path: Path, shape: dict, context: int) -> None:
    """ddtree.budget.CostModel data from one shape's static verify curve (rows = budget + 1; the ar step is 1 row)
    and its dflash round's draft time: `cost_model_path` of a deployment of that target points here."""
    verify = shape["verify"]["static"]
    rows = [1] + [e["num_nodes"] for e in verify["budgets"].values()]
    times = [verify["ar_step_ms"]] + [e["verify_ms"] for e in verify["budgets"].values()]
    # the draft stage's GPU time where it is longer than its host time: a round that reads once (the tree built on the
    # device) only queues its draft, and waits for it in the verify stage
    dflash = shape["rounds"]["static"]["dflash"]
    write_cost_model(path, rows, times, max(dflash["draft_ms"], dflash.get("draft_gpu_ms", 0.0)), context=context)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen36-27b,qwen3-8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--forwards", default="dynamic,static", help="static alone skips the dynamic forward (slow)")
    parser.add_argument("--batches", default="1,2,4,8", help="concurrent requests of the batched-round table ('' skips it)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="the static forward's comparison forms to measure beside it (comma-separated)")
    parser.add_argument("--round-turns", type=int, default=0,
                        help="measure the static forward's whole rounds and --round-variants' in this many turns")
    parser.add_argument("--round-variants", default="",
                        help="environment variants (of --variants' list) whose whole rounds to measure too; with "
                             "--round-turns also ROUND_SETTINGS' forms (static-hosttree, static-vocab32k, static-arahead, static-noahead, "
                             "static-draftahead, static-again: the default form's engine a second time, an A/A control)")
    parser.add_argument("--turns-only", action="store_true",
                        help="only the whole rounds in turns (--round-turns): no verify curve, no variants' verifies, no "
                             "separate rounds, no batches; an A/B of --round-variants in a shorter run (the ratios from the "
                             "static forward's turns; ar / floor then NaN)")
    parser.add_argument("--variant-env", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                        help="an environment variant of this run's own, usable in --variants and --round-variants (e.g. "
                             "static-tuned17:DDTREE_GEMV_TUNED=/tmp/out/gemv_rows.json:17, a search's configurations "
                             "from perf/gemv_bench.py); repeatable, recorded in the results")
    add_freeze_heap_arg(parser)   # the round turns' (from the 25th session; before, every collection walked every engine)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="gpu_ratios")
    args = parser.parse_args(argv)
    own = {}   # --variant-env's forms, beside VARIANT_ENV's (args.env_forms: every environment form of the run)
    for spec in args.variant_env:
        name, _, pairs = spec.partition(":")
        items = [pair.split("=", 1) for pair in pairs.split(",")]
        if not name.startswith("static-") or any(len(item) != 2 or not item[0] for item in items):
            parser.error(f"--variant-env {spec!r}: expected static-<name>:KEY=VALUE[,KEY=VALUE...]")
        if name in VARIANT_ENV or name in ROUND_SETTINGS or name in own:
            parser.error(f"--variant-env {spec!r}: {name} is already a form of the run")
        own[name] = dict(items)
    args.env_forms = {**VARIANT_ENV, **own}
    if args.turns_only:
        if not args.round_turns:
            parser.error("--turns-only needs --round-turns")
        args.batches = ""
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    bandwidth = copy_bandwidth(args.device)   # NaN without a GPU: the floor and ar / floor are then NaN
    result = {"header": header(), "device": args.device, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "copy_bytes_per_s": bandwidth, "goals": GOALS, "freeze_heap": args.freeze_heap,
              "variant_env": own,
              "shapes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        result["shapes"][shape] = measure_shape(shape, args, bandwidth)
        write_results(out, args.name, result, table(result))   # each shape as it lands: a cut-off run keeps the others
    for shape, r in result["shapes"].items():   # the verify curve as the budget policy's cost model for the shape
        if "static" not in r["verify"] or "static" not in r["rounds"]:
            continue   # --turns-only
        shape_cost_model(out / f"cost_model_{args.name}_{shape}.json", r, args.prompt_len)
    result["plot"] = plot(result, out / f"{args.name}.png")
    write_results(out, args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
