"""Every round `auto` runs, in process: its arm, tokens, seconds and whether it was a catch-up, against `ar` alone.

Issue 4's sweep with the trained drafter through Triton on the H100 (concurrency_h100_trained_low.md) found `auto` at
0.85x `ar` at one stream (median of 3 runs; 0.64 in the first), its first runs spending 73% and 32% of their time on
drafting arms although no prompt of the sweep pays for drafting there on average (`ddtree-8` accepts 1.3-2.6 tokens a
round on them, fp32 CPU, below the ~2.9 a 3 ms drafting round needs against a 1.07 ms `ar` round). The sweep's metrics
say how long each arm ran, not when and why. This runs the sweep's prompts (chat-templated as Triton's preprocessing
does), one after another or `--concurrency` at a time, on one engine: `ar` alone, then `auto` for `--passes` passes
over the prompts, and records every `ArmSelector.record` call: per arm its rounds, time share, measured tokens/s, ms a
round, catch-up rounds and their time; the switches between arms; the run-length sequence of arms; and per pass the
tokens/s against `ar`'s. `--summarise FILE` makes the same table from a served model's DDTREE_AUTO_TRACE file
(ddtree.profiling.ArmTrace; inside Triton the model's process inherits the server's environment), one row per run.
`--replay FILE --rounds A:B` runs the trace's rounds through a fresh ArmSelector (this checkout's) and prints rounds A
to B: each round's batch size, arm, tokens, ms and the gap before it, then every measured arm's rate in that batch
size's bucket after it (tokens/s a request) and the arms whose re-probes back off; a round where the replay chose
another arm than the trace (a different selector, or a round that made programs, which the trace does not mark) is
marked, and the trace's arm is recorded. With the selector the trace was made with, the estimates are those the served
engine chose on (perf/results/traces/ holds the traces, gzipped: either form is read).

    python perf/auto_trace.py --device cuda --dtype bfloat16 --passes 3 --name auto_trace_h100
    DDTREE_AUTO_TRACE=/tmp/trace python perf/concurrency_sweep.py ... --concurrency 1
    python perf/auto_trace.py --summarise /tmp/trace/auto_trace_<pid>.jsonl --name auto_trace_triton_c1
    python perf/auto_trace.py --replay perf/results/traces/auto_trace_h100_reentry_triton.jsonl.gz --rounds 9360:9380
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.budget import AR, DEFAULT_ARMS, Arm, ArmSelector, parse_arms  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.profiling import ArmTrace  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf import batch_rounds  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, frozen_heap, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402


def summary(rows: list[tuple]) -> dict:
    """ArmTrace rows (arm, batch size, tokens, seconds, catch-up, time): per arm its rounds, tokens, time and time share,
    measured tokens/s, ms a round and catch-ups; the switches between arms and the run-length sequence of arms."""
    arms: dict[str, dict] = defaultdict(lambda: {"rounds": 0, "tokens": 0, "seconds": 0.0, "catch_ups": 0,
                                                 "catch_up_seconds": 0.0})
    for name, _, tokens, seconds, catching_up, _ in rows:
        a = arms[name]
        a["rounds"] += 1
        a["tokens"] += tokens
        a["seconds"] += seconds
        a["catch_ups"] += catching_up
        a["catch_up_seconds"] += seconds if catching_up else 0.0
    total = sum(a["seconds"] for a in arms.values()) or 1e-9
    for a in arms.values():
        a["time_share"] = a["seconds"] / total
        a["tokens_per_s"] = a["tokens"] / a["seconds"] if a["seconds"] else 0.0
        a["ms_per_round"] = 1e3 * a["seconds"] / a["rounds"]
    runs = [(name, len(list(group))) for name, group in itertools.groupby(r[0] for r in rows)]
    return {"arms": dict(arms), "switches": len(runs) - 1, "rounds": len(rows), "sequence": runs}


def read_trace(path: Path) -> list[tuple]:
    """A DDTREE_AUTO_TRACE file's rows (ArmTrace.FIELDS), plain or gzipped."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [tuple(row[f] for f in ArmTrace.FIELDS) for row in map(json.loads, text.splitlines()) if row]


def replay(rows: list[tuple], arms: str = DEFAULT_ARMS, chain_nodes: int = 15,
           max_budget: int | None = None) -> list[dict]:
    """The trace's rounds through a fresh ArmSelector: per round the replay's choice, whether it was the trace's (if
    not, the trace's arm is recorded in its place), and after the record the bucket's rates and back-offs."""
    selector = ArmSelector(parse_arms(arms), chain_nodes=chain_nodes)
    out = []
    for name, num_seqs, tokens, seconds, catch_up, when in rows:
        chose, traced = selector.choose(num_seqs, max_budget), Arm.parse(name)
        idle_policy = chose.mode == "policy" and traced == AR   # a policy round that drafted for nobody: credited to ar
        matched = chose == traced or idle_policy
        if not matched:
            selector.last, selector.catching_up, chose = traced, catch_up, traced
        selector.record(num_seqs, chose, tokens, seconds, drafted=not idle_policy)
        b = selector.bucket(num_seqs)
        out.append({"arm": name, "num_seqs": num_seqs, "tokens": tokens, "ms": 1e3 * seconds, "catch_up": catch_up,
                    "time": when, "matched": matched,
                    "rates": {a.name: round(selector.rate(b, a)) for a in selector.arms if selector.samples[(b, a)]},
                    "backoff": {a.name: selector.misses[(b, a)] for a in selector.arms if selector.misses[(b, a)]}})
    return out


def print_replay(rounds: list[dict], first: int, last: int) -> None:
    print(f"{sum(not r['matched'] for r in rounds)} of {len(rounds)} rounds chosen otherwise by this selector")
    for i in range(max(first, 0), min(last, len(rounds))):
        r = rounds[i]
        gap = 1e3 * (r["time"] - r["ms"] / 1e3 - rounds[i - 1]["time"]) if i else 0.0
        print(f"{i:6d} {r['num_seqs']:3d} {r['arm']:>9} {r['tokens']:3d} {r['ms']:8.2f} ms"
              + (f" (after {gap:.1f} ms idle)" if gap > 5 else "") + (" catch-up" if r["catch_up"] else "")
              + ("" if r["matched"] else " REPLAY CHOSE OTHERWISE")
              + f"  rates {r['rates']}" + (f" backoff {r['backoff']}" if r["backoff"] else ""))


def runs_of(path: Path, gap_s: float) -> list[list[tuple]]:
    """A DDTREE_AUTO_TRACE file's rows, split where the engine idled over gap_s (between a sweep's runs)."""
    rows = read_trace(path)
    runs: list[list[tuple]] = []
    for row in rows:
        if not runs or row[5] - runs[-1][-1][5] > gap_s + row[3]:
            runs.append([])
        runs[-1].append(row)
    return runs


def summarise(path: Path, gap_s: float, out: Path, name: str) -> dict:
    runs = [{"batch_sizes": sorted({r[1] for r in rows}), **summary(rows)} for rows in runs_of(path, gap_s)]
    lines = [f"`auto`'s rounds from `{path.name}` (DDTREE_AUTO_TRACE), split into runs at idle gaps over {gap_s} s:", "",
             "| run | rounds | batch sizes | switches | catch-ups (ms) | time share by arm (tokens/s it measured, ms a round) |",
             "|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        sizes = run["batch_sizes"]
        lines.append(f"| {i} | {run['rounds']} | {sizes[0]}-{sizes[-1]} | {run['switches']} | {arms_cells(run)} |")
    result = {"header": header(), "trace": str(path), "gap_s": gap_s, "runs": runs}
    write_results(out, name, result, "\n".join(lines))
    return result


def arms_cells(run: dict) -> str:
    """'catch-ups (ms) | time share by arm' of a summary()."""
    arms = sorted(run["arms"].items(), key=lambda kv: -kv[1]["seconds"])
    shares = ", ".join(f"{n} {100 * a['time_share']:.0f}% ({a['tokens_per_s']:.0f}, {a['ms_per_round']:.2f})"
                       for n, a in arms)
    catch = sum(a["catch_ups"] for a in run["arms"].values())
    catch_ms = 1e3 * sum(a["catch_up_seconds"] for a in run["arms"].values())
    return f"{catch} ({catch_ms:.0f}) | {shares}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_freeze_heap_arg(parser)
    parser.add_argument("--prompts", default=str(ROOT / "perf/prompts.json"), help="the concurrency sweep's by default")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--passes", type=int, default=3, help="auto's passes over the prompts (one trace)")
    parser.add_argument("--tree-budget", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="auto_trace_cpu")
    parser.add_argument("--summarise", metavar="JSONL", help="summarise a DDTREE_AUTO_TRACE file instead (a served "
                        "model's, e.g. inside Triton during a sweep), one row per run")
    parser.add_argument("--gap", type=float, default=1.0, help="--summarise: an idle gap over this many seconds "
                        "starts a new run")
    parser.add_argument("--replay", metavar="JSONL", help="replay a DDTREE_AUTO_TRACE file through this checkout's "
                        "ArmSelector and print --rounds")
    parser.add_argument("--rounds", default="0:50", metavar="A:B", help="--replay: the rounds to print")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="--replay: the served model's auto_arms")
    parser.add_argument("--max-budget", type=int, default=None, help="--replay: the auto requests' largest tree_budget")
    args = parser.parse_args(argv)
    if args.summarise:
        return summarise(Path(args.summarise), args.gap, Path(args.out), args.name)
    if args.replay:
        first, last = (int(x) for x in args.rounds.split(":"))
        rounds = replay(read_trace(Path(args.replay)), args.arms, max_budget=args.max_budget)
        print_replay(rounds, first, last)
        return {"rounds": rounds}
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_num_seqs=args.concurrency, max_tree_budget=64)
    engine = Engine(config)
    engine.warm_up()
    prompts = encode_prompts(Tokenizer(args.target), json.loads(Path(args.prompts).read_text()))

    def params(mode: str) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, mode=mode, tree_budget=args.tree_budget)

    def serve(mode: str, prompts: list[list[int]]) -> tuple[int, float]:
        """The prompts, args.concurrency at a time, in order (each finished one replaced at once): (tokens, s), each
        request's first token (its prefill's: no round of `auto` records it) counted."""
        done = batch_rounds.run_batch(engine, prompts, params(mode), concurrency=args.concurrency)
        return done["num_tokens"], done["seconds"]

    with frozen_heap(args.freeze_heap):
        serve("ar", prompts[:1])   # unmeasured: the first request's one-off work
        tokens, seconds = serve("ar", prompts)
        ar = tokens / seconds
        rows = ArmTrace(engine.arm_selector).rows
        passes = []
        for p in range(args.passes):
            first = len(rows)
            tokens, seconds = serve("auto", prompts)
            passes.append({"tokens_per_s": tokens / seconds, "over_ar": tokens / seconds / ar, "tokens": tokens,
                           "requests": len(prompts), **summary(rows[first:])})
            print(f"auto pass {p + 1}: {tokens / seconds:.1f} tok/s ({tokens / seconds / ar:.2f}x ar)", flush=True)
    result = {"header": header(), "device": args.device, "dtype": args.dtype, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "ar_tokens_per_s": ar, "passes": passes, "whole": summary(rows),
              # every round: arm, tokens, ms, whether it was a switching round (a catch-up, or `ar`'s re-entry)
              "rounds": [[name, tokens, round(1e3 * seconds, 3), catch_up] for name, _, tokens, seconds, catch_up, _ in rows]}
    lines = [f"`ar`: {ar:.1f} tok/s ({len(prompts)} prompts, {args.max_tokens} tokens each, {args.concurrency} at a "
             "time). `auto` by pass over the same prompts (one engine, so a pass starts from what the ones before "
             "it measured):", "",
             "| pass | tok/s | / ar | switches | catch-ups (ms) | time share by arm (tokens/s it measured, ms a round) |",
             "|---|---|---|---|---|---|"]
    for i, p in enumerate(passes, 1):
        lines.append(f"| {i} | {p['tokens_per_s']:.1f} | {p['over_ar']:.2f} | {p['switches']} | {arms_cells(p)} |")
    lines += ["", "Arms in the order `auto` ran them (arm x rounds in a row), each pass:", ""]
    for i, p in enumerate(passes, 1):
        lines.append(f"- pass {i}: " + " ".join(f"{n}x{k}" for n, k in p["sequence"]))
    write_results(Path(args.out), args.name, result, "\n".join(lines))
    return result


if __name__ == "__main__":
    main()
