"""Throughput, time to first token and inter-token latency against concurrency, through Triton.

perf_analyzer over gRPC streaming against the ensemble, one server (continuous batching,
max_num_seqs = the largest concurrency), methods ar / dflash / ddtree-16 / auto (the budget
policy), concurrency 1, 2, 4, 8, 16, 32. Every request decodes exactly --max-tokens tokens.
Writes perf/results/<name>.{json,md,png}.

    python perf/concurrency_sweep.py --name concurrency_cpu --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from perf.common import ROOT, add_model_args, header, per_round_ms, write_results  # noqa: E402
from perf.triton_bench import (  # noqa: E402
    TritonServer,
    auto_arm_rounds,
    input_data,
    make_repository,
    model_stats,
    run_perf_analyzer,
    triton_stages,
    wait_stages,
)

METHODS = [("ar", 1, "ar"), ("dflash", 1, "dflash"), ("ddtree", 4, "ddtree-4"), ("ddtree", 16, "ddtree-16"),
           ("ddtree", 64, "ddtree-64"), ("auto", 64, "auto")]
DEFAULT_METHODS = "ar,dflash,ddtree-16,auto"


def summarize(requests: list[dict], max_tokens: int) -> dict:
    done = [r for r in requests if r["response_timestamps"]]
    start = min(r["timestamp"] for r in done)
    end = max(r["response_timestamps"][-1] for r in done)
    ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in done]
    itl = [((r["response_timestamps"][-1] - r["response_timestamps"][0]) / 1e6) / max(max_tokens - 1, 1) for r in done]
    return {"tokens_per_s": len(done) * max_tokens / ((end - start) / 1e9), "ttft_ms_p50": statistics.median(ttft),
            "ttft_ms_p99": sorted(ttft)[int(0.99 * (len(ttft) - 1))], "itl_ms_p50": statistics.median(itl),
            "num_requests": len(done)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in result["methods"].items():
        xs = sorted(int(c) for c in rows)
        ax.plot(xs, [rows[str(c)]["tokens_per_s"] for c in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['device']} {result['dtype']}, {result['max_tokens']} tokens/request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="concurrency_cpu")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join(n for _, _, n in METHODS)}")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="perf_analyzer's requests per measurement window = this x concurrency (at least 4): more, "
                             "longer windows, less spread between runs")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one unmeasured perf_analyzer run before each measured one (steady state, not start-up)")
    parser.add_argument("--gpus", default="", help="one engine replica per listed GPU, e.g. 0,1 (KIND_GPU instances)")
    args = parser.parse_args()
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    methods = [m for m in METHODS if m[2] in args.methods.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    config = EngineConfig(target_path=str(Path(args.target).resolve()), drafter_path=str(Path(args.drafter).resolve()),
                          device=args.device, dtype=args.dtype, max_tree_budget=64)
    prompts = json.loads((ROOT / "perf/prompts.json").read_text())
    result = {"header": header(), "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "target": config.target_path, "gpus": gpus, "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        repo = make_repository(config, workdir, {"max_num_seqs": str(max(levels)), "max_queue_size": "1024"}, gpus)
        with TritonServer(str(repo), log_path=str(workdir / "server.log")) as server:
            for mode, budget, name in methods:
                sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "mode": mode,
                            "tree_budget": budget}
                result["methods"][name] = {}
                for level in levels:
                    count = max(args.requests_per_stream * level, 4)
                    if args.warmup:   # unmeasured: captures of new batch shapes, auto's exploration at a new batch size
                        run_perf_analyzer(server, input_data(prompts, sampling), workdir, count, level)
                    stages, post = triton_stages(server.metrics_url), model_stats(server.http_url, "postprocessing")
                    arms = auto_arm_rounds(server.metrics_url)
                    requests = run_perf_analyzer(server, input_data(prompts, sampling), workdir, count, level)
                    entry = result["methods"][name][str(level)] = summarize(requests, args.max_tokens)
                    # where a round's time goes (engine stages, mean requests per round) and whether the postprocessing
                    # step (one execution per streamed response) queues
                    entry["stages"] = per_round_ms(stages, wait_stages(server.metrics_url, stages))
                    if mode == "auto":   # which arms auto ran (shares of its measured rounds)
                        ran = {arm: n - arms.get(arm, 0.0) for arm, n in auto_arm_rounds(server.metrics_url).items()}
                        total = sum(ran.values())
                        entry["auto_arms"] = {arm: n / total for arm, n in ran.items() if n > 0} if total else {}
                    after = model_stats(server.http_url, "postprocessing")
                    executions = max(after["count"] - post["count"], 1)
                    entry["postprocessing"] = {"executions": after["count"] - post["count"],
                                               "queue_ms": (after["queue_ns"] - post["queue_ns"]) / executions / 1e6,
                                               "compute_ms": (after["compute_ns"] - post["compute_ns"]) / executions / 1e6}
                    print(f"{name} c={level}: {entry}", flush=True)
                write(result, levels, args)      # after each method: a cut-off run keeps what it measured


def write(result: dict, levels: list[int], args) -> None:
    rows = ["| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, by_level in result["methods"].items():
        rows.append(f"| {name} tok/s | " + " | ".join(f"{by_level[str(c)]['tokens_per_s']:.1f}" for c in levels) + " |")
        rows.append(f"| {name} TTFT p50 ms | " + " | ".join(f"{by_level[str(c)]['ttft_ms_p50']:.0f}" for c in levels) + " |")
        rows.append(f"| {name} ITL p50 ms | " + " | ".join(f"{by_level[str(c)]['itl_ms_p50']:.1f}" for c in levels) + " |")
    rows += ["", "Per batch round (engine counters through Triton's metrics): mean requests / draft ms / verify ms / host ms / "
             "serve ms (engine thread outside steps); postprocessing (one execution per streamed response): queue ms / "
             "compute ms per execution.", "",
             "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, by_level in result["methods"].items():
        cells = []
        for c in levels:
            e = by_level[str(c)]
            st, pp = e.get("stages"), e.get("postprocessing")
            cells.append(f"{st['mean_batch']:.1f} / {st['draft_ms']:.1f} / {st['verify_ms']:.1f} / {st['host_ms']:.1f} / "
                         f"{st.get('serve_ms', float('nan')):.1f}; {pp['queue_ms']:.2f} / {pp['compute_ms']:.2f}"
                         if st and pp else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    autos = {name: by_level for name, by_level in result["methods"].items()
             if any("auto_arms" in by_level.get(str(c), {}) for c in levels)}
    if autos:
        rows += ["", "Arms `auto` ran (share of its batch rounds; ddtree_auto_arm_rounds_total):", "",
                 "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in autos.items():
            cells = []
            for c in levels:
                shares = sorted(by_level[str(c)].get("auto_arms", {}).items(), key=lambda item: -item[1])
                cells.append(", ".join(f"{arm} {share:.0%}" if share >= 0.005 else f"{arm} <1%" for arm, share in shares) or "-")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    write_results(Path(args.out), args.name, result, "\n".join(rows) + f"\n\n![tokens/s against concurrency]({args.name}.png)")
    plot(result, Path(args.out) / f"{args.name}.png")


if __name__ == "__main__":
    main()
