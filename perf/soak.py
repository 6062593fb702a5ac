"""Bounded soak through a real tritonserver: mixed streaming load with cancellations, then nothing may be left.

Starts its own server (perf/triton_bench.py's make_repository + TritonServer, continuous batching with
--max-num-seqs slots) and runs --clients concurrent gRPC streaming clients against the ensemble for --duration-s
seconds. Each client loops over random requests: chat prompts from perf/prompts.json, mixed modes and budgets
(--methods), through the ensemble or the generation model alone (--models), greedy or sampled, and a random
--cancel-fraction of them cancelled (stop_stream(cancel_requests=True)) after a random number of responses or a
random delay.

Checks:
  * every request ends with exactly one final response, or with one cancellation; no errors, no response after
    the final one (the stream is closed and drained after it), nothing hung (--response-timeout-s);
  * no lost or duplicated tokens: every greedy streamed request (prompt, method, max_tokens) streams exactly the
    text, token count and finish reason of the same request sent non-streamed, computed once per combination
    (a second non-streamed run of a combination must agree too); sampled requests stream at most max_tokens tokens
    (exactly max_tokens with ignore_eos) and never a broken UTF-8 character;
  * at the end the server's metrics show zero active and waiting requests and zero held cache slots, every request
    the engine saw ended exactly once there (finished + cancelled + failed + refused == sent, less the cancellations
    that stopped a request before it reached the engine), and the server log has no engine error or traceback.

Writes <out>/soak_<name>.{json,md}; exits 1 if a check failed.

    python perf/soak.py --duration-s 600 --name cpu                      # CPU, embedded default, 10 minutes
    python perf/soak.py --duration-s 120 --name cpu_smoke --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tritonclient.grpc as grpcclient  # noqa: E402

from client.chat import build_inputs  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from perf.bench import Method  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402
from perf.triton_bench import TritonServer, make_repository, scrape_metrics  # noqa: E402

GAUGES = ("ddtree_active_requests", "ddtree_waiting_requests", "ddtree_held_cache_slots", "ddtree_engine_healthy")
COUNTERS = ("ddtree_requests_finished_total", "ddtree_requests_cancelled_total", "ddtree_requests_failed_total",
            "ddtree_requests_overloaded_total", "ddtree_output_tokens_total", "ddtree_batch_rounds_total")
LOG_ERRORS = ("engine step failed", "fatal engine error", "Stub process")   # any of these fails the soak
LOG_NOTES = ("Traceback", "could not send")                                  # reported


@dataclass
class Job:
    id: str
    prompt: int
    method: Method
    max_tokens: int
    greedy: bool
    ignore_eos: bool
    stream: bool = True
    seed: int = 0
    model: str = "ensemble"                     # the Triton model asked (--models)
    cancel_after_responses: int | None = None   # cancel when this many responses have arrived ...
    cancel_after_s: float | None = None         # ... or after this long, whichever comes first

    @property
    def key(self) -> tuple:
        return (self.prompt, self.method.name, self.max_tokens, self.ignore_eos)

    def sampling(self) -> dict:
        params = {"max_tokens": self.max_tokens, "mode": self.method.mode, "tree_budget": self.method.budget,
                  "ignore_eos": self.ignore_eos}
        if self.greedy:
            params["temperature"] = 0
        else:
            params.update(temperature=0.8, top_p=0.95, seed=self.seed)
        return params


@dataclass
class Outcome:
    job: Job
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    finals: int = 0
    errors: list[str] = field(default_factory=list)
    after_final: int = 0                 # responses that arrived after the final one
    finish_reason: str = ""
    cancelled: bool = False
    hung: bool = False
    seconds: float = 0.0
    ttft_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def run_request(url: str, prompt: str, job: Job, timeout_s: float) -> Outcome:
    """One request on its own gRPC stream; the stream is closed and drained after the final response."""
    out, responses = Outcome(job), queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    start = time.perf_counter()
    cancel_at = start + job.cancel_after_s if job.cancel_after_s is not None else None
    try:
        client.async_stream_infer(job.model, build_inputs([{"role": "user", "content": prompt}], job.sampling(),
                                                           stream=job.stream),
                                  request_id=job.id, enable_empty_final_response=True)
        num_responses = 0
        while True:
            wait = timeout_s if cancel_at is None else max(0.0, min(timeout_s, cancel_at - time.perf_counter()))
            try:
                result, error = responses.get(timeout=wait)
            except queue.Empty:
                if cancel_at is not None and time.perf_counter() >= cancel_at:
                    out.cancelled = True
                else:
                    out.hung = True
                break
            if error is not None:
                out.errors.append(str(error))
                break
            num_responses += 1
            response = result.get_response()
            array = result.as_numpy("text_output")
            text = b"".join(array.tolist()).decode("utf-8", "replace") if array is not None else ""
            if text and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
            out.texts.append(text)
            tokens = result.as_numpy("num_output_tokens")
            out.tokens += int(tokens[0]) if tokens is not None else 0
            if response.parameters["triton_final_response"].bool_param:
                out.finals += 1
                reason = result.as_numpy("finish_reason")
                out.finish_reason = reason[0].decode() if reason is not None else ""
                break
            if job.cancel_after_responses is not None and num_responses >= job.cancel_after_responses:
                out.cancelled = True
                break
    finally:
        out.seconds = time.perf_counter() - start
        if out.cancelled or out.hung:
            client.stop_stream(cancel_requests=True)
        else:
            client.stop_stream()        # waits for the server to close the stream: everything it sent has arrived
            while not responses.empty():
                result, error = responses.get_nowait()
                out.after_final += 1
                if error is not None:
                    out.errors.append(f"after the final response: {error}")
        client.close()
    return out


class Soak:
    def __init__(self, args, prompts: list[str], methods: list[Method]):
        self.args, self.prompts, self.methods = args, prompts, methods
        self.lock = threading.Lock()
        self.references: dict[tuple, Outcome] = {}
        self.outcomes: list[Outcome] = []
        self.failures: list[str] = []
        self.counts: Counter = Counter()
        self.num_sent = 0

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)

    def make_job(self, rng: random.Random, job_id: str) -> Job:
        args = self.args
        greedy = rng.random() < args.greedy_fraction
        prompt = rng.randrange(min(args.greedy_prompts, len(self.prompts)) if greedy else len(self.prompts))
        job = Job(job_id, prompt, rng.choice(self.methods), rng.choice(args.max_tokens), greedy,
                  ignore_eos=True if greedy else rng.random() < 0.5, seed=rng.randrange(2**31))
        if len(args.models) > 1:   # one model: the same jobs as before --models
            job.model = rng.choice(args.models)
        if rng.random() < args.cancel_fraction:
            if rng.random() < 0.5:
                job.cancel_after_responses = rng.randint(1, 4)
            else:
                job.cancel_after_s = rng.uniform(0.0, 3.0)
        return job

    def send(self, job: Job) -> Outcome:
        with self.lock:
            self.num_sent += 1
        out = run_request(self.server.grpc_url, self.prompts[job.prompt], job, self.args.response_timeout_s)
        with self.lock:
            self.outcomes.append(out)
        self.check_ending(out)
        return out

    def check_ending(self, out: Outcome) -> None:
        job = out.job
        where = f"{job.id} ({job.method.name}, max_tokens {job.max_tokens}, {'greedy' if job.greedy else 'sampled'})"
        if out.hung:
            self.fail(f"{where}: no response for {self.args.response_timeout_s} s")
        elif out.errors:
            self.fail(f"{where}: errors {out.errors[:3]}")
        elif out.cancelled:
            pass   # one cancellation ends it; the server's side is checked at the end
        elif out.finals != 1 or out.after_final:
            self.fail(f"{where}: {out.finals} final responses, {out.after_final} responses after the final one")
        elif any("\ufffd" in t for t in out.texts):
            self.fail(f"{where}: a broken UTF-8 character in the stream")
        elif out.tokens > job.max_tokens or (job.ignore_eos and out.tokens != job.max_tokens):
            self.fail(f"{where}: {out.tokens} tokens streamed (max_tokens {job.max_tokens}, ignore_eos {job.ignore_eos})")

    def reference(self, job: Job) -> Outcome | None:
        """The non-streamed result of a greedy combination, computed once (a second computation must agree)."""
        with self.lock:
            known = self.references.get(job.key)
        if known is not None:
            return known
        # through the job's model: a combination's streams are checked against whichever route computed it first
        ref_job = Job(job.id + "-ref", job.prompt, job.method, job.max_tokens, True, job.ignore_eos, stream=False,
                      model=job.model)
        out = self.send(ref_job)
        self.counts["greedy_reference"] += 1
        if out.hung or out.errors or out.finals != 1 or len(out.texts) != 1:
            return None
        with self.lock:
            known = self.references.setdefault(job.key, out)
        if known is not out and (known.text, known.tokens) != (out.text, out.tokens):
            self.fail(f"{ref_job.id}: two non-streamed runs of {job.key} differ: {known.text[:80]!r} vs {out.text[:80]!r}")
        return known

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            job = self.make_job(rng, f"soak-c{index}-{n}")
            try:
                ref = self.reference(job) if job.greedy and job.cancel_after_responses is None \
                    and job.cancel_after_s is None else None
                if time.monotonic() >= deadline:
                    break
                out = self.send(job)
            except Exception as e:  # a client-side failure is a soak failure, not a crash of the soak
                self.fail(f"{job.id}: client exception {type(e).__name__}: {e}")
                continue
            kind = "cancelled" if out.cancelled else "greedy_checked" if ref is not None else \
                "greedy" if job.greedy else "sampled"
            self.counts[kind] += 1
            if ref is not None and not (out.cancelled or out.hung or out.errors):
                if (out.text, out.tokens, out.finish_reason) != (ref.text, ref.tokens, ref.finish_reason):
                    self.fail(f"{job.id} ({job.method.name}): streamed {out.tokens} tokens {out.text[:60]!r}... "
                              f"({out.finish_reason}) != non-streamed {ref.tokens} tokens {ref.text[:60]!r}... "
                              f"({ref.finish_reason})")

    def run(self, server: TritonServer) -> float:
        self.server = server
        deadline = time.monotonic() + self.args.duration_s
        threads = [threading.Thread(target=self.client, args=(i, deadline), daemon=True)
                   for i in range(self.args.clients)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, deadline - time.monotonic()) + 2 * self.args.response_timeout_s)
            if thread.is_alive():
                self.fail(f"{thread.name}: still running {2 * self.args.response_timeout_s:.0f} s after the deadline")
        return time.monotonic() - start


def metrics(server: TritonServer) -> dict[str, float]:
    return scrape_metrics(server.metrics_url, GAUGES + COUNTERS)


def settle(server: TritonServer, timeout_s: float = 120.0) -> dict[str, float]:
    """Metrics once nothing is active, waiting or held (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(server)
        idle = all(values.get(g, 0) == 0 for g in GAUGES[:3])
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def summarize(soak: Soak, elapsed: float, before: dict, after: dict, log_text: str) -> dict:
    args, outcomes = soak.args, soak.outcomes
    per_method = {}
    for method in soak.methods:
        done = [o for o in outcomes if o.job.method == method and o.job.stream and o.finals == 1 and not o.errors]
        ttfts = [o.ttft_s * 1000 for o in done if o.ttft_s is not None]
        rates = [o.tokens / o.seconds for o in done if o.seconds > 0 and o.tokens]
        per_method[method.name] = {"requests": sum(o.job.method == method for o in outcomes), "completed_streams": len(done),
                                   "tokens": sum(o.tokens for o in done), "ttft_ms_p50": percentile(ttfts, 0.5),
                                   "ttft_ms_p95": percentile(ttfts, 0.95),
                                   "request_tokens_per_s_p50": statistics.median(rates) if rates else None}
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    cancels = sum(o.cancelled for o in outcomes)
    server_ends = sum(delta[name] for name in COUNTERS[:4])
    log_errors = {marker: log_text.count(marker) for marker in LOG_ERRORS + LOG_NOTES}
    checks = {
        "every request ended once (final or cancellation), nothing hung": not soak.failures,
        "greedy streamed text == non-streamed text": not any("!= non-streamed" in f or "differ" in f for f in soak.failures),
        "greedy requests checked": soak.counts["greedy_checked"] > 0,
        "zero active / waiting requests at the end": after.get(GAUGES[0], 0) == 0 and after.get(GAUGES[1], 0) == 0,
        "zero held cache slots at the end": after.get(GAUGES[2], 0) == 0,
        "engine healthy at the end": after.get(GAUGES[3], 1) == 1,
        "server ended each request once": soak.num_sent - cancels <= server_ends <= soak.num_sent,
        "no engine errors in the server log": not any(log_errors[marker] for marker in LOG_ERRORS),
    }
    tokens = sum(o.tokens for o in outcomes)
    return {
        "header": header(),
        "config": {"duration_s": args.duration_s, "clients": args.clients, "max_num_seqs": args.max_num_seqs,
                   "max_queue_size": args.max_queue_size, "max_model_len": args.max_model_len,
                   "methods": [m.name for m in soak.methods], "models": args.models, "max_tokens": args.max_tokens,
                   "greedy_fraction": args.greedy_fraction, "greedy_prompts": args.greedy_prompts,
                   "cancel_fraction": args.cancel_fraction, "seed": args.seed, "target": args.target,
                   "drafter": args.drafter, "device": args.device, "dtype": args.dtype},
        "elapsed_s": elapsed,
        "requests": {"sent": soak.num_sent, **dict(soak.counts), "cancelled_by_client": cancels,
                     "greedy_combinations": len(soak.references),
                     "by_model": dict(Counter(o.job.model for o in outcomes))},
        "tokens_streamed": tokens, "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "server_counters_delta": delta, "server_ends": server_ends, "metrics_end": after,
        "server_log_errors": log_errors, "per_method": per_method, "checks": checks,
        "failures": soak.failures[:50], "num_failures": len(soak.failures), "passed": all(checks.values()),
    }


def table(result: dict) -> str:
    fmt = lambda v, spec=".0f": "-" if v is None else format(v, spec)
    req = result["requests"]
    lines = [f"{result['elapsed_s']:.0f} s, {result['config']['clients']} clients, max_num_seqs "
             f"{result['config']['max_num_seqs']}: {req['sent']} requests ({req.get('greedy_checked', 0)} greedy checked "
             f"against {req['greedy_combinations']} non-streamed references, {req.get('sampled', 0)} sampled, "
             f"{req['cancelled_by_client']} cancelled), {result['tokens_streamed']} tokens streamed, "
             f"{result['tokens_per_s']:.1f} tokens/s"
             + (f"; by model: {json.dumps(req['by_model'])}" if len(req.get("by_model", {})) > 1 else "")
             + f". **{'PASSED' if result['passed'] else 'FAILED'}**", "",
             "| check | |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in result["checks"].items()]
    lines += ["", "| method | requests | completed streams | tokens | TTFT p50 ms | TTFT p95 ms | tokens/s p50 (per request) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in result["per_method"].items():
        lines.append(f"| {name} | {row['requests']} | {row['completed_streams']} | {row['tokens']} | "
                     f"{fmt(row['ttft_ms_p50'])} | {fmt(row['ttft_ms_p95'])} | {fmt(row['request_tokens_per_s_p50'], '.1f')} |")
    delta = result["server_counters_delta"]
    lines += ["", "server: " + ", ".join(f"{k.removeprefix('ddtree_')} +{v:.0f}" for k, v in delta.items())
              + "; at the end " + ", ".join(f"{k.removeprefix('ddtree_')} {v:.0f}" for k, v in result["metrics_end"].items()
                                            if k in GAUGES)]
    if result["failures"]:
        lines += ["", "failures (first 50):", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "perf" / "results"))
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-queue-size", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--methods", default="ar:1,dflash:1,ddtree:4,ddtree:16,ddtree:32,auto:32",
                        help="mode:tree_budget,... (the budget is ignored by ar and dflash)")
    parser.add_argument("--max-tokens", default="16,40", help="max_tokens choices")
    parser.add_argument("--models", default="ensemble", type=lambda text: text.split(","),
                        help="the Triton models a request goes to, one at random a request: ensemble, ddtree (the "
                             "generation model alone)")
    parser.add_argument("--greedy-fraction", type=float, default=0.6)
    parser.add_argument("--greedy-prompts", type=int, default=3,
                        help="greedy requests use the first N prompts (fewer combinations to compute references for)")
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--response-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.max_tokens = [int(v) for v in args.max_tokens.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = [Method(mode, int(budget)) for mode, budget in (item.split(":") for item in args.methods.split(","))]
    prompts = json.loads((ROOT / "perf" / "prompts.json").read_text())
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_tree_budget=max(m.budget for m in methods))
    soak = Soak(args, prompts, methods)
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repository(config, Path(tmp), {"max_num_seqs": str(args.max_num_seqs),
                                                   "max_queue_size": str(args.max_queue_size),
                                                   "max_model_len": str(args.max_model_len),
                                                   "max_tokens_limit": str(max(args.max_tokens))})
        log_path = Path(tmp) / "server.log"
        with TritonServer(str(repo), log_path=str(log_path)) as server:
            before = metrics(server)
            print(f"soak: {args.clients} clients for {args.duration_s:.0f} s against {server.grpc_url}", flush=True)
            elapsed = soak.run(server)
            after = settle(server)
        result = summarize(soak, elapsed, before, after, log_path.read_text(errors="replace"))
        if not result["passed"]:
            result["server_log_tail"] = log_path.read_text(errors="replace").splitlines()[-80:]
    write_results(Path(args.out), f"soak_{args.name}", result, table(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
