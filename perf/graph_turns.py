"""Static forwards of one target side by side, in turns: which kernel configuration is faster, free of drift.

perf/gpu_ratios.py measures its variants one after another, and on the H200 the same `ar` step's graph (the same
kernels, the same device time) replayed 0.57 ms slower when measured second (gpu_ratios_h200 at 7d384a4): a
difference between configurations measured in sequence can be the machine's, not theirs. Here every configuration
(the default and gpu_ratios' environment variants) captures its programs first (an `ar` step, a dflash chain's verify, a tree verify per
budget, each on a cache of its own); then each turn times every program of every configuration, in an order that
rotates from turn to turn, with the copy bandwidth (the floor's) measured in each turn too. A configuration's numbers
are medians over turns; its ratio to the default is the median of the turns' paired ratios.

Per program: `step` is the static runner's call (host input copy and graph replay: what the engine pays; the number
gpu_ratios' `ar / floor` uses), `replay` the captured graph alone (the GPU's own time; CUDA only).
Writes perf/results/<name>.{json,md}.

    python perf/graph_turns.py --device cuda --dtype bfloat16 --variants static-noqkv,static-sdpatrees --name graph_turns_h200
    python perf/graph_turns.py --shape tiny-hybrid --dtype float32 --turns 2 --name graph_turns_cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.graphs import GraphPool, StaticTarget  # noqa: E402
from ddtree.tree import build_chain, compile_tree  # noqa: E402
from ddtree.tree.compile import VerifyBatch  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402
from perf.gpu_ratios import VARIANT_ENV, build  # noqa: E402
from perf.hybrid_verify import copy_bandwidth, prefilled, random_tree, record_programs, timed, weight_bytes  # noqa: E402


def capture(target, device: str, budgets: list[int], prompt_len: int) -> dict:
    """One configuration's static programs, captured under the current environment: {program: (step, replay)}, where
    step is the runner's call and replay the graph's (None without one). Each has a cache of its own, kept alive by
    the closures."""
    cache, ids = prefilled(target, device, prompt_len, max(budgets) + 2, torch.Generator().manual_seed(0))
    runner = StaticTarget(target, [], GraphPool(torch.device(device), capture=True))
    ran, _ = record_programs(runner.graphs)
    root = int(ids[-1])
    batches = {"ar": (VerifyBatch(torch.tensor([root]), torch.tensor([prompt_len]),
                                  torch.ones(1, 1, dtype=torch.bool, device=device)), [-1])}
    gen = torch.Generator().manual_seed(0)
    # a dflash chain's verify: 16 rows (the block), through the few-rows kernel where one-row Linears go through the GEMV
    chain = build_chain(torch.randint(0, target.config.vocab_size, (15,), generator=gen).tolist())
    batches["dflash"] = (compile_tree(chain, root_token=root, start=prompt_len), chain.parents)
    for budget in budgets:
        tree = random_tree(target.config.vocab_size, budget, gen)
        batches[f"ddtree-{budget}"] = (compile_tree(tree, root_token=root, start=prompt_len), tree.parents)
    programs = {}
    for name, (batch, parents) in batches.items():
        def step(batch=batch, parents=parents):
            runner(cache, prompt_len, batch.input_ids, batch.positions, parents)
            if hasattr(cache, "pending"):
                cache.pending = None   # hybrid: drop the uncommitted verify stash
        step(), step()                 # the first call captures (CUDA)
        program = runner.graphs.programs.get(ran[-1])
        programs[name] = (step, program.graph.replay if program is not None and program.graph else None)
    return programs


def median_ms(fn, device: str, repeats: int) -> float:
    return statistics.median(timed(fn, device, repeats + 1)[1:])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen36-27b", help="a perf/gpu_ratios.py shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default="static-noqkv,static-sdpatrees", help="perf/gpu_ratios.py environment variants")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per program per turn (median)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="graph_turns")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANT_ENV]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANT_ENV)}")
    budgets = [int(b) for b in args.budgets.split(",")]
    torch.manual_seed(0)
    target, drafter = build(args.shape, getattr(torch, args.dtype), args.device)
    del drafter
    gc.collect()
    configs = {"static": {}} | {v: VARIANT_ENV[v] for v in variants}
    programs = {}
    with torch.inference_mode():
        for name, env in configs.items():
            with mock.patch.dict(os.environ, env):
                programs[name] = capture(target, args.device, budgets, args.prompt_len)
            print(f"captured {name}", flush=True)
        names, samples, bandwidth = list(configs), {}, []
        for turn in range(args.turns):
            bandwidth.append(copy_bandwidth(args.device))
            for name in names[turn % len(names):] + names[:turn % len(names)]:   # the order rotates
                for program, (step, replay) in programs[name].items():
                    entry = samples.setdefault(name, {}).setdefault(program, {"step": [], "replay": []})
                    entry["step"].append(median_ms(step, args.device, args.repeats))
                    entry["replay"].append(median_ms(replay, args.device, args.repeats) if replay else float("nan"))
            print(f"turn {turn + 1}/{args.turns}: " + "; ".join(
                f"{n} ar {samples[n]['ar']['step'][-1]:.3f}" for n in names), flush=True)
    floor_bytes = weight_bytes(target)
    floors = [floor_bytes / b * 1e3 for b in bandwidth]   # ms per turn (NaN without a GPU)
    result = {"header": header(), "shape": args.shape, "budgets": budgets, "turns": args.turns,
              "configs": {n: configs[n] for n in names}, "floor_ms": floors, "weight_bytes": floor_bytes,
              "samples": samples, "summary": {}}
    for name in names:
        for program, entry in samples[name].items():
            base = samples["static"][program]
            row = {kind: statistics.median(entry[kind]) for kind in ("step", "replay")}
            for kind in ("step", "replay"):
                row[f"{kind}_spread"] = max(entry[kind]) - min(entry[kind])
                row[f"{kind}_vs_static"] = statistics.median(a / b for a, b in zip(entry[kind], base[kind]))
            if program == "ar":   # per turn, against the floor measured in the same turn
                row["step_over_floor"] = statistics.median(a / f for a, f in zip(entry["step"], floors))
                row["replay_over_floor"] = statistics.median(a / f for a, f in zip(entry["replay"], floors))
            result["summary"].setdefault(name, {})[program] = row
    write_results(Path(args.out), args.name, result, table(result))
    return result


def table(result: dict) -> str:
    floors = result["floor_ms"]
    lines = [f"{result['shape']}: {result['turns']} turns; each turn times every configuration's programs, in an "
             "order that rotates; medians over turns (spread: max - min), ratios to the default as medians of the "
             "turns' paired ratios",
             "",
             "floor per turn (weight bytes / copy bandwidth of that turn): "
             + ", ".join(f"{f:.2f}" for f in floors) + " ms",
             "",
             "| config | environment | program | step ms | spread | / static | replay ms | spread | / static "
             "| step / floor | replay / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, programs in result["summary"].items():
        env = " ".join(f"{k}={v}" for k, v in result["configs"][name].items()) or "(defaults)"
        for program, r in programs.items():
            lines.append(f"| {name} | {env} | {program} | {r['step']:.3f} | {r['step_spread']:.3f} | "
                         f"{r['step_vs_static']:.3f} | {r['replay']:.3f} | {r['replay_spread']:.3f} | "
                         f"{r['replay_vs_static']:.3f} | {r.get('step_over_floor', float('nan')):.3f} | "
                         f"{r.get('replay_over_floor', float('nan')):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
