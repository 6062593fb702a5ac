"""Where the serving loop's rounds lose to the engine's own loop, in one process, with no server.

Through Triton the engine's drafting rounds took longer than in process (perf/humaneval.py's stage table: on the H100
at b0678b3 `dflash`'s draft 0.23 against 0.18 ms a round, host 0.17 against 0.14, plus 0.05 of serve), and the same
showed in process with the GenerationService on its thread and no IPC at all (serve_overhead_h200.md: `service`
against `alone`). This runs the same requests, one at a time, on one engine, in turns, each side after the other:

- `alone`: Engine.generate on the main thread, as the in-process benchmarks run it;
- `thread`: the same on a thread of its own (is it the thread?);
- `service`: a GenerationService (engine thread, outbox thread, the device-wait gate on CUDA) with sinks that keep
  nothing (its own loop's cost, no IPC);
- `pipe`: the same with the engine process's sinks (ddtree.engine_process._PipeSink) writing every response into a
  socket pair that another process drains (the child's sends, without the stub);
- `pipe-inline`, `pipe-nogate`: `pipe` with DDTREE_INLINE_SENDS=1 (sends on the engine thread), DDTREE_OUTBOX_GATE=0
  (the outbox's calls not held for the engine's device waits);
- `child`: the served form without the server: a second engine in a child process (ddtree.engine_process, its own
  GenerationService and pipe), this process relaying its responses as the stub does; its stages are the child's, from
  the stats it publishes (is the engine slower in a process of its own than here, with no server around it?);
- `pipe-wake-put`, `pipe-text-engine`, `pipe-before`: `pipe` with DDTREE_OUTBOX_WAKE=put (every outbox call wakes the
  outbox thread, rather than the engine thread's calls handed over at its device waits, one wake-up a round),
  DDTREE_OUTBOX_TEXT=0 (every response built on the engine thread, rather than those of requests without stop strings
  on the outbox), both (the serving loop before 0941207, whose service_probe_h100_defer.md measured these as options).

Per side and method: tokens/s and ms a round of each stage (draft, verify, host, and the serving loop's own work:
serve), the median over the turns, and each side's tokens/s against `alone` turn by turn. With --parts, the serving
sides' loops are timed part by part (the response's text and outputs, Stream.add; the outbox's put; the metrics'
_report; _take_jobs; _claim_relayed_stops): us a round of each, where the serve time goes; apart, what is not the
engine thread's work between rounds: `Stream.add (outbox)` (a gated side builds the text of requests without stop
strings on the outbox thread, in the engine's device waits) and `_take_jobs (idle)` (the wait for the next request).
(On the 2-core CPU, with a stand-in engine whose "device waits" are sleeps, each part took ~5x inside the loop what it
takes called in a tight loop: Python right after a thread's wait runs cold.)

    python perf/service_probe.py --device cuda --dtype bfloat16 --name service_probe_h100
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree import api  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.serving import GenerationService, freeze_heap  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from ddtree.triton_common import load_tokenizer  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts, environment, load_problems  # noqa: E402

SIDES = ("alone", "thread", "service", "pipe", "pipe-inline", "pipe-nogate", "pipe-wake-put", "pipe-text-engine",
         "pipe-before", "child")
SIDE_ENV = {"pipe-inline": {"DDTREE_INLINE_SENDS": "1"}, "pipe-nogate": {"DDTREE_OUTBOX_GATE": "0"},
            "pipe-wake-put": {"DDTREE_OUTBOX_WAKE": "put"}, "pipe-text-engine": {"DDTREE_OUTBOX_TEXT": "0"},
            "pipe-before": {"DDTREE_OUTBOX_WAKE": "put", "DDTREE_OUTBOX_TEXT": "0"}}
# each serving side starts from these (its own settings on top): the service's defaults
SERVICE_ENV = {"DDTREE_INLINE_SENDS": "0", "DDTREE_OUTBOX_GATE": "", "DDTREE_OUTBOX_WAKE": "", "DDTREE_OUTBOX_TEXT": ""}
FLAGS = {flag: True for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                                 "return_acceptance_stats")}
STAGES = ("draft", "verify", "host")


def params_for(method: str, max_tokens: int) -> SamplingParams:
    mode, _, budget = method.partition("-")
    return SamplingParams(max_tokens=max_tokens, mode=mode, tree_budget=int(budget or 16), temperature=0.0)


class _KeepNothing:
    """A ResponseSink that keeps nothing: the service's own cost, no IPC."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def is_cancelled(self) -> bool:
        return False

    def send(self, outputs, final: bool) -> None:
        if final:
            self.done.set()

    def send_error(self, message: str, kind: str, final: bool = True) -> None:
        self.done.set()


class _Drained:
    """One end of a socket pair whose other end a forked process reads and drops (the engine process's parent)."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        from ddtree.engine_process import _Link

        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:   # the reader: nothing of the engine's runs here
            ours.close()
            conn = Connection(theirs.detach())
            while True:
                try:
                    conn.recv()
                except (EOFError, OSError):
                    os._exit(0)
        theirs.close()
        self.link = _Link(Connection(ours.detach()))

    def close(self) -> None:
        self.link.conn.close()
        os.waitpid(self.pid, 0)


class _PipeDone:
    """A _PipeSink that also says when its final response went out."""

    def __init__(self, link, pid: int) -> None:
        from ddtree.engine_process import _PipeSink

        self.done = threading.Event()
        self.sink = _PipeSink(link, pid, {})

    def is_cancelled(self) -> bool:
        return self.sink.is_cancelled()

    def send(self, outputs, final: bool) -> None:
        self.sink.send(outputs, final)
        if final:
            self.done.set()

    def send_error(self, message: str, kind: str, final: bool = True) -> None:
        self.sink.send_error(message, kind, final)
        if final:
            self.done.set()


class _Child:
    """The `child` side's engine process (its own engine, warmed up in the child) and the latest stats it published."""

    FIELDS = {"batch_rounds": "num_batch_rounds", "draft": "draft_seconds", "verify": "verify_seconds",
              "host": "host_seconds", "serve": "serve_seconds", "tokens": "num_output_tokens", "finished": "num_finished"}

    def __init__(self, config: EngineConfig) -> None:
        import dataclasses

        from ddtree.engine_process import EngineProcess

        self.stats: dict[str, float] = dict.fromkeys(self.FIELDS, 0.0)
        self.published = threading.Condition()
        self.process = EngineProcess(dataclasses.replace(config, engine_process=True), tokenizer_path=config.target_path,
                                     max_queue_size=16)
        self.process.start(self._on_stats)

    def _on_stats(self, stats) -> None:
        with self.published:
            self.stats = {key: float(getattr(stats, name)) for key, name in self.FIELDS.items()}
            self.published.notify_all()

    def snapshot(self, finished: float = 0.0) -> dict[str, float]:
        """The latest published stats, once they count `finished` requests finished (the child publishes after its
        last response: the relay may pass that response on before the stats that count it)."""
        with self.published:
            if not self.published.wait_for(lambda: self.stats["finished"] >= finished, timeout=60):
                raise RuntimeError(f"child: its stats never counted {finished:.0f} requests finished")
            return dict(self.stats)

    def close(self) -> None:
        self.process.shutdown()


PARTS = ("_report", "_take_jobs", "_claim_relayed_stops")   # GenerationService methods timed with --parts


class PartTimer:
    """Wall time of the serving loop's parts (--parts): each wrapped method's seconds and calls. A Stream.add on the
    outbox thread (a gated service builds the text of requests without stop strings there) counts as `Stream.add
    (outbox)`, and _take_jobs' idle waits for the next request (block=True) as `_take_jobs (idle)`: neither is the
    engine thread's work between rounds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, function, name_of=None):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                key = name_of(args, kwargs) if name_of is not None else name
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
                self.calls[key] = self.calls.get(key, 0) + 1
        return timed

    def attach(self, service: GenerationService) -> None:
        from ddtree import serving

        for name in PARTS:
            name_of = (lambda args, kwargs: "_take_jobs (idle)" if kwargs.get("block", args[0] if args else False)
                       else "_take_jobs") if name == "_take_jobs" else None
            setattr(service, name, self.wrap(name, getattr(service, name), name_of))
        service._outbox.put = self.wrap("outbox.put", service._outbox.put)
        if not hasattr(serving._Stream.add, "__wrapped_by_probe__"):
            original = serving._Stream.add
            add = self.wrap("Stream.add", original, lambda args, kwargs: "Stream.add" if
                            threading.current_thread().name == "ddtree-engine" else "Stream.add (outbox)")
            add.__wrapped_by_probe__ = original
            serving._Stream.add = add

    @staticmethod
    def detach() -> None:
        from ddtree import serving

        original = getattr(serving._Stream.add, "__wrapped_by_probe__", None)
        if original is not None:
            serving._Stream.add = original


def snapshot(engine: Engine, service: GenerationService | None) -> dict[str, float]:
    t = engine.stage_times
    return {"batch_rounds": t.batch_rounds, "draft": t.draft, "verify": t.verify, "host": t.host,
            "serve": service.stats.serve_seconds if service is not None else 0.0}


def run_side(side: str, engine: Engine, tokenizer, prompts: list[list[int]], params: SamplingParams,
             drained: _Drained, parts: bool = False, child: _Child | None = None) -> dict[str, float]:
    """One side's pass over the prompts: tokens/s (each request from submit to its final response) and ms a round."""
    tokens, seconds, service, timer = 0, 0.0, None, None
    if side == "child":
        before = child.snapshot()
        for i, ids in enumerate(prompts):
            sink = _KeepNothing()
            start = time.perf_counter()
            child.process.submit(f"{side}-{i}", api.GenerateRequest(list(ids), params, True, None, FLAGS), sink)
            if not sink.done.wait(300):
                raise RuntimeError(f"{side}: request {i} did not finish")
            seconds += time.perf_counter() - start
        after = child.snapshot(before["finished"] + len(prompts))
        tokens = int(after["tokens"] - before["tokens"])
    elif side in ("alone", "thread"):
        def generate() -> None:
            nonlocal tokens, seconds
            for i, ids in enumerate(prompts):
                request = Request(f"{side}-{i}-{time.monotonic_ns()}", list(ids), params)
                start = time.perf_counter()
                for _ in engine.generate(request):
                    pass
                seconds += time.perf_counter() - start
                tokens += request.num_output_tokens

        before = snapshot(engine, None)
        if side == "alone":
            generate()
        else:
            worker = threading.Thread(target=generate, name="probe-thread")
            worker.start()
            worker.join()
        after = snapshot(engine, None)
    else:
        # the service reads these when it starts: each side's, the others at their defaults
        with environment({**SERVICE_ENV, **SIDE_ENV.get(side, {})}):
            service = GenerationService(engine, tokenizer, on_stats=lambda stats: None)
        timer = PartTimer() if parts else None
        if timer is not None:
            timer.attach(service)
        before = snapshot(engine, service)
        for i, ids in enumerate(prompts):
            sink = _KeepNothing() if side == "service" else _PipeDone(drained.link, i)
            request = api.GenerateRequest(list(ids), params, True, None, FLAGS)
            start = time.perf_counter()
            service.submit(f"{side}-{i}", request, sink)
            if not sink.done.wait(300):
                raise RuntimeError(f"{side}: request {i} did not finish")
            seconds += time.perf_counter() - start
        after = snapshot(engine, service)
        tokens = service.stats.num_output_tokens
        service.shutdown()
        engine.wait_gate = None
        PartTimer.detach()
    rounds = after["batch_rounds"] - before["batch_rounds"]
    measured = {"tokens_per_s": tokens / seconds, "tokens": tokens, "rounds": rounds,
                **{f"{k}_ms": 1e3 * (after[k] - before[k]) / max(rounds, 1) for k in (*STAGES, "serve")}}
    if service is not None and timer is not None:   # us a round of each part, and its calls a round
        measured["parts_us"] = {name: 1e6 * t / max(rounds, 1) for name, t in timer.seconds.items()}
        measured["parts_calls"] = {name: n / max(rounds, 1) for name, n in timer.calls.items()}
    return measured


def table(result: dict) -> str:
    lines = ["Medians over the turns (ms a round; tok/s each request from its submit to its final response; "
             "vs alone: the median of the turns' ratios):", "",
             "| method | side | tok/s | vs alone | draft | verify | host | serve |", "|---|---|---|---|---|---|---|---|"]
    for method, sides in result["summary"].items():
        for side, s in sides.items():
            lines.append(f"| {method} | {side} | {s['tokens_per_s']:.1f} | {s['vs_alone']:.3f} | {s['draft_ms']:.3f} | "
                         f"{s['verify_ms']:.3f} | {s['host_ms']:.3f} | {s['serve_ms']:.3f} |")
    parts = [(method, side, s["parts_us"]) for method, sides in result["summary"].items()
             for side, s in sides.items() if s.get("parts_us")]
    if parts:
        names = sorted({name for _, _, p in parts for name in p})
        lines += ["", "The serving loop's parts (us a round, median of the turns; --parts; `(outbox)`, `(idle)`: not the "
                  "engine thread's work between rounds):", "",
                  "| method | side | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for method, side, p in parts:
            lines.append(f"| {method} | {side} | " + " | ".join(f"{p.get(name, 0.0):.1f}" for name in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--methods", default="ar,dflash,ddtree-16")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--prompts", type=int, default=10, help="HumanEval prompts a pass")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="time the serving loop's parts on the engine thread "
                        "(adds a timer's cost to the serving sides)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="service_probe_cpu")
    args = parser.parse_args(argv)
    sides, methods = args.sides.split(","), args.methods.split(",")
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(SIDES)}")
    tokenizer = Tokenizer(args.target)
    prompts = encode_prompts(tokenizer, load_problems(None)[: args.prompts])
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_num_seqs=4, max_model_len=max(map(len, prompts)) + args.max_tokens + 1)
    engine = Engine(config)
    engine.warm_up()
    freeze_heap()   # as the served engine, after its warm-up
    served_tokenizer = load_tokenizer(args.target)
    drained = _Drained() if any(side.startswith("pipe") for side in sides) else None
    child = _Child(config) if "child" in sides else None
    result = {"header": header(), "target": args.target, "drafter": args.drafter, "device": args.device,
              "dtype": args.dtype, "methods": methods, "sides": sides, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "turns": [], "summary": {}}
    try:
        for method in methods:   # warm: each side once, unmeasured
            for side in sides:
                run_side(side, engine, served_tokenizer, prompts[:1], params_for(method, 16), drained, child=child)
        for turn in tqdm(range(args.turns), desc="turns"):
            measured = {}
            for method in methods:
                order = sides[turn % len(sides):] + sides[: turn % len(sides)]   # rotated: no side always first
                measured[method] = {side: run_side(side, engine, served_tokenizer, prompts,
                                                   params_for(method, args.max_tokens), drained, args.parts, child)
                                    for side in order}
            result["turns"].append(measured)
    finally:
        if drained is not None:
            drained.close()
        if child is not None:
            child.close()
    for method in methods:
        result["summary"][method] = {}
        for side in sides:
            runs = [turn[method][side] for turn in result["turns"]]
            ratios = [turn[method][side]["tokens_per_s"] / turn[method]["alone"]["tokens_per_s"]
                      for turn in result["turns"]] if "alone" in sides else [float("nan")]
            result["summary"][method][side] = {
                **{key: statistics.median(run[key] for run in runs)
                   for key in ("tokens_per_s", *(f"{k}_ms" for k in (*STAGES, "serve")))},
                "vs_alone": statistics.median(ratios), "vs_alone_turns": ratios}
            if all(run.get("parts_us") for run in runs):
                names = set().union(*(run["parts_us"] for run in runs))
                result["summary"][method][side]["parts_us"] = {
                    name: statistics.median(run["parts_us"].get(name, 0.0) for run in runs) for name in names}
    write_results(Path(args.out), args.name, result, table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
