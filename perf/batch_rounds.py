"""Batched rounds in process: N requests decoded together, each method's cost per batch round by stage.

Issue 4's sweep through Triton found `auto`'s rounds dearer than `ar`'s at large batches even when it ran `ar`
(c=16: host 1.6 vs 1.0 ms per round). This takes the server out: the engine alone, `--concurrency` requests added
at once (prefill, then decoding rounds until all finish), each method in turn on one engine, with the stage times
per batch round (draft, verify and its GPU timeline, commit, host) and the arms `auto` ran. `--profile DIR` writes a
PyTorch profile (operator table, by self CPU and by CUDA time) of `--profile-steps` rounds of each method after
`--profile-skip`.

    python perf/batch_rounds.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \\
        --drafter models/smollm2-shaped-dflash --concurrency 16 --methods ar,auto --name batch_rounds_h200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, frozen_heap, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402

STAGES = ("draft", "verify", "verify_gpu", "commit", "host", "decode")


def params_for(name: str, max_tokens: int) -> SamplingParams:
    mode, _, budget = name.partition("-")
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=mode, tree_budget=int(budget or 16), seed=0)


def snapshot(engine: Engine) -> dict:
    t = engine.stage_times
    return {"batch_rounds": t.batch_rounds, "rounds": t.rounds, **{k: getattr(t, k) for k in STAGES},
            "arms": dict(t.auto_arm_rounds)}


def spread_cut(index: int, spread: int) -> int:
    """How many tokens request `index` asks less than max_tokens under a spread (the same every run and script)."""
    return random.Random(index).randint(0, spread)


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams, profile=None, total: int = 0,
              spread: int = 0, concurrency: int = 0) -> dict:
    """All prompts added at once, stepped until every request finishes: tokens/s and the stage deltas. total (more
    than the prompts): as many requests kept running, each one that finished replaced before the next step by the
    next prompt (cycling) until `total` were added, as a closed loop's streams arrive (perf_analyzer's, without the
    client's turnaround): admissions and prefills among the decoding rounds, which requests added at once pay once.
    spread: request i asks max_tokens less 0..spread (random.Random(i), the same every run), so that requests finish,
    and the next ones arrive, on different rounds, as in a served load (perf/admission_probe.py's spread).
    concurrency (fewer than the prompts): that many running at once, the prompts taken in order (perf/auto_trace.py)."""
    requests: list[Request] = []

    def add() -> Request:
        index = len(requests)
        cut = spread_cut(index, spread) if spread else 0
        request = Request(request_id=f"b{index}", prompt_ids=list(prompts[index % len(prompts)]),
                          params=dataclasses.replace(params, max_tokens=max(1, params.max_tokens - cut)) if cut else params)
        requests.append(request)
        engine.add(request)
        return request

    running = min(concurrency, len(prompts)) if concurrency else len(prompts)
    live = [add() for _ in range(running)]
    total = max(total, len(prompts))
    before, start = snapshot(engine), time.perf_counter()
    while engine.has_work:
        engine.step()
        if profile is not None:
            profile.step()
        if len(requests) < total:
            live = [r for r in live if r.finish_reason is None]
            while len(live) < running and len(requests) < total:
                live.append(add())
    seconds = time.perf_counter() - start
    after = snapshot(engine)
    rounds = after["batch_rounds"] - before["batch_rounds"]
    tokens = sum(r.num_output_tokens for r in requests)
    arms = {k: v - before["arms"].get(k, 0) for k, v in after["arms"].items() if v - before["arms"].get(k, 0)}
    return {"tokens_per_s": tokens / seconds, "num_tokens": tokens, "num_requests": len(requests), "seconds": seconds,
            "batch_rounds": rounds,
            "mean_acceptance": sum(sum(r.acceptance_lengths) for r in requests)
            / max(sum(len(r.acceptance_lengths) for r in requests), 1),
            "ms_per_round": {k: 1e3 * (after[k] - before[k]) / max(rounds, 1) for k in STAGES},
            "arms": arms}


def profiled(engine: Engine, prompts, params, out: Path, name: str, skip: int, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=skip, warmup=1, active=steps, repeat=1)) as prof:
        result = run_batch(engine, prompts, params, profile=prof)
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    text = (f"{name}: {steps} batch rounds after {skip + 1}\n\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
            + "\n\n" + prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(text)
    del torch
    return result


def table(result: dict) -> str:
    lines = [f"{result['concurrency']} requests x {result['max_tokens']} tokens, all added at once; ms per batch round:",
             "", "| method | tok/s | vs ar | batch rounds | tokens per request round | draft | verify (GPU) | commit | "
             "host | round | auto's arms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = result["methods"].get("ar", {}).get("tokens_per_s")
    for name, r in result["methods"].items():
        ms = r["ms_per_round"]
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        arms = ", ".join(f"{k} {v}" for k, v in sorted(r["arms"].items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ratio} | {r['batch_rounds']} | {r['mean_acceptance']:.2f} | "
                     f"{ms['draft']:.2f} | {ms['verify']:.2f} ({ms['verify_gpu']:.2f}) | {ms['commit']:.2f} | "
                     f"{ms['host']:.2f} | {ms['decode']:.2f} | {arms} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--methods", default="ar,auto", help="comma-separated: ar, dflash, auto, ddtree-<budget>")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="batches per method; the first one unmeasured")
    parser.add_argument("--profile", default="", help="a directory for one profiled batch per method")
    parser.add_argument("--profile-skip", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="batch_rounds_cpu")
    add_freeze_heap_arg(parser)
    args = parser.parse_args(argv)
    texts = json.loads((ROOT / "perf/prompts.json").read_text())
    base = encode_prompts(Tokenizer(args.target), texts)
    prompts = [base[i % len(base)] for i in range(args.concurrency)]
    methods = args.methods.split(",")
    budgets = [int(m.partition("-")[2]) for m in methods if m.startswith("ddtree-")]
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_num_seqs=args.concurrency, max_tree_budget=max(budgets + [64]),
                          max_model_len=max(map(len, prompts)) + args.max_tokens + 64)
    engine = Engine(config)
    engine.warm_up()
    result = {"header": header(), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "freeze_heap": args.freeze_heap, "methods": {}}
    with frozen_heap(args.freeze_heap):
        for name in tqdm(methods, desc="methods"):
            params = params_for(name, args.max_tokens)
            runs = [run_batch(engine, prompts, params) for _ in range(max(args.repeats, 2))][1:]
            best = max(runs, key=lambda r: r["tokens_per_s"])   # the least disturbed of the measured batches
            result["methods"][name] = best | {"all_tokens_per_s": [r["tokens_per_s"] for r in runs]}
            if args.profile:
                profiled(engine, prompts, params, Path(args.profile), f"{args.name}_{name}", args.profile_skip,
                         args.profile_steps)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
