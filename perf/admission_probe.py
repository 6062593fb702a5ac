"""What admitting requests into a running batch costs, in process: the engine steps that prefill arrivals against
those that only decode, split into their parts, and where the prefill's host time goes.

A serving sweep's closed-loop streams finish at different rounds, so requests arrive a few at a time among the
rounds (through Triton at c=32 on the H200, ~0.5 admissions a round). This keeps `--slots` requests running on one
engine, each finished one replaced at once by the next (`--requests` in all), their max_tokens spread over
`--spread` tokens so that they finish apart, and times every step: the settling of queued `ar` steps (a batch that
changes drains them), the prefill (Engine._prefill: all the requests admitted together; since 578e7aa it launches
the prefill and returns, the greedy first tokens read after the others' round, so the prefill's device time is in
the rest) and the rest (the decoding round of the others, the first tokens' read, the releases). The prefill runs
under cProfile: its functions by cumulative time per prefill.

    python perf/admission_probe.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \\
        --drafter models/smollm2-shaped-dflash --methods ar,auto --name admission_probe_h200
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402


class Timed:
    """Wraps an engine method on the instance: the seconds of each call (and, with a profile, the call under it)."""

    def __init__(self, method, profile: cProfile.Profile | None = None) -> None:
        self.method, self.profile, self.calls = method, profile, []

    def __call__(self, *args):
        start = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        try:
            return self.method(*args)
        finally:
            if self.profile is not None:
                self.profile.disable()
            self.calls.append(time.perf_counter() - start)


def run_method(engine: Engine, prompts: list[list[int]], mode: str, args) -> dict:
    """One method's run: --slots requests kept running until --requests ran; every step timed and split."""
    profile = cProfile.Profile()
    settle, prefill = Timed(engine._settle_ahead), Timed(engine._prefill, profile)
    engine._settle_ahead, engine._prefill = settle, prefill
    count = traced_steps = 0

    def add() -> None:
        nonlocal count
        max_tokens = args.max_tokens - random.Random(count).randint(0, args.spread)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=mode, tree_budget=64, seed=0)
        engine.add(Request(request_id=f"{mode}-{count}", prompt_ids=prompts[count % len(prompts)], params=params))
        count += 1

    steps = []
    tokens = 0
    arms0 = dict(engine.stage_times.auto_arm_rounds)
    kernels: dict[str, list] = {}   # kernel -> [calls, ms] over the traced steps
    try:
        for _ in range(min(args.slots, args.requests)):
            add()
        rounds0 = engine.stage_times.batch_rounds
        start = time.perf_counter()
        while engine.has_work:
            admitted = min(len(engine.waiting), len(engine.free_slots))
            n_settle, n_prefill = len(settle.calls), len(prefill.calls)
            traced = args.kernels and admitted == 1 and traced_steps < args.kernels
            t0 = time.perf_counter()
            if traced:   # a lone admission's whole step, its kernels (the step left out of the timings)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
                    outputs = engine.step()
                    torch.cuda.synchronize()
                for e in trace.key_averages():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        count_ms = kernels.setdefault(e.key[:90], [0, 0.0])
                        count_ms[0] += e.count
                        count_ms[1] += e.self_device_time_total / 1e3
                traced_steps += 1
            else:
                outputs = engine.step()
            wall = time.perf_counter() - t0
            settled = sum(settle.calls[n_settle:])
            prefilled = sum(prefill.calls[n_prefill:]) if admitted else 0.0
            if not traced:
                steps.append({"admitted": admitted, "ms": 1e3 * wall, "settle_ms": 1e3 * settled,
                              "prefill_ms": 1e3 * prefilled, "rest_ms": 1e3 * (wall - settled - prefilled)})
            for output in outputs:
                tokens += len(output.new_token_ids)
                if output.is_finished and count < args.requests:
                    add()
        seconds = time.perf_counter() - start
    finally:
        del engine._settle_ahead, engine._prefill
    admitting = [s for s in steps if s["admitted"]]
    decoding = [s for s in steps if not s["admitted"]]
    prefills = len(admitting)

    def mean(rows: list[dict], key: str) -> float:
        return statistics.fmean(r[key] for r in rows) if rows else 0.0

    stats = pstats.Stats(profile).stats
    functions = sorted(((f"{Path(f).name}:{name}" if f != "~" else name, cum) for (f, line, name), (_, _, _, cum, _)
                        in stats.items()), key=lambda item: -item[1])
    by_size: dict[int, list[float]] = {}
    for s in admitting:
        by_size.setdefault(s["admitted"], []).append(s["prefill_ms"])
    arms = {k: v - arms0.get(k, 0) for k, v in engine.stage_times.auto_arm_rounds.items() if v > arms0.get(k, 0)}
    lone = []
    if traced_steps:
        lone = [(k, n / traced_steps, ms / traced_steps) for k, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    return {"tokens_per_s": tokens / seconds, "arms": arms, "lone_admission_kernels": lone, "seconds": seconds, "steps": len(steps),
            "batch_rounds": engine.stage_times.batch_rounds - rounds0,
            "admitting": {"steps": len(admitting), "requests": sum(s["admitted"] for s in admitting),
                          **{k: mean(admitting, k) for k in ("ms", "settle_ms", "prefill_ms", "rest_ms")}},
            "decoding": {"steps": len(decoding), **{k: mean(decoding, k) for k in ("ms", "settle_ms", "rest_ms")}},
            "prefill_ms_by_group": {str(k): statistics.fmean(v) for k, v in sorted(by_size.items())},
            "prefill_functions_us": [(name, 1e6 * cum / max(prefills, 1)) for name, cum in functions[: args.top]]}


def table(result: dict) -> str:
    rows = ["Steps that admit requests (their settle of queued `ar` steps / prefill / the rest: the decoding round of the "
            "others and the releases) against steps that only decode; mean ms.", "",
            "| method | tok/s | admitting steps (requests) | admitting ms = settle + prefill + rest | decoding steps | "
            "decoding ms = settle + rest | share of the time in admitting steps |", "|---|---|---|---|---|---|---|"]
    for method, r in result["methods"].items():
        a, d = r["admitting"], r["decoding"]
        share = a["steps"] * a["ms"] / max(a["steps"] * a["ms"] + d["steps"] * d["ms"], 1e-9)
        rows.append(f"| {method} | {r['tokens_per_s']:.0f} | {a['steps']} ({a['requests']}) | {a['ms']:.2f} = "
                    f"{a['settle_ms']:.2f} + {a['prefill_ms']:.2f} + {a['rest_ms']:.2f} | {d['steps']} | {d['ms']:.2f} = "
                    f"{d['settle_ms']:.2f} + {d['rest_ms']:.2f} | {share:.0%} |")
    for method, r in result["methods"].items():
        sizes = ", ".join(f"{k}: {v:.2f}" for k, v in r["prefill_ms_by_group"].items())
        rows += ["", f"{method}: prefill ms by requests admitted together: {sizes}", "",
                 f"{method}: the prefill's functions by cumulative time (us per prefill, cProfile)", "",
                 "| function | us |", "|---|---|"]
        rows += [f"| `{name}` | {us:.0f} |" for name, us in r["prefill_functions_us"]]
        if r["arms"]:
            rows += ["", f"{method}: arms of its rounds: " + ", ".join(f"{k} {v}" for k, v in r["arms"].items())]
        if r["lone_admission_kernels"]:
            total = sum(ms for _, _, ms in r["lone_admission_kernels"])
            rows += ["", f"{method}: kernels of a step admitting one request (settle, prefill and the round; "
                     f"{total:.2f} ms of device time a step)", "", "| kernel | per step | ms per step |", "|---|---|---|"]
            rows += [f"| `{k}` | {n:.1f} | {ms:.3f} |" for k, n, ms in r["lone_admission_kernels"][: result["top"]]]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--slots", type=int, default=32, help="requests kept running (max_num_seqs)")
    parser.add_argument("--requests", type=int, default=256, help="requests per method")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--spread", type=int, default=16, help="max_tokens spread over this many tokens")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--kernels", type=int, default=0,
                        help="CUDA: profile the kernels of this many steps that admit one request (left out of "
                             "the step timings, not of tokens/s)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="admission_probe_cpu")
    args = parser.parse_args(argv)
    prompts = encode_prompts(Tokenizer(args.target), json.loads((ROOT / "perf/prompts.json").read_text()))
    config = EngineConfig.from_dict({"target_path": args.target, "drafter_path": args.drafter, "device": args.device,
                                     "dtype": args.dtype, "max_num_seqs": str(args.slots), "max_tree_budget": "64",
                                     "max_model_len": str(max(map(len, prompts)) + args.max_tokens + 64),
                                     **dict(kv.split("=", 1) for kv in args.engine)})
    engine = Engine(config)
    engine.warm_up()
    result = {"header": header(), "top": args.top, "slots": args.slots, "requests": args.requests, "max_tokens": args.max_tokens,
              "spread": args.spread, "methods": {}}
    for method in tqdm(args.methods.split(","), desc="methods"):
        run_method(engine, prompts, method, argparse.Namespace(**{**vars(args), "requests": args.slots}))  # unmeasured
        result["methods"][method] = run_method(engine, prompts, method, args)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
