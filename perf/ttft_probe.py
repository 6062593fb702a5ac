"""Where a request's time to first token goes under concurrency, in process, with timestamps.

C closed-loop streams run through GenerationService (each stream submits its next request when its last one ended, as
perf_analyzer's concurrency mode does; the responses kept by a sink, no IPC). Each request's time to its first
response is split at:

- `take`: submit to the engine thread taking the job (GenerationService._start: the engine's queue);
- `admit`: from there to the start of the engine step that prefills it (a step in progress, or a full batch);
- `prefill`: that step's prefill of the arrivals (Engine._prefill: all the requests admitted together);
- `send`: the prefill's end to the first response leaving the outbox (the step's decoding round of the others, the
  response building and the outbox).

The steps themselves are listed too (mean ms of the steps that prefill and of those that do not, and how many requests
each prefill took), which says whether arrivals wait for steps or the steps for arrivals.

    python perf/ttft_probe.py --device cuda --dtype bfloat16 --target models/smollm2-shaped \\
        --drafter models/smollm2-shaped-dflash --concurrency 16,32 --name ttft_probe_h200
"""

from __future__ import annotations

import argparse
import json
import random
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
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.serving import GenerationService  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, frozen_heap, header, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402

PARTS = ("take", "admit", "prefill", "send")


class Clock:
    """Timestamps by request (the engine's request id: the service's job key) and of every engine step."""

    def __init__(self, service: GenerationService) -> None:
        self.at: dict[str, dict[str, float]] = {}
        self.steps: list[tuple[float, float, int]] = []   # (start, end, requests prefilled in it)
        self._prefilled = 0
        engine, start, prefill, step = service.engine, service._start, service.engine._prefill, service.engine.step

        def timed_start(job):
            self.at.setdefault(job.key, {})["take"] = time.perf_counter()
            return start(job)

        def timed_prefill(seqs):
            t0 = time.perf_counter()
            outputs = prefill(seqs)
            t1 = time.perf_counter()
            for seq in seqs:
                self.at.setdefault(seq.request.request_id, {}).update(admit=t0, prefill=t1)
            self._prefilled += len(seqs)
            return outputs

        def timed_step():
            t0, self._prefilled = time.perf_counter(), 0
            outputs = step()
            self.steps.append((t0, time.perf_counter(), self._prefilled))
            return outputs

        service._start, engine._prefill, engine.step = timed_start, timed_prefill, timed_step


class StreamSink:
    """One request's responses: the time of its first, and its end (which submits the stream's next request)."""

    def __init__(self, on_end) -> None:
        self.first: float | None = None
        self.tokens, self.error, self.on_end = 0, None, on_end

    def is_cancelled(self) -> bool:
        return False

    def send(self, outputs: dict, final: bool) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.tokens += outputs.get(api.NUM_OUTPUT_TOKENS, 0)
        if final:
            self.on_end(self)

    def send_error(self, message: str, kind: str, final: bool = True) -> None:
        self.error = message
        self.on_end(self)


def run_level(service: GenerationService, clock: Clock, prompts: list[list[int]], params: SamplingParams,
              concurrency: int, per_stream: int, timeout_s: float, think_s: float = 0.0) -> dict:
    """C streams of per_stream requests each; the requests' split times and the steps' over the whole run. think_s:
    a stream waits uniform(0, 2 think_s) before each request (its first too), so that arrivals spread as a client's
    and a server's own delays spread them (0: each stream's next request at once: equal lengths end together)."""
    rng = random.Random(0)
    done = threading.Event()
    lock = threading.Lock()
    records, remaining, counter = [], [concurrency * per_stream], [0]
    clock.at.clear()
    clock.steps.clear()

    def submit(stream: int) -> None:
        with lock:
            i = counter[0]
            counter[0] += 1
        request = api.GenerateRequest(prompt_ids=list(prompts[i % len(prompts)]), params=params, stream=True,
                                      echo_text=None,
                                      return_flags={name: name == "return_num_output_tokens" for name in api.RETURN_FLAGS})
        record = {"stream": stream, "submit": time.perf_counter()}

        def on_end(sink: StreamSink) -> None:
            record.update(end=time.perf_counter(), first=sink.first, tokens=sink.tokens, error=sink.error)
            with lock:
                records.append(record)
                remaining[0] -= 1
                left = remaining[0]
                again = counter[0] < concurrency * per_stream
            if again:
                later(stream)
            if left == 0:
                done.set()

        sink = StreamSink(on_end)
        before = set(service._by_key)
        service.submit(f"probe-{i}", request, sink)
        record["key"] = next(iter(set(service._by_key) - before), None)

    def later(stream: int) -> None:
        if think_s > 0:
            threading.Timer(rng.uniform(0, 2 * think_s), submit, (stream,)).start()
        else:
            submit(stream)

    t0 = time.perf_counter()
    for stream in range(concurrency):
        later(stream)
    if not done.wait(timeout_s):
        raise RuntimeError(f"{remaining[0]} requests did not finish in {timeout_s} s")
    seconds = time.perf_counter() - t0
    errors = [r["error"] for r in records if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    parts = {name: [] for name in PARTS + ("ttft",)}
    for r in records:
        at = clock.at.get(r["key"], {})
        if not {"take", "admit", "prefill"} <= set(at):
            continue
        bounds = [r["submit"], at["take"], at["admit"], at["prefill"], r["first"]]
        for name, (a, b) in zip(PARTS, zip(bounds, bounds[1:])):
            parts[name].append(1000 * (b - a))
        parts["ttft"].append(1000 * (r["first"] - r["submit"]))
    prefilling = [1000 * (b - a) for a, b, n in clock.steps if n]
    decoding = [1000 * (b - a) for a, b, n in clock.steps if not n]
    return {
        "tokens_per_s": sum(r["tokens"] for r in records) / seconds,
        "num_requests": len(records),
        "ms": {name: {"mean": statistics.fmean(v), "p50": statistics.median(v)} for name, v in parts.items() if v},
        "steps": {"prefilling": len(prefilling), "decoding": len(decoding),
                  "prefilling_ms": statistics.fmean(prefilling) if prefilling else 0.0,
                  "decoding_ms": statistics.fmean(decoding) if decoding else 0.0,
                  "requests_per_prefill": statistics.fmean([n for *_, n in clock.steps if n]) if prefilling else 0.0},
    }


def table(result: dict) -> str:
    rows = [f"Engine settings: `{json.dumps(result['settings'])}`; a stream's mean wait before each request: "
            f"{result.get('think_ms', 0.0):g} ms.", "",
            "Time to first response, in process (ms, mean / p50), split where the request waits; the steps: mean ms "
            "of those that prefill arrivals (and how many requests each prefill took) and of those that only decode.",
            "", "| method | streams | tok/s | " + " | ".join(PARTS) + " | TTFT | prefilling steps | decoding steps |",
            "|---|---|---|" + "---|" * (len(PARTS) + 3)]
    for key, r in result["runs"].items():
        method, level = key.split("@")
        ms, steps = r["ms"], r["steps"]
        cells = [f"{ms[n]['mean']:.1f} / {ms[n]['p50']:.1f}" for n in PARTS + ("ttft",)]
        rows.append(f"| {method} | {level} | {r['tokens_per_s']:.0f} | " + " | ".join(cells)
                    + f" | {steps['prefilling']} x {steps['prefilling_ms']:.1f} ms ({steps['requests_per_prefill']:.1f} "
                    f"requests) | {steps['decoding']} x {steps['decoding_ms']:.2f} ms |")
    return "\n".join(rows) + "\n"


def setting(value: str):
    """An --engine value as EngineConfig takes it: an int, a float, true/false, or the string."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--methods", default="ar", help="comma-separated modes: ar, dflash, auto, ddtree")
    parser.add_argument("--concurrency", default="16,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=8)
    parser.add_argument("--engine", action="append", default=[], help="KEY=VALUE engine settings (EngineConfig)")
    parser.add_argument("--think-ms", type=float, default=0.0, help="a stream's mean wait before each request "
                        "(uniform, 0 to twice this): spread arrivals")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="ttft_probe_cpu")
    add_freeze_heap_arg(parser)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = encode_prompts(Tokenizer(args.target), json.loads((ROOT / "perf/prompts.json").read_text()))
    settings = {key: setting(value) for key, _, value in (item.partition("=") for item in args.engine)}
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_num_seqs=max(levels), max_model_len=max(map(len, prompts)) + args.max_tokens + 64,
                          **settings)
    engine = Engine(config)
    engine.warm_up()
    service = GenerationService(engine, Tokenizer(args.target))
    clock = Clock(service)
    result = {"header": header(), "name": args.name, "settings": settings, "think_ms": args.think_ms,
              "freeze_heap": args.freeze_heap, "runs": {}}
    try:
        with frozen_heap(args.freeze_heap):
            for method in tqdm(args.methods.split(","), desc="methods"):
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, mode=method, seed=0)
                for level in levels:
                    run_level(service, clock, prompts, params, level, 1, args.timeout_s)   # unmeasured: programs, caches
                    result["runs"][f"{method}@{level}"] = run_level(service, clock, prompts, params, level,
                                                                    args.requests_per_stream, args.timeout_s,
                                                                    args.think_ms / 1e3)
    finally:
        service.shutdown()
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
