"""Throughput, time to first token and inter-token latency against concurrency, through Triton.

perf_analyzer over gRPC streaming against the ensemble, one server (continuous batching,
max_num_seqs = the largest concurrency), methods ar / dflash / ddtree-16 / auto (the budget
policy), concurrency 1, 2, 4, 8, 16, 32. Every request decodes exactly --max-tokens tokens.
At each concurrency the methods are measured in turns, --repeats times (a method's point is its median run), and
`auto`'s throughput is compared run by run with the best other method's of the same turn. `ar-again` runs `ar` a second
time in each turn (an A/A control): its ratio to `ar` is the spread of two identical methods measured this way, what
`auto`'s ratio must be read against.
Writes perf/results/<name>.{json,md,png}.

    python perf/concurrency_sweep.py --name concurrency_cpu --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from perf.common import ROOT, add_model_args, header, per_round_ms, write_results  # noqa: E402
from perf.triton_bench import (  # noqa: E402
    REQUEST_HISTOGRAMS,
    TritonServer,
    auto_arms,
    input_data,
    make_repository,
    model_stats,
    request_split,
    request_sums,
    run_perf_analyzer,
    scrape_metrics,
    triton_stages,
    wait_stages,
)

METHODS = [("ar", 1, "ar"), ("dflash", 1, "dflash"), ("ddtree", 4, "ddtree-4"), ("ddtree", 16, "ddtree-16"),
           ("ddtree", 64, "ddtree-64"), ("auto", 64, "auto"), ("ar", 1, "ar-again"), ("ar", 1, "ar-alone")]
CONTROL = "ar-again"   # `ar` measured twice a turn: not a method `auto` is compared with
ALONE = "ar-alone"     # `ar` through the generation model alone (the prompt as text: no pre- or postprocessing step)
DEFAULT_METHODS = "ar,dflash,ddtree-16,auto"
LATE = "ddtree_static_programs_late_total"
# the sending thread's time (the outbox in process; with engine_process the stub's relay): per second of a run
SENDER = {"send_s": "ddtree_response_send_seconds_total", "check_s": "ddtree_cancel_check_seconds_total",
          "checks": "ddtree_cancel_checks_total", "responses": "ddtree_responses_total",
          "publish_s": "ddtree_metrics_publish_seconds_total"}
GENERATION_MODEL = "ddtree"
# stalled steps and garbage collection (ddtree.serving.StallWatch): counters read before and after each run
STALLS = {"slow_steps": "ddtree_slow_steps_total", "slow_step_s": "ddtree_slow_step_seconds_total",
          "gc_s": "ddtree_gc_seconds_total", "full_gcs": "ddtree_gc_full_collections_total",
          "dynamic": "ddtree_dynamic_forwards_total"}


def summarize(requests: list[dict], max_tokens: int) -> dict:
    done = [r for r in requests if r["response_timestamps"]]
    start = min(r["timestamp"] for r in done)
    end = max(r["response_timestamps"][-1] for r in done)
    ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in done]
    itl = [((r["response_timestamps"][-1] - r["response_timestamps"][0]) / 1e6) / max(max_tokens - 1, 1) for r in done]
    return {"tokens_per_s": len(done) * max_tokens / ((end - start) / 1e9), "ttft_ms_p50": statistics.median(ttft),
            "ttft_ms_p99": sorted(ttft)[int(0.99 * (len(ttft) - 1))], "itl_ms_p50": statistics.median(itl),
            "num_requests": len(done), "span_s": (end - start) / 1e9}


def merge_earlier(result: dict, earlier: dict, levels: list[int]) -> list[int]:
    """Take into `result` the points of an earlier run of the same methods at the concurrencies this run does not
    measure; returns those concurrencies. The earlier run's header is kept beside this one's."""
    for key in ("device", "dtype", "max_tokens", "repeats"):
        if earlier.get(key) != result.get(key):
            raise SystemExit(f"--merge: the earlier run's {key} is {earlier.get(key)!r}, this run's {result.get(key)!r}")
    if set(earlier["methods"]) != set(result["methods"]):
        raise SystemExit(f"--merge: the earlier run measured {sorted(earlier['methods'])}, this one {sorted(result['methods'])}")
    taken = sorted({int(c) for by_level in earlier["methods"].values() for c in by_level} - set(levels))
    for name, by_level in earlier["methods"].items():
        result["methods"][name].update({str(c): by_level[str(c)] for c in taken if str(c) in by_level})
    result["merged"] = {"levels": taken, "header": earlier["header"]}
    for c in taken:   # their warm-up, where the earlier run recorded it
        if str(c) in earlier.get("warmup_passes", {}):
            result.setdefault("warmup_passes", {})[str(c)] = earlier["warmup_passes"][str(c)]
    return [c for c in taken if all(str(c) in by_level for by_level in result["methods"].values())]


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
                        help="unmeasured perf_analyzer runs of every method before each point's measured ones (steady "
                             "state, not start-up; the first point's for --warmup-seconds)")
    parser.add_argument("--warmup-seconds", type=float, default=30.0,
                        help="with --warmup: at the first concurrency (the server's start), unmeasured passes over the "
                             "methods until this long has passed; one pass at each later one. Through Triton on the H100 "
                             "(aec030e) the time a stream spent outside the engine between its requests fell from 11-25 "
                             "ms to 6-8 over the first ~20 s of measured runs after one pass "
                             "(concurrency_h100_turns8_c16_aec030e.md): start-up, not the method")
    parser.add_argument("--gpus", default="", help="one engine replica per listed GPU, e.g. 0,1 (KIND_GPU instances)")
    parser.add_argument("--merge", default="",
                        help="an earlier result (.json) of the same methods and settings whose other concurrencies join "
                             "this one's tables (a sweep split over several commands, e.g. under a 10-minute limit)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measured runs per method and point, the methods in turns (each repeat starts one method "
                             "later): ratios between methods compare runs made minutes apart at most, not a whole "
                             "method's sweep apart (the same method moved by up to 1.39x between sweeps on the H200)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="a ddtree model parameter of the served repository, as in config.pbtxt (repeatable)")
    args = parser.parse_args()
    engine = dict(item.split("=", 1) for item in args.engine)
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    methods = [m for m in METHODS if m[2] in args.methods.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    config = EngineConfig(target_path=str(Path(args.target).resolve()), drafter_path=str(Path(args.drafter).resolve()),
                          device=args.device, dtype=args.dtype, max_tree_budget=64)
    prompts = json.loads((ROOT / "perf/prompts.json").read_text())
    result = {"header": header(), "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "target": config.target_path, "gpus": gpus, "repeats": args.repeats, "engine": engine,
              "warmup_seconds": args.warmup_seconds if args.warmup else 0.0,
              "methods": {name: {} for _, _, name in methods}}
    runs: dict[str, dict[str, list[dict]]] = {name: {} for _, _, name in methods}
    earlier = merge_earlier(result, json.loads(Path(args.merge).read_text()), levels) if args.merge else []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        repo = make_repository(config, workdir, {"max_num_seqs": str(max(levels)), "max_queue_size": "1024", **engine}, gpus)
        # the server's log beside the results (a run cut off by a time limit keeps it: what the server did meanwhile)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with TritonServer(str(repo), log_path=str(Path(args.out) / f"{args.name}_server.log")) as server:
            print(f"{time.strftime('%H:%M:%S')} server ready", flush=True)
            for level in levels:
                count = max(args.requests_per_stream * level, 4)
                if args.warmup:   # unmeasured: captures of new batch shapes, auto's exploration at a new batch size,
                    # and the serving path's own start-up (--warmup-seconds)
                    start, passes = time.monotonic(), 0
                    seconds = args.warmup_seconds if level == levels[0] else 0.0   # the server's start-up: once
                    while passes == 0 or time.monotonic() - start < seconds:
                        for method in methods:
                            run_perf_analyzer(server, input_data(prompts, sampling_of(method, args)), workdir, count,
                                              level, model_of(method))
                        passes += 1
                    print(f"{time.strftime('%H:%M:%S')} c={level}: {passes} warm-up passes in "
                          f"{time.monotonic() - start:.0f} s", flush=True)
                    result.setdefault("warmup_passes", {})[str(level)] = passes
                for repeat in range(args.repeats):
                    for method in methods[repeat % len(methods):] + methods[: repeat % len(methods)]:
                        entry = measure(server, workdir, prompts, method, args, count, level)
                        runs[method[2]].setdefault(str(level), []).append(entry)
                        print(f"{time.strftime('%H:%M:%S')} {method[2]} c={level} run {repeat + 1}/{args.repeats}: {entry}",
                              flush=True)
                for _, _, name in methods:
                    result["methods"][name][str(level)] = median_run(runs[name][str(level)])
                result["paired"] = paired_ratios(result["methods"])
                result["steady"] = steady_ratios(result["methods"])
                for key, name in (("control", CONTROL), ("alone", ALONE)):
                    if name in result["methods"] and "ar" in result["methods"]:
                        result[key] = control_ratios(result["methods"], name)
                write(result, sorted(earlier + [c for c in levels if str(c) in runs[methods[0][2]]]), args)
                # after each point: a cut-off run keeps what it measured


def model_of(method: tuple[str, int, str]) -> str:
    """The model a method's requests are sent to: the ensemble, or for ALONE the generation model itself."""
    return GENERATION_MODEL if method[2] == ALONE else "ensemble"


def sampling_of(method: tuple[str, int, str], args) -> dict:
    mode, budget, _ = method
    return {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "mode": mode, "tree_budget": budget}


def measure(server, workdir: Path, prompts: list[str], method: tuple[str, int, str], args, count: int,
            level: int) -> dict:
    """One measured perf_analyzer run of a method at a concurrency, with the engine's per-round stages over it."""
    stages, post = triton_stages(server.metrics_url), model_stats(server.http_url, "postprocessing")
    pre = model_stats(server.http_url, "preprocessing")
    generation = model_stats(server.http_url, GENERATION_MODEL)
    arms = auto_arms(server.metrics_url)
    counters = scrape_metrics(server.metrics_url, {LATE, *STALLS.values(), *SENDER.values()})
    sums = request_sums(server.metrics_url)
    requests = run_perf_analyzer(server, input_data(prompts, sampling_of(method, args)), workdir, count, level,
                                 model_of(method))
    entry = summarize(requests, args.max_tokens)
    # where a round's time goes (engine stages, mean requests per round) and whether the postprocessing step (one
    # execution per streamed response) queues
    entry["stages"] = per_round_ms(stages, wait_stages(server.metrics_url, stages))
    if method[0] == "auto":   # which arms auto ran (shares of its measured rounds)
        now = auto_arms(server.metrics_url)
        ran = {arm: n - arms["rounds"].get(arm, 0.0) for arm, n in now["rounds"].items()}
        spent = {arm: t - arms["seconds"].get(arm, 0.0) for arm, t in now["seconds"].items()}
        total = sum(ran.values())
        entry["auto_arms"] = {arm: n / total for arm, n in ran.items() if n > 0} if total else {}
        # what a round of each arm cost (as auto measures it: from the previous round's end) and its share of the time
        entry["auto_arm_ms"] = {arm: 1e3 * spent.get(arm, 0.0) / n for arm, n in ran.items() if n > 0}
        time_total = sum(spent.values())
        entry["auto_arm_time_shares"] = {arm: t / time_total for arm, t in spent.items() if t > 0} if time_total else {}
    # static programs compiled (captured, on CUDA) inside the measured run: shapes no warm-up or earlier run made
    now_counters = scrape_metrics(server.metrics_url, {LATE, *STALLS.values()})
    entry["late_programs"] = now_counters.get(LATE, 0.0) - counters.get(LATE, 0.0)
    entry["stalls"] = {key: now_counters.get(name, 0.0) - counters.get(name, 0.0) for key, name in STALLS.items()}
    after = model_stats(server.http_url, "postprocessing")
    entry["postprocessing"] = per_execution(post, after)
    entry["postprocessing"]["per_request"] = max(entry["postprocessing"]["executions"], 1) / max(entry["num_requests"], 1)
    # the engine's share of the time to first token: from a request's arrival at the generation model to its first
    # token, mean over the run's requests; of which the wait for the prefill that admits it, and that prefill
    # (ddtree_request_{queue,prefill}_seconds: published with the TTFT's samples)
    counted = REQUEST_HISTOGRAMS["ttft"] + "_count"
    split = request_split(sums, wait_count(server.metrics_url, counted, sums.get(counted, 0.0) + entry["num_requests"]))
    for key in ("ttft", "queue", "prefill", "take"):   # the take: of the queue, to the engine thread's taking it
        entry[f"engine_{key}_ms"] = split[f"{key}_ms"]
    # the preprocessing step: one execution per request (chat template, tokenizer), part of its time to first token
    entry["preprocessing"] = per_execution(pre, model_stats(server.http_url, "preprocessing"))
    # the generation model in Triton's terms: a request's wait in Triton's queue before the model's execute() takes
    # it, and execute() itself (parsing, the hand-over to the engine); both outside the engine's time to first token
    entry["generation"] = per_execution(generation, model_stats(server.http_url, GENERATION_MODEL))
    # how busy sending keeps the sending thread (responses, errors, cancellation asks), per second of the run (the
    # counters read after the request histograms caught up, above)
    rates = sender_rates(counters, scrape_metrics(server.metrics_url, set(SENDER.values())), entry["span_s"])
    if rates is not None:
        entry["sender"] = rates
    return entry


def sender_rates(before: dict, after: dict, span_s: float) -> dict | None:
    """The sending thread's time per second of a run, from the SENDER counters read before and after it (None: a
    server that does not export them)."""
    if not all(name in after for name in SENDER.values()):
        return None
    d = {key: after[name] - before.get(name, 0.0) for key, name in SENDER.items()}
    span = max(span_s, 1e-9)
    return {"send_ms_per_s": 1e3 * d["send_s"] / span, "responses_per_s": d["responses"] / span,
            "send_ms": 1e3 * d["send_s"] / d["responses"] if d["responses"] else 0.0,
            "checks_per_s": d["checks"] / span, "check_ms_per_s": 1e3 * d["check_s"] / span,
            "check_ms": 1e3 * d["check_s"] / d["checks"] if d["checks"] else 0.0,
            "publish_ms_per_s": 1e3 * d["publish_s"] / span}


def sender_cell(entry: dict) -> str:
    snd = entry.get("sender")
    return (f"{snd['send_ms_per_s']:.0f} ({snd['responses_per_s']:.0f}, {snd['send_ms']:.2f}) / "
            f"{snd['checks_per_s']:.0f} / {snd['check_ms_per_s']:.0f} ({snd['check_ms']:.2f}); "
            f"{snd['publish_ms_per_s']:.0f}" if snd else "-")


def per_execution(before: dict, after: dict) -> dict:
    """A model's executions between two model_stats reads, and its queue and compute ms per execution."""
    executions = after["count"] - before["count"]
    return {"executions": executions,
            "queue_ms": (after["queue_ns"] - before["queue_ns"]) / max(executions, 1) / 1e6,
            "compute_ms": (after["compute_ns"] - before["compute_ns"]) / max(executions, 1) / 1e6}


def wait_count(metrics_url: str, name: str, at_least: float, timeout_s: float = 5.0) -> dict[str, float]:
    """The per-request histograms' sums and counts (request_sums) once `name` reaches at_least (metrics trail the
    responses) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = request_sums(metrics_url)
        if values.get(name, 0.0) >= at_least or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def median_run(entries: list[dict]) -> dict:
    """The run of median throughput (its TTFT, ITL and stages), with every run's throughput beside it and every run
    whole (in turn order: an outlier's arms, stages and late programs)."""
    ranked = sorted(entries, key=lambda e: e["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_tokens_per_s": [e["tokens_per_s"] for e in entries],
            "runs": entries}


# two-sided 95% quantiles of Student's t by degrees of freedom (turns - 1); between two keys the smaller key's (wider)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def turn_interval(ratios: list[float]) -> dict | None:
    """What a point's turns say about a ratio itself: the geometric mean of the per-turn ratios and its 95% interval
    (Student's t on their logs: the turns as independent samples of one ratio), where the median and the worst turn
    say how they spread. An interval that holds 1.0 cannot tell the two methods apart at this many turns; the A/A
    control's interval is how wide that is for two identical methods. None below 2 turns."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 2:
        return None
    n, mean = len(logs), statistics.fmean(logs)
    half = T95[max(k for k in T95 if k <= n - 1)] * statistics.stdev(logs) / math.sqrt(n)
    return {"mean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "turns": n}


def interval_cell(interval: dict | None) -> str:
    return f"{interval['mean']:.3f} [{interval['low']:.3f}, {interval['high']:.3f}]" if interval else "-"


def paired_ratios(methods: dict[str, dict[str, dict]], candidate: str = "auto") -> dict[str, dict]:
    """Per concurrency: `candidate`'s throughput over the best other method's, run by run (run i of every method was
    measured in the same turn), and over `ar`'s; the median and the worst of those ratios. The A/A control (CONTROL)
    is no other method: the best of two samples of `ar` would rank `auto` against `ar`'s luckier run."""
    others = [name for name in methods if name not in (candidate, CONTROL, ALONE)]
    if candidate not in methods or not others:
        return {}
    out = {}
    for level, entry in methods[candidate].items():
        mine = entry["runs_tokens_per_s"]
        series = {name: methods[name][level]["runs_tokens_per_s"] for name in others if level in methods[name]}
        if not series:
            continue
        best = [max(s[i] for s in series.values()) for i in range(len(mine))]
        ratios = [m / b for m, b in zip(mine, best)]
        row = {"best_per_run": [max(series, key=lambda name: series[name][i]) for i in range(len(mine))],
               "over_best": ratios, "over_best_median": statistics.median(ratios), "over_best_min": min(ratios),
               "over_best_interval": turn_interval(ratios)}
        if "ar" in series:
            over_ar = [m / a for m, a in zip(mine, series["ar"])]
            row.update(over_ar=over_ar, over_ar_median=statistics.median(over_ar), over_ar_min=min(over_ar),
                       over_ar_interval=turn_interval(over_ar))
            again = methods.get(CONTROL, {}).get(level, {}).get("runs_tokens_per_s")
            if candidate != CONTROL and again is not None and len(again) == len(mine):
                # against both `ar` runs of its turn (their geometric mean): two samples of `ar` a turn, less noise
                pooled = [m / math.sqrt(a * g) for m, a, g in zip(mine, series["ar"], again)]
                row.update(over_both_ar=pooled, over_both_ar_interval=turn_interval(pooled))
        out[level] = row
    return out


def steady_ratios(methods: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per point where turns met a host episode (episode_turns): those turns (from 1), and auto's intervals against
    `ar` and both `ar` runs, and the A/A control's, over the other turns."""
    steady, dropped = steady_turns(methods)
    paired, control = paired_ratios(steady), control_ratios(steady)
    return {level: {"episodes": turns, "turns": len(steady["ar"][level]["runs_tokens_per_s"]),
                    "auto_over_ar": paired.get(level, {}).get("over_ar_interval"),
                    "auto_over_both_ar": paired.get(level, {}).get("over_both_ar_interval"),
                    "control_over_ar": control.get(level, {}).get("over_ar_interval")}
            for level, turns in dropped.items() if "ar" in methods and level in methods["ar"]}


def control_ratios(methods: dict[str, dict[str, dict]], name: str = CONTROL) -> dict[str, dict]:
    """`name`'s paired_ratios against `ar` (empty unless both were measured): for the A/A control, what a ratio
    between two identical methods looks like at each point; for ALONE, what the ensemble's steps cost `ar`."""
    if name not in methods or "ar" not in methods:
        return {}
    return paired_ratios({key: methods[key] for key in ("ar", name)}, name)


# A turn with a host episode: one of its runs had the postprocessing step queue over EPISODE_FACTOR x the point's
# median run's queue and over EPISODE_FLOOR_MS an execution (the one instance that takes every streamed response)
EPISODE_FACTOR, EPISODE_FLOOR_MS = 3.0, 2.0


def episode_turns(methods: dict[str, dict[str, dict]], level: str) -> list[int]:
    """The turns (from 0) at this point in which any method's run met a host episode. Through Triton on the H100
    (28d0584) such runs came in the middle of sweeps, on every method: the postprocessing step queued 5-39 ms an
    execution against 0.29-1.8 in the other runs, its compute took up to twice as long, and at c=32 the runs made
    60-73% of the others' tokens/s (concurrency_h100_turns10_c{16,32}_28d0584.md). The test reads only the serving
    path, and drops the whole turn, every method's run of it: which method an episode falls on is chance, and one
    ar run hit by it moves a turn's ratio by up to 1.5x (the A/A control at c=32, 1.059 [0.937, 1.197]). Runs
    without the postprocessing statistics (older sweeps), or without postprocessing executions (ALONE's), count
    for nothing."""
    queues = {name: [queue_ms(run) for run in entries[level].get("runs", [])]
              for name, entries in methods.items() if level in entries}
    known = [q for qs in queues.values() for q in qs if q is not None]
    if not known:
        return []
    limit = max(EPISODE_FACTOR * statistics.median(known), EPISODE_FLOOR_MS)
    turns = max(len(qs) for qs in queues.values())
    return [i for i in range(turns) if any(i < len(qs) and qs[i] is not None and qs[i] > limit for qs in queues.values())]


def queue_ms(run: dict) -> float | None:
    """The postprocessing step's queue ms an execution in this run, where it ran that step."""
    post = run.get("postprocessing") or {}
    return post.get("queue_ms") if post.get("executions", 1) else None


def has_queue_stats(methods: dict[str, dict[str, dict]], level: str) -> bool:
    return any(queue_ms(run) is not None for entries in methods.values() for run in entries.get(level, {}).get("runs", []))


def steady_turns(methods: dict[str, dict[str, dict]]) -> tuple[dict[str, dict[str, dict]], dict[str, list[int]]]:
    """The methods with each point's turns that met a host episode left out (every method's run of such a turn; the
    runs' tokens/s that paired_ratios reads), and those turns per point (from 1)."""
    levels = {level for entries in methods.values() for level in entries}
    dropped = {level: episode_turns(methods, level) for level in levels}
    steady = {name: {level: {**entry, "runs_tokens_per_s": [v for i, v in enumerate(entry["runs_tokens_per_s"])
                                                            if i not in dropped[level]]}
                     for level, entry in entries.items()} for name, entries in methods.items()}
    return steady, {level: [i + 1 for i in turns] for level, turns in dropped.items() if turns}


IDLE_SHARE = 0.9   # a run whose engine held fewer of the streams on average had streams idle outside the engine


def idle_runs(methods: dict[str, dict[str, dict]], levels: list[int]) -> list[str]:
    """The runs whose engine held under IDLE_SHARE of the streams on average (the engine's mean batch): streams that
    waited outside it, for their responses or before their next request reached it (on the H200 a 2 ms outbox wait
    per call made such runs, at half the throughput: README, "The gate's wait counted from queueing"), with the
    Python steps' queue / compute ms an execution (through Triton on the H100 at aec030e the postprocessing step, one
    instance taking every streamed response, queued 27 ms an execution in such a run, against 0.2-0.3 in most others,
    while its compute took 2.1x as long and the other steps' up to 1.6x: concurrency_h100_turns8_c16_aec030e.md)."""
    return [f"{name} c={c} run {i + 1}: {run['tokens_per_s']:.0f} tok/s, mean batch {run['stages']['mean_batch']:.1f}, "
            f"time to first token p50 {run['ttft_ms_p50']:.0f} ms (the engine's mean "
            + (f"{run['engine_ttft_ms']:.1f})" if run.get("engine_ttft_ms") is not None else "-)")
            + "".join(f", {step} {run[step]['queue_ms']:.2f} / {run[step]['compute_ms']:.2f} ms"
                      for step in ("preprocessing", "generation", "postprocessing") if step in run)
            for name, by_level in methods.items() for c in levels
            for i, run in enumerate(by_level.get(str(c), {}).get("runs", []))
            if run.get("stages", {}).get("mean_batch", c) < IDLE_SHARE * c]


def wall_ms_per_round(run: dict, max_tokens: int) -> float | None:
    """A run's time per batch round: its tokens (max_tokens a request) / its tokens/s / the engine's batch rounds in it
    (perf_analyzer's window and the counters' are nearly the same). What the stages of a round (draft, verify, host,
    serve) leave of it is the steps' prefills (the admissions among the rounds) and the engine's waits for work: on the
    H200 at 32 streams ~1.4 of ~2.9 ms (README, issue 4's row). None without the counters."""
    rounds = run.get("stages", {}).get("batch_rounds")
    if not rounds or not run.get("tokens_per_s") or not run.get("num_requests"):
        return None
    return 1e3 * run["num_requests"] * max_tokens / run["tokens_per_s"] / rounds


def stalls_cell(entry: dict) -> str:
    """A run's stalled steps / their ms; its garbage collection ms / full collections; its dynamic forwards ("-": not
    measured)."""
    stalls = entry.get("stalls")
    if stalls is None:
        return "-"
    dynamic = f"; dynamic {stalls['dynamic']:.0f}" if "dynamic" in stalls else ""
    return (f"{stalls['slow_steps']:.0f} / {1e3 * stalls['slow_step_s']:.0f}; gc {1e3 * stalls['gc_s']:.0f} / "
            f"{stalls['full_gcs']:.0f}{dynamic}")


def level_table(result: dict, levels: list[int], cell, caption: str) -> list[str]:
    """Markdown rows: the caption, then a table of cell(entry) per method (rows) and concurrency (columns)."""
    rows = ["", caption, "", "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, by_level in result["methods"].items():
        rows.append(f"| {name} | " + " | ".join(cell(by_level[str(c)]) for c in levels) + " |")
    return rows


def write(result: dict, levels: list[int], args) -> None:
    rows = ["| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    if result.get("engine"):
        rows = ["ddtree parameters set: " + ", ".join(f"`{k}={v}`" for k, v in result["engine"].items()), ""] + rows
    if "merged" in result:
        merged = result["merged"]
        rows = [f"c={', '.join(map(str, merged['levels']))} from an earlier run (commit `{merged['header'].get('commit')}`, "
                f"{merged['header'].get('date')}: `{merged['header'].get('command')}`); the others from this one.", ""] + rows
    if result.get("warmup_passes"):
        rows = [f"Unmeasured warm-up before each point's runs (--warmup-seconds {args.warmup_seconds:g} at the first): "
                "passes over the methods " + ", ".join(f"{n} at c={c}" for c, n in result["warmup_passes"].items()),
                ""] + rows
    for name, by_level in result["methods"].items():
        rows.append(f"| {name} tok/s | " + " | ".join(f"{by_level[str(c)]['tokens_per_s']:.1f}" for c in levels) + " |")
        rows.append(f"| {name} TTFT p50 ms | " + " | ".join(f"{by_level[str(c)]['ttft_ms_p50']:.0f}" for c in levels) + " |")
        rows.append(f"| {name} ITL p50 ms | " + " | ".join(f"{by_level[str(c)]['itl_ms_p50']:.1f}" for c in levels) + " |")
    rows += ["", "Per batch round (engine counters through Triton's metrics): mean requests / draft ms / verify ms / host ms / "
             "serve ms (engine thread outside steps); postprocessing (one execution per streamed response): queue ms / "
             "compute ms per execution, executions per request; the run's wall ms a round (its tokens / tokens/s / "
             "rounds: beyond the stages, the prefills admitting requests among the rounds and the engine's waits).", "",
             "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, by_level in result["methods"].items():
        cells = []
        for c in levels:
            e = by_level[str(c)]
            st, pp = e.get("stages"), e.get("postprocessing")
            cells.append(f"{st['mean_batch']:.1f} / {st['draft_ms']:.1f} / {st['verify_ms']:.1f} / {st['host_ms']:.1f} / "
                         f"{st.get('serve_ms', float('nan')):.1f}; {pp['queue_ms']:.2f} / {pp['compute_ms']:.2f}"
                         + (f", {pp['per_request']:.1f}" if "per_request" in pp else "")
                         + (f"; wall {wall:.2f}" if (wall := wall_ms_per_round(e, result["max_tokens"])) is not None else "")
                         if st and pp else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("preprocessing" in by_level.get(str(c), {}) for by_level in result["methods"].values() for c in levels):
        rows += ["", "Time to first token, client p50 ms / the generation model's mean (arrival to first token; "
                 "ddtree_time_to_first_token_seconds) = its queue (to the start of the prefill that admits it; in "
                 "brackets, of it, the wait for the engine thread to take the request: the step in progress) + that "
                 "prefill + the rest of that step; preprocessing (one execution per request, before its prefill): "
                 "queue ms / compute ms an execution; the generation model in Triton's statistics: a request's wait in "
                 "Triton's queue before the model's execute() / that execute() (both before its arrival above).",
                 "", "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in result["methods"].items():
            cells = []
            for c in levels:
                e = by_level[str(c)]
                p, engine = e.get("preprocessing"), e.get("engine_ttft_ms")
                parts, take = (e.get("engine_queue_ms"), e.get("engine_prefill_ms")), e.get("engine_take_ms")
                cells.append(f"{e['ttft_ms_p50']:.0f} / " + (f"{engine:.1f}" if engine is not None else "-")
                             + (f" = {parts[0]:.1f}" + (f" ({take:.1f})" if take is not None else "")
                                + f" + {parts[1]:.1f} + {engine - parts[0] - parts[1]:.1f}"
                                if None not in parts and engine is not None else "")
                             + (f"; {p['queue_ms']:.2f} / {p['compute_ms']:.2f}" if p else "")
                             + (f"; {g['queue_ms']:.2f} / {g['compute_ms']:.2f}" if (g := e.get("generation")) else ""))
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("sender" in by_level.get(str(c), {}) for by_level in result["methods"].values() for c in levels):
        rows += level_table(result, levels, sender_cell,
                            "The sending thread (the outbox in process; with engine_process the stub's relay thread), per "
                            "second of the run: ms busy sending (responses a second, ms a response) / cancellation asks / "
                            "ms busy asking (ms an ask); the metrics' own publishing, ms a second (their thread).")
    autos = {name: by_level for name, by_level in result["methods"].items()
             if any("auto_arms" in by_level.get(str(c), {}) for c in levels)}
    if autos:
        rows += ["", "Arms `auto` ran (share of its batch rounds, ddtree_auto_arm_rounds_total; where measured, share of "
                 "its time and ms per round of that arm, ddtree_auto_arm_seconds_total):", "",
                 "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in autos.items():
            cells = []
            for c in levels:
                entry = by_level[str(c)]
                shares = sorted(entry.get("auto_arms", {}).items(), key=lambda item: -item[1])
                times, ms = entry.get("auto_arm_time_shares", {}), entry.get("auto_arm_ms", {})
                cells.append(", ".join((f"{arm} {share:.0%}" if share >= 0.005 else f"{arm} <1%")
                                       + (f" ({times.get(arm, 0.0):.0%} of the time, {ms[arm]:.1f} ms)" if arm in ms else "")
                                       for arm, share in shares) or "-")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("late_programs" in by_level.get(str(c), {}) for by_level in result["methods"].values() for c in levels):
        rows += ["", "Static programs made inside the measured run (compiled and, on CUDA, captured on requests' time; "
                 "ddtree_static_programs_late_total):", "",
                 "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in result["methods"].items():
            rows.append(f"| {name} | " + " | ".join(f"{by_level[str(c)]['late_programs']:.0f}"
                                                    if "late_programs" in by_level[str(c)] else "-" for c in levels) + " |")
    if any("stalls" in by_level.get(str(c), {}) for by_level in result["methods"].values() for c in levels):
        rows += ["", "Stalled engine steps in the measured run (over 10x the recent steps' mean and 50 ms; "
                 "ddtree_slow_steps_total) / their ms; the model process's garbage collection ms / full collections; "
                 "drafter passes and verifies no static program fitted (ddtree_dynamic_forwards_total):", "",
                 "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in result["methods"].items():
            rows.append(f"| {name} | " + " | ".join(stalls_cell(by_level[str(c)]) for c in levels) + " |")
    paired = result.get("paired", {})
    if paired:
        cells = {c: paired.get(str(c)) for c in levels}
        rows += ["", f"`auto` against the other methods measured in the same turn ({result.get('repeats', 1)} turns per "
                 "point; median and worst turn):", "",
                 "| ratio | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels),
                 "| auto / best other, median | " + " | ".join(f"{r['over_best_median']:.2f}" if r else "-"
                                                         for r in cells.values()) + " |",
                 "| auto / best other, worst turn | " + " | ".join(f"{r['over_best_min']:.2f}" if r else "-"
                                                             for r in cells.values()) + " |"]
        if any(r and "over_ar_median" in r for r in cells.values()):
            rows.append("| auto / ar, median | " + " | ".join(f"{r['over_ar_median']:.2f}" if r and "over_ar_median" in r
                                                            else "-" for r in cells.values()) + " |")
        rows.append("| best other per turn | " + " | ".join(", ".join(r["best_per_run"]) if r else "-"
                                                         for r in cells.values()) + " |")
        control = {c: result.get("control", {}).get(str(c)) for c in levels}
        if any(control.values()):
            rows += [f"| {CONTROL} / ar (the same method twice a turn), median | "
                     + " | ".join(f"{r['over_ar_median']:.2f}" if r else "-" for r in control.values()) + " |",
                     f"| {CONTROL} / ar, worst turn | "
                     + " | ".join(f"{r['over_ar_min']:.2f}" if r else "-" for r in control.values()) + " |"]
        if any(r and r.get("over_ar_interval") for r in cells.values()):
            rows += ["", "The same turns as intervals (turn_interval: the geometric mean of the per-turn ratios and its 95% "
                     "interval, Student's t on their logs; an interval holding 1.000 cannot tell the two apart at this "
                     "many turns, and the A/A control's is how wide that is for two identical methods):", "",
                     "| ratio | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels),
                     "| auto / best other | " + " | ".join(interval_cell(r.get("over_best_interval") if r else None)
                                                         for r in cells.values()) + " |",
                     "| auto / ar | " + " | ".join(interval_cell(r.get("over_ar_interval") if r else None)
                                                 for r in cells.values()) + " |"]
            if any(r and r.get("over_both_ar_interval") for r in cells.values()):
                rows.append(f"| auto / both `ar` runs of its turn (ar, {CONTROL}) | "
                            + " | ".join(interval_cell(r.get("over_both_ar_interval") if r else None)
                                         for r in cells.values()) + " |")
            if any(control.values()):
                rows.append(f"| {CONTROL} / ar | " + " | ".join(interval_cell(r.get("over_ar_interval") if r else None)
                                                              for r in control.values()) + " |")
            steady = {c: result.get("steady", {}).get(str(c)) for c in levels}
            if any(steady.values()):
                rows += ["", "The same over the turns without a host episode (a turn left out, every method's run of it, "
                         f"where one of its runs had the postprocessing step queue over {EPISODE_FACTOR:g}x the point's "
                         f"median run's and over {EPISODE_FLOOR_MS:g} ms an execution: episode_turns):", "",
                         "| ratio | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels),
                         "| turns left out | " + " | ".join(
                             ", ".join(map(str, r["episodes"])) if r else
                             "none" if has_queue_stats(result["methods"], str(c)) else "- (no queue statistics)"
                             for c, r in steady.items()) + " |"]
                for key, label in (("auto_over_ar", "auto / ar"), ("auto_over_both_ar", "auto / both `ar` runs"),
                                   ("control_over_ar", f"{CONTROL} / ar")):
                    rows.append(f"| {label} | " + " | ".join(interval_cell(r.get(key)) if r else "as above"
                                                             for r in steady.values()) + " |")
    alone = {c: result.get("alone", {}).get(str(c)) for c in levels}
    if any(alone.values()):
        rows += ["", f"`{ALONE}` (`ar` through the generation model alone: the prompt sent as text, no pre- or "
                 "postprocessing step) against `ar` through the ensemble, in the same turns:", "",
                 "| ratio | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels),
                 f"| {ALONE} / ar, median | " + " | ".join(f"{r['over_ar_median']:.2f}" if r else "-" for r in alone.values())
                 + " |",
                 f"| {ALONE} / ar, interval | " + " | ".join(interval_cell(r.get("over_ar_interval") if r else None)
                                                           for r in alone.values()) + " |"]
    if result.get("repeats", 1) > 1:
        rows += ["", "Every run's tokens/s, turn by turn:", "",
                 "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name, by_level in result["methods"].items():
            rows.append(f"| {name} | " + " | ".join(" / ".join(f"{v:.0f}" for v in by_level[str(c)]["runs_tokens_per_s"])
                                                    for c in levels) + " |")
        notes = [f"{name} c={c} run {i + 1}: {run['tokens_per_s']:.0f} tok/s, "
                 + ", ".join(f"{arm} {share:.0%} of the time" for arm, share in run.get("auto_arm_time_shares", {}).items())
                 + f"; {run.get('late_programs', 0):.0f} programs made in the run"
                 for name, by_level in result["methods"].items() for c in levels
                 for i, run in enumerate(by_level[str(c)].get("runs", []))
                 if run.get("auto_arm_time_shares") and max(run["auto_arm_time_shares"].values()) < 0.99]
        if notes:
            rows += ["", "`auto`'s runs that spent over 1% of their time outside one arm:", ""] + [f"- {n}" for n in notes]
        idle = idle_runs(result["methods"], levels)
        if idle:
            rows += ["", f"Runs whose engine held under {IDLE_SHARE:.0%} of the streams on average (the others waited "
                     "outside it; the Python steps' queue / compute ms an execution):", ""] + [f"- {n}" for n in idle]
    write_results(Path(args.out), args.name, result, "\n".join(rows) + f"\n\n![tokens/s against concurrency]({args.name}.png)")
    plot(result, Path(args.out) / f"{args.name}.png")


if __name__ == "__main__":
    main()
