"""Hybrid verify cost: a Qwen3.6-27B-shaped target (random weights, real dimensions) and a 5-layer drafter.

Measures one `ar` step, verify time and peak memory of one tree verify at each budget, whole engine
rounds (draft + tree build + verify + commit) with a Qwen3.6-27B-DFlash-shaped drafter (5 layers,
sliding windows [S,S,S,S,F], taps [1,16,31,46,61]) for ar / dflash / ddtree, the weight-streaming
floor of one step (weight bytes / device copy bandwidth measured in the same run), and the
bf16-vs-fp32 gap of the tree Gated DeltaNet outputs against a float64 reference.
Writes perf/results/<name>.{json,md}.

    python perf/hybrid_verify.py --device cuda --dtype bfloat16            # H200
    python perf/hybrid_verify.py --shape tiny --budgets 16,64 --name hybrid_verify_cpu_tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import COMMIT_PARTS, Engine  # noqa: E402
from ddtree.models.dflash import DFlashConfig, DFlashDrafter, dflash_hf_config  # noqa: E402
from ddtree.models.gdn import gdn_sequential, gdn_tree  # noqa: E402
from ddtree.models.graphs import MIN_KEYS, GraphPool, StaticTarget  # noqa: E402
from ddtree.models.kernels import chain_gdn_kernel  # noqa: E402
from ddtree.models.qwen3_5 import HybridConfig, HybridTarget  # noqa: E402
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tree import build_tree, compile_tree, top_ids, top_log_probs  # noqa: E402
from ddtree.tree.compile import VerifyBatch  # noqa: E402
from perf.common import ROOT, frozen_heap, header, write_results  # noqa: E402

SHAPES = {
    # Qwen3.6-27B text decoder (hybrid_gdn.md §1.2): 64 layers = 16 x (3 GDN + 1 gated attention)
    "qwen36-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                       num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                 linear_key_head_dim=16, linear_value_head_dim=16),
}

# The rounds' engines' context limit: the key bucket (graphs.key_bucket: a power of two, at least MIN_KEYS) of the
# longest context the rounds reach with the largest tree, so that no bucket is clipped at the cache's end, as on a
# server whose max_model_len is long. Until the 23rd session the engines were made with max_model_len = prompt_len
# + rounds + 4 (528 at the default 512): every draft's key bucket was clipped to the cache's 593 rows, which leave no
# room for the block's 16 K/V rows after the context, so the drafter's attention took its fallback (contexts gathered
# and concatenated, then SDPA: the `cudnn ... sdpa` and `CatArrayBatchedCopy` kernels of a draft program in
# gpu_ratios_h100_pdl2.json) instead of the split-KV kernel that reads them in place; the target's attention ran over
# 593 keys instead of its bucket's 1024.
def engine_max_len(prompt_len: int, rounds: int, max_rows: int = 65) -> int:
    """max_model_len of the rounds' engines (above): 1024 at the default 512-token prompt and 12 rounds."""
    return max(MIN_KEYS, 1 << (prompt_len + rounds + 4 + max_rows - 1).bit_length())


DRAFTERS = {
    # z-lab/Qwen3.6-27B-DFlash (ddtree_dflash.md): 5 layers, 32 q / 8 kv heads of 128, SWA [S,S,S,S,F] window 2048
    "qwen36-27b": dict(num_layers=5, block_size=16, mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61],
                       layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                       heads=(32, 8, 128)),
    "tiny": dict(num_layers=2, block_size=8, mask_token_id=1023, target_layer_ids=[0, 2],
                 layer_types=["sliding_attention", "full_attention"], sliding_window=64, heads=(4, 2, 32)),
}


def _fill_random(model: torch.nn.Module, device: str) -> None:
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log")):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


def random_drafter(spec: dict, target: torch.nn.Module, dtype: torch.dtype, device: str) -> DFlashDrafter:
    """A random drafter for `target` from a DRAFTERS-style spec (layers, block, mask id, taps, windows, heads)."""
    spec = dict(spec)
    heads, kv_heads, head_dim = spec.pop("heads")
    c = target.config
    hf = dflash_hf_config({"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": heads,
                           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rope_theta": 1e7,
                           "vocab_size": c.vocab_size}, **spec)
    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig.from_hf(hf)).to(dtype)
    drafter = drafter.to_empty(device=device)
    _fill_random(drafter, device)
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)        # plain RMSNorm in the drafter (weights start at 1)
    drafter.fuse_projections()       # as from_pretrained serves it
    drafter.rotary = type(drafter.rotary)(drafter.config.head_dim, drafter.config.rope_theta)
    return drafter.eval()


def random_target(shape: str, dtype: torch.dtype, device: str) -> HybridTarget:
    hf = {"model_type": "qwen3_5_text", "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
          "eos_token_id": 248046, **SHAPES[shape]}
    with torch.device("meta"):
        model = HybridTarget(HybridConfig.from_hf(hf)).to(dtype)   # 27B in fp32 would not fit beside bf16
        model.fuse_projections()                                    # as from_pretrained serves them
    model = model.to_empty(device=device)
    _fill_random(model, device)
    model.rotary = type(model.rotary)(model.config.rotary_dim, model.config.rope_theta)
    return model.to(dtype).eval()


def timed(fn, device: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def kernel_profile(fn, repeats: int = 3, top: int = 12) -> dict:
    """GPU kernels of one call of fn (CUDA only; graph replays included): their summed device time, how many,
    and the `top` kernels by time. Device time against wall time says how host-bound a pass is; against the
    weight-streaming floor, how far its kernels are from the memory bus. A failure is reported, not raised
    (the profile is a diagnostic: the run's measurements must not be lost to it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
        kernels = [(e.key, e.count / repeats, e.self_device_time_total / repeats / 1e3) for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:   # the timeline's idle gaps (a diagnostic of a diagnostic: none rather than no profile)
        gaps = {key: (n / repeats, us / repeats / 1e3) for key, (n, us) in idle_gaps(
            [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
        ).items()}
    except Exception:
        gaps = {}
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as one:   # one call alone: its GPU span
            fn()
            torch.cuda.synchronize()
        bounds = [(e.time_range.start, e.time_range.end) for e in one.events() if e.device_type == DeviceType.CUDA]
        span_ms = (max(end for _, end in bounds) - min(start for start, _ in bounds)) / 1e3
    except Exception:   # no events, or a profiler without time ranges: the table shows nan
        span_ms = float("nan")
    kernels.sort(key=lambda k: -k[2])
    # span: the first kernel's start to the last one's end in one call (the host's work before its first launch left
    # out); span less device time: the GPU's idle gaps inside the call, wall time less span: the host's part
    return {"device_ms": sum(k[2] for k in kernels), "span_ms": span_ms, "kernels": round(sum(k[1] for k in kernels)),
            "top": [[name[:90], round(count, 1), round(ms, 4)] for name, count, ms in kernels[:top]],
            "all": {name: (count, ms) for name, count, ms in kernels}, "gaps": gaps}


def idle_gaps(activities: list[tuple[str, float, float]], threshold_us: float = 3.0) -> dict[tuple[str, str], tuple[int, float]]:
    """Where a GPU timeline waits: activities (name, start, end in us: kernels, copies, sets) in start order; each gap
    longer than threshold_us between the end of everything before an activity and its start, keyed by (the activity
    that ended last before the gap, the one after it): (gaps, us in all). The pair places a gap in the round (the
    drafter's last kernel before its top-k, a read to the host before the verify's first kernel, ...)."""
    gaps: dict[tuple[str, str], tuple[int, float]] = {}
    last_name, last_end = None, None
    for name, start, end in sorted(activities, key=lambda a: a[1]):
        if last_end is not None and start - last_end > threshold_us:
            count, total = gaps.get((last_name, name), (0, 0.0))
            gaps[(last_name, name)] = (count + 1, total + start - last_end)
        if last_end is None or end >= last_end:
            last_name, last_end = name, end
    return gaps


def gaps_per_round(whole: dict, prefill: dict, rounds: int, top: int = 12) -> list[list]:
    """The idle gaps of a request's decoding rounds (a whole request's less its prefill's, per round): [kernel before,
    kernel after, gaps, ms] of the `top` by time."""
    rows = [[before[:70], after[:70], round(count, 2), round(ms, 4)]
            for (before, after), count, ms in less_prefill(whole.get("gaps", {}), prefill.get("gaps", {}), rounds)]
    return sorted(rows, key=lambda r: -r[3])[:top]


def without_all(profile: dict) -> dict:
    """A profile as results keep it: the top kernels, not every kernel's line nor gap."""
    return {k: v for k, v in profile.items() if k not in ("all", "gaps")}


def kernels_per_round(whole: dict, prefill: dict, rounds: int, top: int | None = 20) -> list[list]:
    """The kernels of a request's decoding rounds (a whole request's less its prefill's), per round: [name, calls,
    ms] of the `top` by time. Where a round's device time goes stage by stage: the drafter's kernels run 5 times a
    round (its layers), the target's 64 (27B), its lm_head's once, each in both stages."""
    rows = [[name[:90], round(count, 1), round(ms, 4)] for name, count, ms in less_prefill(whole["all"], prefill["all"], rounds)]
    return sorted(rows, key=lambda r: -r[2])[:top]


def less_prefill(whole: dict, prefill: dict, rounds: int) -> list[tuple]:
    """(key, count, ms) per round of a whole request's profile entries (key -> (count, ms)) less its prefill's, those
    with time left."""
    rows = []
    for key, (count, ms) in whole.items():
        count0, ms0 = prefill.get(key, (0.0, 0.0))
        if ms - ms0 > 0:
            rows.append((key, (count - count0) / rounds, (ms - ms0) / rounds))
    return rows


def prefilled(model, device: str, prompt_len: int, room: int, generator: torch.Generator | None = None):
    """(a cache with a random prompt of prompt_len tokens prefilled and committed, room rows free after it; the
    prompt's ids on the device); the ids drawn with `generator` (a CPU one) where given."""
    cache = model.new_cache(prompt_len + room)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=generator,
                        device="cpu" if generator is not None else device).to(device)
    model(ids, torch.arange(prompt_len, device=device), cache, 0,
          torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril())
    cache.compact(0, list(range(prompt_len)))
    return cache, ids


def random_tree(vocab_size: int, budget: int, generator: torch.Generator):
    """A tree built under `budget` from random drafter logits over 15 depths (a block of 16's)."""
    return build_tree(*top_log_probs(torch.randn(15, vocab_size, generator=generator), budget), budget)


@torch.inference_mode()
def measure_verify(model: HybridTarget, device: str, budgets: list[int], prompt_len: int, repeats: int,
                   static: bool = False, profile: tuple[int, ...] = ()) -> dict:
    """One ar step and one tree verify per budget, through the dynamic forward or (static) the engine's static
    forward: CUDA graphs on CUDA, bucketed shapes (ddtree.models.graphs); a static forward's first call captures.
    On CUDA, the ar step and the verifies at the budgets in `profile` also get a kernel profile."""
    c = model.config
    cache, ids = prefilled(model, device, prompt_len, max(budgets) + 2)
    runner = StaticTarget(model, [], GraphPool(torch.device(device), capture=True)) if static else None
    ran = []   # the static programs run, by key: their graphs are replayed alone below (no host work at all)
    if runner is not None:
        ran, _ = record_programs(runner.graphs)   # the runner is this function's own: never stopped

        def verify(batch, parents):
            return runner(cache, prompt_len, batch.input_ids, batch.positions, parents)

    def replay_ms() -> float:
        """The last static program's graph replayed alone (median ms; NaN where none was captured)."""
        program = runner.graphs.programs.get(ran[-1]) if runner is not None and ran else None
        if program is None or not program.graph:
            return float("nan")
        return statistics.median(timed(program.graph.replay, device, repeats + 1)[1:])

    if runner is None:
        def verify(batch, parents):
            return model(batch.input_ids, batch.positions, cache, prompt_len, batch.visibility)
    root = ids[-1:]
    step = VerifyBatch(root.cpu() if static else root, torch.tensor([prompt_len], device="cpu" if static else device),
                       torch.ones(1, 1, dtype=torch.bool, device=device))
    ar = timed(lambda: verify(step, [-1]), device, repeats + 1)[1:]
    results = {"forward": "static" if static else "dynamic", "ar_step_ms": statistics.median(ar),
               "ar_replay_ms": replay_ms(), "budgets": {}}
    cuda = device.startswith("cuda")
    if cuda and profile:
        results["profile"] = {"ar": without_all(kernel_profile(lambda: verify(step, [-1])))}
    gen = torch.Generator().manual_seed(0)
    for budget in budgets:
        tree = random_tree(c.vocab_size, budget, gen)
        batch = compile_tree(tree, root_token=int(root[0]), start=prompt_len)
        if not static:   # the dynamic forward takes device tensors, the static one host integers
            batch = VerifyBatch(*(t.to(device) for t in (batch.input_ids, batch.positions, batch.visibility)))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = timed(lambda: verify(batch, tree.parents), device, repeats + 1)[1:]
        entry = {"num_nodes": tree.num_nodes + 1, "verify_ms": statistics.median(times),
                 "verify_over_ar": statistics.median(times) / results["ar_step_ms"], "replay_ms": replay_ms()}
        if cuda and budget in profile:
            results["profile"][f"ddtree-{budget}"] = without_all(kernel_profile(lambda: verify(batch, tree.parents)))
        if device.startswith("cuda"):
            entry["verify_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if hasattr(cache, "pending"):
            cache.pending = None   # hybrid: drop the uncommitted verify stash
        results["budgets"][budget] = entry
        print(f"budget {budget}: {entry}", flush=True)
    return results


def copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (median of 10)."""
    if not device.startswith("cuda"):
        return float("nan")
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src), device, 12)[2:]
    return 2 * src.numel() * src.element_size() / (statistics.median(times) / 1e3)


def weight_bytes(model: torch.nn.Module, exclude: tuple[str, ...] = ("embed_tokens.",)) -> int:
    """Bytes one decode step streams: every weight except the embedding table (one row is read)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(exclude))


def round_device_time(engine: Engine, prompt: list[int], params: SamplingParams, rounds: int, round_ms: float) -> dict:
    """GPU kernel time per round (a profiled request less a profiled prefill of the same prompt) and the share of the
    round the GPU idles: the host's share measured from the device side (Python, launches, synchronizations), where
    round - draft - verify also counts device work of the tree-build and commit stages."""
    whole = kernel_profile(lambda: engine.generate_ids(prompt, params), repeats=1)
    prefill = kernel_profile(lambda: engine.generate_ids(prompt, dataclasses.replace(params, max_tokens=1)), repeats=1)
    if "error" in whole or "error" in prefill:
        return {"device_profile_error": whole.get("error") or prefill.get("error")}
    device_ms = (whole["device_ms"] - prefill["device_ms"]) / rounds
    return {"device_ms": device_ms, "gpu_idle_share": max(0.0, 1.0 - device_ms / round_ms),
            "round_gaps": gaps_per_round(whole, prefill, rounds),
            "round_kernels": kernels_per_round(whole, prefill, rounds),
            "round_kernels_all": kernels_per_round(whole, prefill, rounds, top=None)}


def record_programs(graphs, host: dict[str, float] | None = None) -> tuple[list[tuple], Callable[[], None]]:
    """(the keys of the static programs `graphs` runs from now on, in order; a call that stops recording). host: the
    host's seconds inside those runs are added to it by program kind (key[0]): the inputs' copy and the graph's launch
    of a replay (the 25th and 26th sessions' turns saw an engine's commit and draft host times differ 2x between
    engines and methods of one form; this says whether the launches do)."""
    ran, run = [], graphs.run

    def timed_run(key, program, *args):
        ran.append(key)
        start = time.perf_counter()
        try:
            return run(key, program, *args)
        finally:
            if host is not None:
                host[str(key[0])] = host.get(str(key[0]), 0.0) + time.perf_counter() - start
    graphs.run = timed_run

    def stop() -> None:
        graphs.run = run
    return ran, stop


def program_profiles(engine: Engine, keys: list[tuple], rounds: int) -> list[dict]:
    """Each static program a method's measured rounds ran (CUDA graphs), replayed alone: calls per round, its kernels,
    their device time and the GPU span of one replay (span less device time: idle gaps inside the graph, which no
    host work can cause). A replay repeats the program's last writes (cache rows, states), which the next request's
    prefill resets."""
    rows = []
    for key in dict.fromkeys(keys):
        program = engine.graphs.programs.get(key)
        if program is None or not program.graph:
            continue
        p = without_all(kernel_profile(program.graph.replay))
        rows.append({"key": list(map(str, key)), "calls_per_round": keys.count(key) / rounds, **p})
    return rows


@torch.inference_mode()
def draft_tail_profile(engine: Engine, mode: str, budget: int) -> dict:
    """The draft stage after the drafter's program (eager): the lm_head over a block's depths and the top-k (a
    tree's) or argmax (a chain's) with its read to the host, on random drafter outputs of one request."""
    hidden = torch.randn(1, engine.drafter.block_size - 1, engine.target.config.hidden_size, device=engine.device,
                         dtype=engine.target.lm_head.weight.dtype)
    if mode == "dflash":
        return without_all(kernel_profile(lambda: top_ids(engine.draft_logits(hidden, []))))
    return without_all(kernel_profile(lambda: top_log_probs(engine.draft_logits(hidden, []), budget)))


@torch.inference_mode()
def rounds_engine(target: HybridTarget, drafter: DFlashDrafter, device: str, dtype: str, budgets: list[int],
                  prompt_len: int, rounds: int, static_forward: str = "auto", device_tree: bool = True,
                  **settings) -> Engine:
    """measure_rounds' engine, warmed up: static_forward: the engine's setting (auto: static forwards captured as CUDA
    graphs on CUDA); device_tree: its setting (off: the draft's top-k read and the tree built on the host); settings:
    other EngineConfig fields."""
    config = EngineConfig(target_path="(random)", drafter_path="(random)", dtype=dtype, device=device,
                          max_model_len=engine_max_len(prompt_len, rounds), max_tree_budget=max(budgets),
                          static_forward=static_forward, device_tree=device_tree, **settings)
    engine = Engine(config, target=target, drafter=drafter)
    # as the Triton model does at load: the static programs of every mode, row and path bucket. Without it a dflash
    # chain's programs (a row bucket per round as the chain shortens towards max_tokens) were each called once by
    # the warm-up request below, whose first call runs eagerly: their replays, and the static commits from their
    # fixed stashes, were first made (captured) inside the measured rounds
    engine.warm_up()
    return engine


def round_methods(budgets: list[int]) -> list[tuple[str, str, int]]:
    """(name, mode, budget) of measure_rounds' methods: ar, dflash and ddtree at each budget."""
    return [("ar", "ar", 1), ("dflash", "dflash", 1)] + [(f"ddtree-{b}", "ddtree", b) for b in budgets]


def round_prompt(target: HybridTarget, prompt_len: int) -> list[int]:
    return torch.randint(0, target.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()


def measure_method(engine: Engine, prompt: list[int], mode: str, budget: int, rounds: int, profile: bool = True
                   ) -> dict:
    """One request of `rounds` rounds in `mode` after an unmeasured one: the engine's stage times per round (host
    times, and on CUDA the GPU timelines of the draft, verify and commit stages: *_gpu_ms); profile: on CUDA also
    the round's device time, kernels, programs and the draft's eager tail (each run again under the profiler)."""
    params = SamplingParams(mode=mode, tree_budget=budget, max_tokens=rounds + 1, ignore_eos=True)   # +1: the prefill token
    engine.generate_ids(prompt, params)      # warm-up (allocator, kernels)
    late = len(engine.graphs.late_keys)
    stages = ("draft", "tree_build", "verify", "commit", "decode", "draft_gpu", "verify_gpu", "commit_gpu")
    before = {k: getattr(engine.stage_times, k) for k in stages + ("batch_rounds", "static_commits", "device_trees")}
    parts_before = list(engine.stage_times.commit_parts)
    launches: dict[str, float] = {}
    ran, stop = record_programs(engine.graphs, launches)   # the programs the measured request runs, their host time
    try:
        engine.generate_ids(prompt, params)
    finally:
        stop()
    t = engine.stage_times
    n = t.batch_rounds - before["batch_rounds"]
    entry = {k: (getattr(t, k) - before[k]) / n * 1e3 for k in stages}
    entry = {f"{k}_ms" if k != "decode" else "round_ms": v for k, v in entry.items()}
    entry["static_commit_share"] = (t.static_commits - before["static_commits"]) / n
    entry["device_tree_share"] = (t.device_trees - before["device_trees"]) / n   # rounds read once
    entry["commit_parts_ms"] = {name: (after - prior) / n * 1e3
                                for name, after, prior in zip(COMMIT_PARTS, t.commit_parts, parts_before)}
    entry["program_host_ms"] = {kind: seconds / n * 1e3 for kind, seconds in sorted(launches.items())}
    # programs whose capture failed run eagerly (logged once): which kinds
    entry["eager_programs"] = sorted({key[0] for key, p in engine.graphs.programs.items() if p.graph is False})
    # programs made (compiled, captured) inside the measured rounds: their cost is in the stage times above
    entry["late_programs"] = [list(map(str, key)) for key in engine.graphs.late_keys[late:]]
    entry["rounds"] = n
    if profile and engine.device.type == "cuda" and engine.config.static_forward != "off":
        entry.update(round_device_time(engine, prompt, params, n, entry["round_ms"]))
        entry["programs"] = program_profiles(engine, ran, n)
        if mode != "ar":
            entry["draft_tail"] = draft_tail_profile(engine, mode, budget)
    return entry


def measure_rounds(target: HybridTarget, drafter: DFlashDrafter, device: str, dtype: str, budgets: list[int],
                   prompt_len: int, rounds: int, static_forward: str = "auto", device_tree: bool = True,
                   **settings) -> dict:
    """Whole engine rounds at batch 1: ar, dflash and ddtree at each budget (random drafter: ~1 token a round,
    so every round drafts and verifies a full tree), each method's measure_method entry with round_over_ar.
    static_forward, device_tree, settings: rounds_engine's."""
    engine = rounds_engine(target, drafter, device, dtype, budgets, prompt_len, rounds, static_forward, device_tree,
                           **settings)
    prompt = round_prompt(target, prompt_len)
    results = {}
    for name, mode, budget in round_methods(budgets):
        results[name] = measure_method(engine, prompt, mode, budget, rounds)
        print(f"{name}: {results[name]}", flush=True)
    ar = results["ar"]["round_ms"]
    for entry in results.values():
        entry["round_over_ar"] = entry["round_ms"] / ar
    return results


def measure_rounds_in_turns(target: HybridTarget, drafter: DFlashDrafter, device: str, dtype: str, budgets: list[int],
                            prompt_len: int, rounds: int, forms: dict[str, dict[str, str]], turns: int,
                            settings: dict[str, dict] | None = None,
                            on_turn: Callable[[dict], None] | None = None, failed: dict | None = None,
                            freeze_heap: bool = False) -> dict:
    """Whole rounds of several engine forms (name -> the environment it runs under, read when its programs are captured and
    in its turns; settings: form -> rounds_engine keywords, e.g. device_tree False) measured in turns: every engine
    built and warmed first, then in each turn every form runs every method once, the forms in an order that starts one
    later each turn. Sequential runs on one GPU drift by up to 0.5 ms a verify at 27B dims; pairs of the same turn share
    the machine's state. Per form and method: the median round over turns (round_ms, round_over_ar: the median of each
    turn's ratio to the form's own `ar`), the turns' rounds, and per form other than the first its round against the
    first form's in the same turn (median, min, max). on_turn: called after each turn with every form's rounds so far
    (form -> method -> one entry a turn), so that a run cut off by a time limit keeps its finished turns. failed: a
    dict where a form other than the first whose engine cannot be built (e.g. a kernel of its that does not compile)
    is recorded (form -> the error) and left out, the others measured; None: the error raised. freeze_heap: the turns
    run with what building the engines left frozen (perf.common.frozen_heap), as the served model's heap after its
    warm-up, so that no form's rounds pay full collections of the other forms' objects."""
    engines, prompt = {}, round_prompt(target, prompt_len)
    gc.collect()   # the engines of a run's earlier stages, if still held in cycles: every form's engine lives at once
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for i, (form, env) in enumerate(forms.items()):
        with mock.patch.dict(os.environ, env):
            try:
                engines[form] = rounds_engine(target, drafter, device, dtype, budgets, prompt_len, rounds, "on",
                                              **(settings or {}).get(form, {}))
            except Exception as error:
                if failed is None or i == 0:
                    raise
                failed[form] = f"{type(error).__name__}: {error}"
                print(f"{form}: its engine failed, left out: {failed[form][:2000]}", flush=True)
                continue
        if torch.cuda.is_available():   # what each form's engine holds (four forms after a full run did not fit an H100)
            print(f"{form}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated after its engine", flush=True)
    names = list(engines)
    runs: dict[str, dict[str, list[dict]]] = {form: {name: [] for name, _, _ in round_methods(budgets)} for form in names}
    with frozen_heap(freeze_heap):
        for turn in range(turns):
            for form in names[turn % len(names):] + names[:turn % len(names)]:
                with mock.patch.dict(os.environ, forms[form]):
                    for name, mode, budget in round_methods(budgets):
                        runs[form][name].append(measure_method(engines[form], prompt, mode, budget, rounds,
                                                               profile=False))
            print(f"turn {turn + 1}/{turns}: " + ", ".join(
                f"{form} {name} {runs[form][name][-1]['round_ms']:.2f}" for form in names for name in runs[form]),
                flush=True)
            if on_turn is not None:
                on_turn(runs)
    first, out = names[0], {}
    for form in names:
        out[form] = {}
        for name, entries in runs[form].items():
            ms = [e["round_ms"] for e in entries]
            entry = {k: statistics.median(e[k] for e in entries) for k, v in entries[0].items()
                     if k.endswith("_ms") and isinstance(v, float)}
            entry.update(turns_ms=ms, rounds=entries[0]["rounds"],
                         round_over_ar=statistics.median(m / a["round_ms"] for m, a in zip(ms, runs[form]["ar"])),
                         static_commit_share=statistics.median(e["static_commit_share"] for e in entries),
                         device_tree_share=statistics.median(e["device_tree_share"] for e in entries),
                         commit_parts_ms={k: statistics.median(e["commit_parts_ms"][k] for e in entries)
                                          for k in entries[0]["commit_parts_ms"]},
                         program_host_ms={k: statistics.median(e["program_host_ms"].get(k, 0.0) for e in entries)
                                          for k in sorted({k for e in entries for k in e["program_host_ms"]})})
            if form != first:
                paired = [m / f["round_ms"] for m, f in zip(ms, runs[first][name])]
                entry["over_first"] = {"form": first, "median": statistics.median(paired), "min": min(paired),
                                       "max": max(paired)}
            out[form][name] = entry
    return out


@torch.inference_mode()
def measure_batched_rounds(target, drafter: DFlashDrafter, device: str, dtype: str, batches: list[int], prompt_len: int,
                           rounds: int, modes: tuple[tuple[str, int], ...] = (("ar", 1), ("ddtree", 16))) -> dict:
    """Whole engine rounds of R concurrent requests (static forwards, CUDA graphs on CUDA): ms per round and committed
    tokens per second against R, per mode. What batching buys: a round of R requests streams the weights once."""
    config = EngineConfig(target_path="(random)", drafter_path="(random)", dtype=dtype, device=device,
                          max_model_len=engine_max_len(prompt_len, rounds), max_tree_budget=max(b for _, b in modes),
                          default_tree_budget=min(16, max(b for _, b in modes)),
                          max_num_seqs=max(batches), static_forward="on")
    engine = Engine(config, target=target, drafter=drafter)
    gen = torch.Generator().manual_seed(3)
    results: dict[str, dict[int, dict]] = {}
    for mode, budget in modes:
        name = mode if mode != "ddtree" else f"ddtree-{budget}"
        for r in batches:
            params = SamplingParams(mode=mode, tree_budget=budget, max_tokens=rounds + 1, ignore_eos=True)
            prompts = [torch.randint(0, target.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(r)]

            def run(tag: str) -> list[Request]:
                requests = [Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]
                for request in requests:
                    engine.add(request)
                engine.step()                      # the prefills
                while engine.has_work:
                    engine.step()
                return requests

            run("warm")                            # captures this batch's programs
            before = (engine.stage_times.decode, engine.stage_times.batch_rounds)
            tokens = sum(req.num_output_tokens - 1 for req in run("measured"))   # less each prefill's token
            seconds, n = engine.stage_times.decode - before[0], engine.stage_times.batch_rounds - before[1]
            results.setdefault(name, {})[r] = {"round_ms": seconds / n * 1e3, "tokens_per_s": tokens / seconds, "rounds": n}
            print(f"batched {name} x{r}: {results[name][r]}", flush=True)
    return results


def gdn_precision_gap(shape: str, device: str, num_nodes: int = 1025) -> dict:
    """Tree GDN outputs in bf16 / fp32 inputs against a float64 per-path recurrence (one layer's dims)."""
    s = SHAPES[shape]
    hv, dk, dv = s["linear_num_value_heads"], s["linear_key_head_dim"], s["linear_value_head_dim"]
    gen = torch.Generator().manual_seed(1)
    parents = [p if i else -1 for i, p in enumerate(random_tree(4096, num_nodes - 1, gen).parents)]
    q = torch.randn(num_nodes, hv, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(num_nodes, hv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(num_nodes, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(num_nodes, hv, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(num_nodes, hv, generator=gen, dtype=torch.float64)
    s0 = torch.randn(hv, dk, dv, generator=gen, dtype=torch.float64) * 0.1
    reference, _ = gdn_sequential(q, k, v, g, beta, parents, s0)
    gaps = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        args = [t.to(device=device, dtype=dtype) for t in (q, k, v)] + [g.to(device).float(), beta.to(device).float()]
        out, _ = gdn_tree(*args, parents, s0.to(device).float())
        diff = (out.double().cpu() - reference).abs()
        gaps[name] = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
                      "max_ref": reference.abs().max().item()}
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen36-27b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=12, help="engine rounds per mode (0: skip)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="hybrid_verify")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    dtype = getattr(torch, args.dtype)
    model = random_target(args.shape, dtype, args.device)
    result = {"header": header(), "shape": args.shape, "dtype": args.dtype, "device": args.device,
              "prompt_len": args.prompt_len,
              "fla_prefill": chain_gdn_kernel(torch.device(args.device)) is not None,
              **measure_verify(model, args.device, budgets, args.prompt_len, args.repeats)}
    bandwidth = copy_bandwidth(args.device)
    result["floor"] = {"weight_bytes": weight_bytes(model), "copy_bytes_per_s": bandwidth,
                       "floor_ms": weight_bytes(model) / bandwidth * 1e3}
    result["floor"]["ar_step_over_floor"] = result["ar_step_ms"] / result["floor"]["floor_ms"]
    if args.rounds:
        drafter = random_drafter(DRAFTERS[args.shape], model, dtype, args.device)
        result["drafter_weight_bytes"] = weight_bytes(drafter, exclude=())
        round_budgets = [b for b in budgets if b in (16, 64)] or budgets[:1]
        result["rounds"] = measure_rounds(model, drafter, args.device, args.dtype, round_budgets, args.prompt_len,
                                          args.rounds)
        del drafter
    del model
    result["gdn_precision_gap"] = gdn_precision_gap(args.shape, args.device)
    floor = result["floor"]
    rows = [f"one ar step (target forward only): {result['ar_step_ms']:.2f} ms; weight-streaming floor "
            f"{floor['floor_ms']:.2f} ms ({floor['weight_bytes'] / 1e9:.2f} GB at {floor['copy_bytes_per_s'] / 1e12:.2f} "
            f"TB/s measured copy bandwidth): ar / floor = {floor['ar_step_over_floor']:.2f}; "
            f"fla prefill: {result['fla_prefill']}", ""]
    if "rounds" in result:
        rows += [f"Whole engine rounds at batch 1 (random drafter, {result['shape']} shape, "
                 f"{result['drafter_weight_bytes'] / 1e9:.2f} GB):", "",
                 "| method | round ms | round / ar | draft ms | tree build ms | verify ms | commit ms |",
                 "|---|---|---|---|---|---|---|"]
        for name, e in result["rounds"].items():
            rows.append(f"| {name} | {e['round_ms']:.1f} | {e['round_over_ar']:.2f} | {e['draft_ms']:.1f} | "
                        f"{e['tree_build_ms']:.1f} | {e['verify_ms']:.1f} | {e['commit_ms']:.1f} |")
        rows.append("")
    rows += ["Target verify alone:", "",
            "| budget | nodes | verify ms | verify / ar | peak extra GiB |", "|---|---|---|---|---|"]
    for budget, e in result["budgets"].items():
        rows.append(f"| {budget} | {e['num_nodes']} | {e['verify_ms']:.2f} | {e['verify_over_ar']:.2f} | "
                    f"{e.get('verify_peak_extra_gib', float('nan')):.3f} |")
    rows += ["", "| tree GDN inputs | max abs error vs fp64 | mean abs error | max abs output |", "|---|---|---|---|"]
    for name, gap in result["gdn_precision_gap"].items():
        rows.append(f"| {name} | {gap['max_abs']:.2e} | {gap['mean_abs']:.2e} | {gap['max_ref']:.2e} |")
    write_results(Path(args.out), args.name, result, "\n".join(rows))


if __name__ == "__main__":
    main()
