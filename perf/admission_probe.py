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

Each method first runs `--warm-requests` unmeasured (one wave of `--slots` by default; more lets `auto` explore the
batch sizes that spread arrivals pass through). The report also gives `auto`'s choices by batch size, the steps whose
round ran `ar` apart from its probes of other arms, the slowest steps (arm, batch, admissions) and the static programs
made inside the measured run; `--profile-slow MS` runs every step under cProfile (slower) and keeps the functions of
those over MS. `--turns N` runs the methods N times, every other turn in reverse order (a later run on the same engine
and machine can be slower or faster for reasons of its own), and reports each method's tokens/s over the first one's
by turn and their median: the ratio to trust; the step tables are the first turn's.

    python perf/admission_probe.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \\
        --drafter models/smollm2-shaped-dflash --methods ar,auto --name admission_probe_h200
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
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
from ddtree.serving import StallWatch  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.batch_rounds import spread_cut  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, frozen_heap, header, write_results  # noqa: E402
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
    # one profiler at a time on a thread: with --profile-slow the steps' own profiles replace the prefill's
    settle, prefill = Timed(engine._settle_ahead), Timed(engine._prefill, None if args.profile_slow else profile)
    engine._settle_ahead, engine._prefill = settle, prefill
    selector = getattr(engine, "arm_selector", None)
    chosen: dict[str, dict[str, int]] = {}   # auto's choices: batch-size bucket -> arm -> rounds
    if selector is not None:
        choose = selector.choose

        def counted(num_seqs: int, *rest):
            arm = choose(num_seqs, *rest)
            by_arm = chosen.setdefault(selector.label(selector.bucket(num_seqs)), {})
            by_arm[arm.name] = by_arm.get(arm.name, 0) + 1
            return arm

        selector.choose = counted
    count = traced_steps = 0
    slow_profiles: list[dict] = []
    collections = StallWatch()   # the garbage collector's time and full collections (the served model's counters)

    def add() -> None:
        nonlocal count
        max_tokens = args.max_tokens - spread_cut(count, args.spread)
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
        rounds0, dynamic0 = engine.stage_times.batch_rounds, engine.stage_times.dynamic_forwards
        late0 = len(engine.graphs.late_keys)
        start = time.perf_counter()
        while engine.has_work:
            admitted = min(len(engine.waiting), len(engine.free_slots))
            n_settle, n_prefill = len(settle.calls), len(prefill.calls)
            traced = args.kernels and admitted == 1 and traced_steps < args.kernels
            rounds, dynamic = engine.stage_times.batch_rounds, engine.stage_times.dynamic_forwards
            gc_before = collections.before()
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
            elif args.profile_slow:   # every step under its own profile, kept for the slow ones (a diagnostic)
                step_profile = cProfile.Profile()
                step_profile.enable()
                outputs = engine.step()
                step_profile.disable()
            else:
                outputs = engine.step()
            wall = time.perf_counter() - t0
            if args.profile_slow and not traced and 1e3 * wall > args.profile_slow:
                stats = pstats.Stats(step_profile).stats
                slow_profiles.append({"ms": 1e3 * wall, "functions": sorted(
                    ((f"{Path(f).name}:{line}:{name}", 1e3 * cum) for (f, line, name), (_, _, _, cum, _) in stats.items()),
                    key=lambda item: -item[1])[: args.top]})
            settled = sum(settle.calls[n_settle:])
            prefilled = sum(prefill.calls[n_prefill:]) if admitted else 0.0
            if not traced:
                arm = None   # no round in the step (all its requests admitted in it)
                if engine.stage_times.batch_rounds > rounds:
                    # auto's arm of the round, or the method itself (a fixed method's rounds are its own)
                    arm = engine.arm.name if mode == "auto" and getattr(engine, "arm", None) is not None else mode
                steps.append({"admitted": admitted, "ms": 1e3 * wall, "settle_ms": 1e3 * settled, "arm": arm,
                              "batch": len(engine.running), "late": len(engine.graphs.late_keys) - late0,
                              "dynamic": engine.stage_times.dynamic_forwards - dynamic,
                              "gc_ms": 1e3 * (collections.gc_seconds - gc_before[0]),
                              "full_gcs": collections.full_gcs - gc_before[1],
                              "prefill_ms": 1e3 * prefilled, "rest_ms": 1e3 * (wall - settled - prefilled)})
            for output in outputs:
                tokens += len(output.new_token_ids)
                if output.is_finished and count < args.requests:
                    add()
        seconds = time.perf_counter() - start
    finally:
        collections.close()
        del engine._settle_ahead, engine._prefill
        if selector is not None:
            del selector.choose
    admitting = [s for s in steps if s["admitted"]]
    decoding = [s for s in steps if not s["admitted"]]
    prefills = len(admitting)
    on_ar = [s for s in decoding if s["arm"] == "ar"]
    admitting_ar = [s for s in admitting if s["arm"] == "ar"]

    def mean(rows: list[dict], key: str) -> float:
        return statistics.fmean(r[key] for r in rows) if rows else 0.0

    try:
        stats = pstats.Stats(profile).stats
    except TypeError:   # nothing profiled (--profile-slow)
        stats = {}
    functions = sorted(((f"{Path(f).name}:{name}" if f != "~" else name, cum) for (f, line, name), (_, _, _, cum, _)
                        in stats.items()), key=lambda item: -item[1])
    by_size: dict[int, list[float]] = {}
    for s in admitting:
        by_size.setdefault(s["admitted"], []).append(s["prefill_ms"])
    arms = {k: v - arms0.get(k, 0) for k, v in engine.stage_times.auto_arm_rounds.items() if v > arms0.get(k, 0)}
    lone = []
    if traced_steps:
        lone = [(k, n / traced_steps, ms / traced_steps) for k, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    return {"tokens_per_s": tokens / seconds, "arms": arms, "arms_by_batch": chosen, "lone_admission_kernels": lone,
            "seconds": seconds, "steps": len(steps),
            "batch_rounds": engine.stage_times.batch_rounds - rounds0,
            # drafter passes and verifies that no static program took (static forwards on): the dynamic forwards
            "dynamic": engine.stage_times.dynamic_forwards - dynamic0,
            "admitting": {"steps": len(admitting), "requests": sum(s["admitted"] for s in admitting),
                          **{k: mean(admitting, k) for k in ("ms", "settle_ms", "prefill_ms", "rest_ms")}},
            "decoding": {"steps": len(decoding), **{k: mean(decoding, k) for k in ("ms", "settle_ms", "rest_ms")}},
            # the steps whose round ran `ar` (auto's probes of other arms left out): what `auto` on `ar` costs
            "decoding_on_ar": {"steps": len(on_ar), "ms": mean(on_ar, "ms")},
            "admitting_on_ar": {"steps": len(admitting_ar), "ms": mean(admitting_ar, "ms")},
            "no_round_steps": sum(s["arm"] is None for s in steps),   # steps that only admitted (nobody decoding)
            # the garbage collector's time in the steps, and its full collections (the heap is frozen first, as the
            # served model does, unless --no-freeze-heap)
            "gc_ms": sum(s["gc_ms"] for s in steps), "full_gcs": sum(s["full_gcs"] for s in steps),
            # the slowest steps, and the static programs made inside the measured run (compiled, captured on CUDA)
            "slowest_steps": sorted(steps, key=lambda s: -s["ms"])[:8],
            "late_programs": [repr(k) for k in engine.graphs.late_keys[late0:]], "slow_profiles": slow_profiles,
            "prefill_ms_by_group": {str(k): statistics.fmean(v) for k, v in sorted(by_size.items())},
            "prefill_functions_us": [(name, 1e6 * cum / max(prefills, 1)) for name, cum in functions[: args.top]]}


def turn_ratios(turns: list[dict], methods: list[str]) -> dict[str, dict]:
    """Each method's tokens/s over the first method's, per turn (measured side by side) and their median and worst."""
    out = {}
    for method in methods[1:]:
        ratios = [t[method]["tokens_per_s"] / t[methods[0]]["tokens_per_s"] for t in turns]
        out[method] = {"by_turn": ratios, "median": statistics.median(ratios), "worst": min(ratios)}
    return out


def turns_table(result: dict) -> list[str]:
    """The turns' tokens/s and ratios (empty for one turn)."""
    turns = result.get("turns", [])
    if len(turns) < 2:
        return []
    methods = list(turns[0])
    first = methods[0]
    rows = [f"Turns (every other one in reverse order, each after its own warm-up requests): tokens/s, and over `{first}`'s "
            "in the same turn; ms of the decoding and admitting steps whose round ran `ar`.", "",
            "| turn | " + " | ".join(methods) + " | " + " | ".join(f"{m} / {first}" for m in methods[1:])
            + " | decoding ms on ar | admitting ms on ar |", "|---|" + "---|" * (2 * len(methods) + 1)]
    for i, t in enumerate(turns, start=1):
        rows.append(f"| {i} | " + " | ".join(f"{t[m]['tokens_per_s']:.0f}" for m in methods) + " | "
                    + " | ".join(f"{t[m]['tokens_per_s'] / t[first]['tokens_per_s']:.3f}" for m in methods[1:]) + " | "
                    + " / ".join(f"{t[m]['decoding_on_ar_ms']:.2f}" for m in methods) + " | "
                    + " / ".join(f"{t[m]['admitting_on_ar_ms']:.2f}" for m in methods) + " |")
    rows.append("")
    for method, r in result["ratios"].items():
        rows.append(f"{method} / {first}: median turn **{r['median']:.3f}**, worst {r['worst']:.3f}")
    for method in methods:
        arms = [", ".join(f"{k} {v}" for k, v in t[method]["arms"].items()) for t in turns if t[method]["arms"]]
        if arms:
            rows.append(f"{method}: arms of its rounds by turn: " + "; ".join(arms))
    return rows + [""]


def table(result: dict) -> str:
    rows = turns_table(result)
    rows += ["Steps that admit requests (their settle of queued `ar` steps / prefill / the rest: the decoding round of the "
            "others and the releases) against steps that only decode; mean ms.", "",
            "| method | tok/s | admitting steps (requests) | admitting ms = settle + prefill + rest | decoding steps | "
            "decoding ms = settle + rest | share of the time in admitting steps |", "|---|---|---|---|---|---|---|"]
    for method, r in result["methods"].items():
        a, d = r["admitting"], r["decoding"]
        share = a["steps"] * a["ms"] / max(a["steps"] * a["ms"] + d["steps"] * d["ms"], 1e-9)
        rows.append(f"| {method} | {r['tokens_per_s']:.0f} | {a['steps']} ({a['requests']}) | {a['ms']:.2f} = "
                    f"{a['settle_ms']:.2f} + {a['prefill_ms']:.2f} + {a['rest_ms']:.2f} | {d['steps']} | {d['ms']:.2f} = "
                    f"{d['settle_ms']:.2f} + {d['rest_ms']:.2f} | {share:.0%} |")
    rows += ["", "The same on the steps whose round ran `ar` (`auto`'s probes of other arms left out): mean ms.", "",
             "| method | admitting steps | admitting ms | decoding steps | decoding ms |", "|---|---|---|---|---|"]
    for method, r in result["methods"].items():
        a, d = r["admitting_on_ar"], r["decoding_on_ar"]
        rows.append(f"| {method} | {a['steps']} | {a['ms']:.2f} | {d['steps']} | {d['ms']:.2f} |")
    for method, r in result["methods"].items():
        sizes = ", ".join(f"{k}: {v:.2f}" for k, v in r["prefill_ms_by_group"].items())
        rows += ["", f"{method}: prefill ms by requests admitted together: {sizes}", "",
                 f"{method}: the prefill's functions by cumulative time (us per prefill, cProfile)", "",
                 "| function | us |", "|---|---|"]
        rows += [f"| `{name}` | {us:.0f} |" for name, us in r["prefill_functions_us"]]
        if r["arms"]:
            rows += ["", f"{method}: arms of its rounds: " + ", ".join(f"{k} {v}" for k, v in r["arms"].items())]
            probes = {size: arms for size, arms in r.get("arms_by_batch", {}).items() if set(arms) != {"ar"}}
            if probes:
                rows += ["", f"{method}: its choices off `ar` by batch size: " + "; ".join(
                    f"{size}: " + ", ".join(f"{k} {v}" for k, v in sorted(arms.items())) for size, arms in probes.items())]
        rows += ["", f"{method}: its slowest steps: " + "; ".join(
            f"{st['ms']:.1f} ms = settle {st['settle_ms']:.1f} + prefill {st['prefill_ms']:.1f} + rest {st['rest_ms']:.1f} "
            f"({st['arm']}, {st['batch']} running, {st['admitted']} admitted, programs made by then: "
            f"{st['late']}, dynamic forwards {st.get('dynamic', 0)}, garbage collection {st['gc_ms']:.1f} ms, "
            f"{st['full_gcs']} full)" for st in r["slowest_steps"]),
            "", f"{method}: garbage collection in the measured steps: {r['gc_ms']:.1f} ms, {r['full_gcs']} full "
            f"collections (heap frozen after warm-up: {result['freeze_heap']})", "",
            f"{method}: drafter passes and verifies run by the dynamic forward (no static program fitted): "
            f"{r.get('dynamic', 0)}", "",
            f"{method}: static programs made inside the measured run: {len(r['late_programs'])}"
            + (" (" + ", ".join(r["late_programs"][:12]) + ")" if r["late_programs"] else "")]
        for slow in r.get("slow_profiles", [])[:4]:
            rows += ["", f"{method}: a step of {slow['ms']:.1f} ms (--profile-slow, every step profiled): its functions by "
                     "cumulative ms", "", "| function | ms |", "|---|---|"]
            rows += [f"| `{name}` | {ms:.1f} |" for name, ms in slow["functions"]]
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
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="each method's unmeasured run before its measured one, in requests (default --slots: "
                             "one wave); more lets `auto` explore the batch sizes of spread arrivals before it is measured")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--kernels", type=int, default=0,
                        help="CUDA: profile the kernels of this many steps that admit one request (left out of "
                             "the step timings, not of tokens/s)")
    add_freeze_heap_arg(parser)
    parser.add_argument("--profile-slow", type=float, default=0.0, metavar="MS",
                        help="a diagnostic: every step under cProfile (slower), the functions of steps over MS kept")
    parser.add_argument("--turns", type=int, default=1,
                        help="run the methods this many times, every other turn in reverse order; tokens/s over the "
                             "first method's by turn")
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
    result = {"header": header(), "top": args.top, "slots": args.slots, "requests": args.requests,
              "warm_requests": args.warm_requests or args.slots, "max_tokens": args.max_tokens,
              "freeze_heap": args.freeze_heap,
              "spread": args.spread, "methods": {}, "turns": []}
    methods = args.methods.split(",")
    warm_args = argparse.Namespace(**{**vars(args), "requests": args.warm_requests or args.slots, "kernels": 0})
    later_args = argparse.Namespace(**{**vars(args), "kernels": 0})   # kernels are traced in the first turn only
    with frozen_heap(args.freeze_heap):
        for turn in tqdm(range(max(1, args.turns)), desc="turns"):
            measured = {}
            for method in tqdm(methods if turn % 2 == 0 else methods[::-1], desc="methods", leave=False):
                run_method(engine, prompts, method, warm_args)
                measured[method] = run_method(engine, prompts, method, args if turn == 0 else later_args)
            if turn == 0:
                result["methods"] = measured
            result["turns"].append({m: {"tokens_per_s": r["tokens_per_s"], "arms": r["arms"],
                                        "decoding_on_ar_ms": r["decoding_on_ar"]["ms"],
                                        "admitting_on_ar_ms": r["admitting_on_ar"]["ms"]} for m, r in measured.items()})
        result["ratios"] = turn_ratios(result["turns"], methods)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
