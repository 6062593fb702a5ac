"""What a method's batch rounds cost over another's, in process, and where in the Python the difference goes.

Issue 4's sweeps found `auto` 0.86-0.93x `ar` through Triton on the H200 while it ran `ar` in every round. This
takes the server out and pairs the two: one engine, `--concurrency` requests added at once per batch, the methods
in turns (`--turns`, each turn one batch of each, the order rotated), the median turn's ms per batch round and
tokens/s, the ratio turn by turn; then one batch of each under cProfile, and the functions whose time per round
differs most between the candidate (the last method) and the base (the first). `--requests-per-stream K` keeps a
point's requests running instead, each that finished replaced at once until K a stream ran: the admissions and
prefills among the rounds that a serving sweep has and a batch added at once pays once.

    python perf/round_profile.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \\
        --drafter models/smollm2-shaped-dflash --concurrency 1,2,8,32 --name round_profile_h200
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf import batch_rounds  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, frozen_heap, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402


def params_for(name: str, max_tokens: int) -> SamplingParams:
    mode, _, budget = name.partition("-")
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=mode, tree_budget=int(budget or 64), seed=0)


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams, profile: cProfile.Profile | None = None,
              total: int = 0, spread: int = 0) -> dict:
    """batch_rounds.run_batch (the prompts added at once, stepped until all finish; with total, as many kept running
    until `total` ran), under `profile` where given: ms per batch round, tokens/s, auto's arms."""
    if profile is not None:
        profile.enable()
    try:
        result = batch_rounds.run_batch(engine, prompts, params, total=total, spread=spread)
    finally:
        if profile is not None:
            profile.disable()
    return {"ms_per_round": 1e3 * result["seconds"] / max(result["batch_rounds"], 1),
            "batch_rounds": result["batch_rounds"], "tokens_per_s": result["tokens_per_s"], "arms": result["arms"]}


def per_function(profile: cProfile.Profile, rounds: int) -> dict[str, float]:
    """{function: own us per batch round} (its callees' time left out: the differences add up to the total's)."""
    stats = pstats.Stats(profile).stats   # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    out: dict[str, float] = {}
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        key = f"{Path(file).name}:{name}" if file != "~" else name
        out[key] = out.get(key, 0.0) + 1e6 * tottime / max(rounds, 1)
    return out


def measure_level(engine: Engine, prompts: list[list[int]], methods: list[str], args) -> dict:
    total = len(prompts) * args.requests_per_stream
    for name in methods:   # unmeasured: auto's exploration at this batch size, any program not made at warm-up
        run_batch(engine, prompts, params_for(name, args.max_tokens), total=total, spread=args.spread)
    turns: list[dict[str, dict]] = []
    for turn in range(args.turns):
        order = methods[turn % len(methods):] + methods[: turn % len(methods)]
        turns.append({name: run_batch(engine, prompts, params_for(name, args.max_tokens), total=total, spread=args.spread)
                      for name in order})
    base, candidate = methods[0], methods[-1]
    ratios = [t[candidate]["tokens_per_s"] / t[base]["tokens_per_s"] for t in turns]
    profiles = {}
    for name in methods:
        profile = cProfile.Profile()
        result = run_batch(engine, prompts, params_for(name, args.max_tokens), profile, total, args.spread)
        profiles[name] = per_function(profile, result["batch_rounds"])
    diff = sorted(((profiles[candidate].get(k, 0.0) - profiles[base].get(k, 0.0), k) for k in
                   set(profiles[candidate]) | set(profiles[base])), reverse=True)[: args.top]
    return {"methods": {name: {"ms_per_round": statistics.median(t[name]["ms_per_round"] for t in turns),
                               "tokens_per_s": statistics.median(t[name]["tokens_per_s"] for t in turns),
                               "arms": turns[-1][name]["arms"]} for name in methods},
            "ratio_median": statistics.median(ratios), "ratio_worst": min(ratios), "ratios": ratios,
            "profile_diff_us": [{"function": k, "us_per_round": round(d, 1),
                                 base: round(profiles[base].get(k, 0.0), 1),
                                 candidate: round(profiles[candidate].get(k, 0.0), 1)} for d, k in diff]}


def table(result: dict) -> str:
    methods, levels = result["methods"], result["levels"]
    base, candidate = methods[0], methods[-1]
    per_stream = result.get("requests_per_stream", 1)
    arrivals = ("added at once" if per_stream == 1 else f"kept running, each finished one replaced at once, {per_stream} "
                "a stream (a closed loop's arrivals)")
    if result.get("spread"):
        arrivals += f", each asking {result['max_tokens']} tokens less 0..{result['spread']}"
    lines = [f"Requests x {result['max_tokens']} tokens {arrivals}, {result['turns']} turns per point (one batch of "
             "each method per turn); the median turn:", "",
             "| | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name in methods:
        lines.append(f"| {name} ms / round | " + " | ".join(f"{result['points'][str(c)]['methods'][name]['ms_per_round']:.3f}"
                                                        for c in levels) + " |")
    for name in methods:
        lines.append(f"| {name} tok/s | " + " | ".join(f"{result['points'][str(c)]['methods'][name]['tokens_per_s']:.0f}"
                                                   for c in levels) + " |")
    lines.append(f"| {candidate} / {base}, median turn (worst) | " + " | ".join(
        f"{result['points'][str(c)]['ratio_median']:.3f} ({result['points'][str(c)]['ratio_worst']:.3f})" for c in levels)
        + " |")
    lines.append(f"| {candidate}'s arms (last turn) | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in result["points"][str(c)]["methods"][candidate]["arms"].items()) or "-"
        for c in levels) + " |")
    for c in levels:
        lines += ["", f"c={c}: functions whose own time per round (us, under cProfile, which inflates every call) "
                  f"is most above in {candidate} than in {base} (one profiled batch each):", "",
                  f"| function | difference | {base} | {candidate} |", "|---|---|---|---|"]
        lines += [f"| `{row['function']}` | {row['us_per_round']:.1f} | {row[base]:.1f} | {row[candidate]:.1f} |"
                  for row in result["points"][str(c)]["profile_diff_us"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--methods", default="ar,auto", help="comma-separated, the base first and the candidate last")
    parser.add_argument("--concurrency", default="1,2,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="functions listed per point")
    parser.add_argument("--requests-per-stream", type=int, default=1,
                        help="1: a point's requests added at once; more: as many kept running, each that finished "
                             "replaced at once, until this many per stream ran (admissions among the rounds, as in "
                             "a serving sweep)")
    parser.add_argument("--spread", type=int, default=0,
                        help="request i asks --max-tokens less 0..SPREAD (the same every run): requests finish and "
                             "arrive on different rounds, as in a served load (with --requests-per-stream > 1)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting, parsed as config.pbtxt's (repeatable)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="round_profile_cpu")
    add_freeze_heap_arg(parser)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    base = encode_prompts(Tokenizer(args.target), json.loads((ROOT / "perf/prompts.json").read_text()))
    config = EngineConfig.from_dict({"target_path": args.target, "drafter_path": args.drafter, "device": args.device,
                                     "dtype": args.dtype, "max_num_seqs": str(max(levels)), "max_tree_budget": "64",
                                     "max_model_len": str(max(map(len, base)) + args.max_tokens + 64),
                                     **dict(kv.split("=", 1) for kv in args.engine)})
    engine = Engine(config)
    engine.warm_up()
    result = {"header": header(), "max_tokens": args.max_tokens, "turns": args.turns, "methods": methods,
              "requests_per_stream": args.requests_per_stream, "spread": args.spread, "freeze_heap": args.freeze_heap,
              "levels": levels, "points": {}}
    with frozen_heap(args.freeze_heap):
        for level in tqdm(levels, desc="concurrency"):
            prompts = [base[i % len(base)] for i in range(level)]
            result["points"][str(level)] = measure_level(engine, prompts, methods, args)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
