"""Where the serving path's overhead comes from, one suspect at a time, in one run.

Triton's Python backend runs model.py in a stub process that embeds the shared libpython, on an engine thread beside an
outbox thread (responses, metrics); with engine_process (the model's default on CUDA since 2026-12-06) the engine and its
outbox run in a child process of the stub under a plain interpreter (ddtree/engine_process.py). Through Triton the
engine's stages ran slower than in process on the stub's thread (perf/humaneval.py's stage table; on the H200 even the
verify's GPU timeline, a sign of host-bound rounds). This separates the suspects
without Triton, with the same engine and requests:

- `alone`: the engine's own loop (Engine.generate_ids), as the in-process benchmarks run it;
- `service`: the same requests through GenerationService (engine thread + outbox thread, a sink that keeps the
  responses), the threads and per-round response building the Triton model has, with no IPC;
- `triton`: the same prompts (as chat messages) through a real tritonserver's ensemble, the engine's stage times from
  the model's metrics; `triton final` the same with stream=false (one response per request instead of one per round:
  the per-round IPC, ensemble and client work gone, the stub and the server the same); each --triton-args variant
  starts its own server (e.g. without GPU metrics or memory pools), and the CPU seconds of the server's processes
  (server, each model's stub) and of this client over each measured window are recorded;
- each under the interpreter running this script and, with --shared-python, again under a launcher linked against the
  shared libpython (the stub's interpreter: scripts/build_shared_python.sh builds one); the triton side runs once.

DDTREE_PROFILE=<dir>:<skip>:<steps> (ddtree/profiling.py) profiles a window of the service's steps, in process and
inside the stub alike.

    python perf/serve_overhead.py --device cuda --dtype bfloat16 --shared-python .deps/pyshared --name serve_overhead_h200
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.chat import ChatStream  # noqa: E402
from ddtree import api  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.serving import GenerationService  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.bench import Method  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, engine_stages, frozen_heap, header, per_round_ms, write_results  # noqa: E402
from perf.humaneval import encode_prompts  # noqa: E402
from perf.probe_workload import busy_threads, cpu_of, proc_stat, thread_cpu  # noqa: E402

SIDES = ("alone", "service", "triton")
TRITON_SIDES = {"stream": "triton", "final": "triton final"}   # --triton-streams value -> side name


class KeepingSink:
    """A response sink that keeps what it is sent: the service's per-round work, no IPC."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.num_responses, self.num_tokens, self.error = 0, 0, None

    def is_cancelled(self) -> bool:
        return False

    def send(self, outputs: dict, final: bool) -> None:
        self.num_responses += 1
        self.num_tokens += outputs.get(api.NUM_OUTPUT_TOKENS, 0)
        if final:
            self.done.set()

    def send_error(self, message: str, kind: str, final: bool = True) -> None:
        self.error = message
        self.done.set()


def params_for(method: Method, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=method.mode, tree_budget=method.budget, seed=0)


def run_alone(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> int:
    return sum(engine.generate_ids(ids, params).num_output_tokens for ids in prompts)


def run_service(service: GenerationService, prompts: list[list[int]], params: SamplingParams, timeout_s: float) -> int:
    tokens = 0
    for i, ids in enumerate(prompts):
        sink = KeepingSink()
        request = api.GenerateRequest(prompt_ids=list(ids), params=params, stream=True, echo_text=None,
                                      return_flags={name: name == "return_num_output_tokens" for name in api.RETURN_FLAGS})
        service.submit(f"overhead-{i}", request, sink)
        if not sink.done.wait(timeout_s) or sink.error:
            raise RuntimeError(f"request {i} did not finish: {sink.error or 'timeout'}")
        tokens += sink.num_tokens   # what the responses carried (as a client counts them)
    return tokens


def engine_config(args: argparse.Namespace, prompts: list[list[int]], methods: list[Method]) -> EngineConfig:
    return EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                        max_tree_budget=max([m.budget for m in methods] + [16]), max_num_seqs=args.max_num_seqs,
                        max_model_len=max(map(len, prompts)) + args.max_tokens + 64)


def gpu_processes() -> list[str]:
    """nvidia-smi's compute processes (pid, name, memory), [] where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def server_processes(session: int) -> dict[int, str]:
    """{pid: label} of the processes in a server's session (tritonserver started with start_new_session): the server
    and each Python model's stub, labelled by the model directory its command line names. {} without /proc."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = proc_stat(str(entry / "stat"))[1]
            if int(fields[3]) != session:   # fields after the name: state ppid pgrp session ...
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        name = Path(argv[0].decode(errors="replace")).name
        model = next((Path(a.decode(errors="replace")).parent.parent.name for a in argv if a.endswith(b"model.py")), "")
        # the generation model's engine in a child of its stub (engine_process, the default on CUDA)
        found[int(entry.name)] = ("engine process" if b"ddtree.engine_process" in argv else
                                  f"stub {model}" if model else name)
    return found


def cpu_seconds(pids: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far, by label; this process as `client`."""
    used = {}
    for pid, label in pids.items():
        try:
            used[label] = used.get(label, 0.0) + cpu_of(proc_stat(f"/proc/{pid}/stat")[1])
        except (OSError, ValueError, IndexError):
            continue
    times = os.times()
    used["client"] = times.user + times.system
    return used


@contextmanager
def serving(config: EngineConfig, server_args: list[str]):
    """A real tritonserver serving `config` (the in-process engine's own cache sizes, so the same static shapes)."""
    from perf.triton_bench import TritonServer, make_repository

    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repository(config, Path(tmp), extra={"max_model_len": str(config.max_model_len),
                                                         "max_num_seqs": str(config.max_num_seqs)})
        with TritonServer(str(repo), log_path=str(Path(tmp) / "server.log"), extra_args=server_args) as server:
            yield server


def triton_pass(server, texts: list[str], method: Method, max_tokens: int, stream: bool, warm: bool = True,
                stream_interval: int = 1, chat=None) -> dict:
    """The requests (as chat messages) through the server's ensemble over one open gRPC stream (`chat`, a
    client.chat.ChatStream, as a perf_analyzer worker keeps; None: a connection per request), one at a time: tokens/s, the
    engine's stage times from the model's metrics, the CPU seconds of the server's processes and this client per
    request, and the busiest threads of the process that runs the engine (its own child of the stub under
    engine_process, the default on CUDA; else the generation stub)."""
    from perf.humaneval import stream_one
    from perf.triton_bench import triton_stages, wait_stages

    pids = server_processes(server.process.pid)
    # the process whose threads run the engine: its own process under engine_process, else the generation stub
    engine_pid = next((pid for label_wanted in ("engine process", "stub ddtree")
                       for pid, label in pids.items() if label == label_wanted), None)
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "mode": method.mode, "tree_budget": method.budget,
                "seed": 0, "stream_interval": stream_interval}
    if warm:
        stream_one(server.grpc_url, texts[0], sampling, stream, chat)   # unmeasured, as on the other sides
    before, cpu_before = triton_stages(server.metrics_url), cpu_seconds(pids)
    threads_before = thread_cpu(engine_pid) if engine_pid else {}
    start = time.perf_counter()
    runs = [stream_one(server.grpc_url, t, sampling, stream, chat)
            for t in tqdm(texts, desc=f"triton {method.name}", leave=False)]
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in runs)
    cpu = {k: (v - cpu_before.get(k, 0.0)) / len(texts) for k, v in cpu_seconds(pids).items()}
    threads = busy_threads(threads_before, thread_cpu(engine_pid), seconds, 0, engine_pid) if engine_pid else []
    return {"tokens_per_s": tokens / seconds, "num_tokens": tokens, "seconds": seconds, "cpu_s_per_request": cpu,
            "num_input_tokens": [r["num_input_tokens"] for r in runs], "engine_stub_threads": threads,
            "stages": per_round_ms(before, wait_stages(server.metrics_url, before))}


def measure_triton(config: EngineConfig, texts: list[str], methods: list[Method], max_tokens: int,
                   server_args: list[str], streams: list[str]) -> tuple[dict, list[str]]:
    """{side: {method: triton_pass()}} for each of `streams` (a response per round, or final-only), and the processes
    on the GPU while the server served."""
    result = {TRITON_SIDES[s]: {} for s in streams}
    with serving(config, server_args) as server, ChatStream(server.grpc_url) as chat:
        processes = gpu_processes()   # the CUDA contexts on the GPU while the server serves
        for stream in streams:
            for method in methods:
                result[TRITON_SIDES[stream]][method.name] = triton_pass(server, texts, method, max_tokens,
                                                                        stream == "stream", chat=chat)
    return result, processes


def timed_alone(engine: Engine, prompts: list[list[int]], method: Method, max_tokens: int) -> dict:
    params = params_for(method, max_tokens)
    before = engine_stages(engine)
    start = time.perf_counter()
    tokens = run_alone(engine, prompts, params)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "num_tokens": tokens, "seconds": seconds,
            "num_input_tokens": [len(ids) for ids in prompts], "stages": per_round_ms(before, engine_stages(engine))}


def interleaved(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]], texts: list[str],
                methods: list[Method]) -> dict:
    """The engine alone and through Triton in turns, `--repeats` times, with both alive at once: pairs measured
    under the same machine conditions (host-bound rounds follow the CPU's speed, which drifts: perf/host_speed.py).
    Before each pair, this process's interpreter speed (a pure-Python loop) is recorded as a reading of the host."""
    from perf.probe_workload import python_loop_ms

    engine = Engine(config)
    engine.warm_up()
    turns = []
    with serving(config, shlex.split(args.triton_args[0])) as server, ChatStream(server.grpc_url) as chat, \
            frozen_heap(args.freeze_heap):   # this process's engine as the server's (which froze its own)
        stream = args.triton_streams[0] == "stream"
        for method in methods:   # a whole unmeasured pair first: the first measured alone pass ran slow on the H200
            run_alone(engine, prompts, params_for(method, args.max_tokens))
            triton_pass(server, texts, method, args.max_tokens, stream, warm=False, chat=chat)
        for repeat in tqdm(range(args.repeats), desc="pairs"):
            for method in methods:
                for interval in args.stream_intervals:
                    host = sorted(python_loop_ms() for _ in range(5))[2]
                    alone = timed_alone(engine, prompts, method, args.max_tokens)
                    triton = triton_pass(server, texts, method, args.max_tokens, stream, warm=False,
                                         stream_interval=interval, chat=chat)
                    turns.append({"repeat": repeat, "method": method.name, "stream_interval": interval,
                                  "host_loop_ms": host, "alone": alone, "triton": triton,
                                  "ratio": triton["tokens_per_s"] / alone["tokens_per_s"]})
    summary = {}
    for method in methods:
        for interval in args.stream_intervals:
            ratios = sorted(t["ratio"] for t in turns if t["method"] == method.name and t["stream_interval"] == interval)
            summary[f"{method.name}, stream_interval {interval}"] = {
                "median_ratio": statistics.median(ratios), "min_ratio": ratios[0], "max_ratio": ratios[-1]}
    return {"side": TRITON_SIDES[args.triton_streams[0]], "server_args": args.triton_args[0], "turns": turns,
            "summary": summary}


@contextmanager
def foreign_context(device: str):
    """Another process holding a CUDA context on the device (as tritonserver does beside its model's stub), idle."""
    if not device.startswith("cuda"):
        yield
        return
    index = device.partition(":")[2] or "0"
    code = f"import sys, torch; torch.zeros(1, device='cuda:{index}'); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        yield
    finally:
        child.stdin.close()
        child.wait(30)


def measure(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]], methods: list[Method]) -> dict:
    """{side: {method: tokens/s and per-round stage ms}} under this interpreter, for the in-process sides."""
    with foreign_context(args.device) if args.foreign_context else nullcontext():
        return _measure(args, config, prompts, methods)


def _measure(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]], methods: list[Method]) -> dict:
    engine = Engine(config)
    engine.warm_up()
    service = None
    result: dict = {side: {} for side in args.sides if side != "triton"}
    try:
        with frozen_heap(args.freeze_heap):
            for side in result:
                if side == "service" and service is None:
                    service = GenerationService(engine, Tokenizer(args.target))
                for method in methods:
                    params = params_for(method, args.max_tokens)
                    run = (lambda ps: run_alone(engine, ps, params)) if side == "alone" else \
                        (lambda ps: run_service(service, ps, params, args.timeout_s))
                    run(prompts[:1])   # unmeasured: first use of this method's shapes on this side
                    before = engine_stages(engine)
                    start = time.perf_counter()
                    tokens = run(tqdm(prompts, desc=f"{side} {method.name}", leave=False))
                    seconds = time.perf_counter() - start
                    result[side][method.name] = {"tokens_per_s": tokens / seconds, "num_tokens": tokens, "seconds": seconds,
                                                 "stages": per_round_ms(before, engine_stages(engine))}
    finally:
        if service is not None:
            service.shutdown()
    result["late_programs"] = [list(map(str, key)) for key in engine.graphs.late_keys]
    return result


def interpreter() -> dict:
    return {"executable": sys.executable, "version": sys.version.split()[0],
            "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
            "linked_shared": os.environ.get("DDTREE_SHARED_PYTHON", "") != ""}


def interleaved_table(result: dict) -> str:
    data = result["interleaved"]
    lines = [f"Alone and through Triton ({data['side']}, server args '{data['server_args']}') in turns, both alive:", "",
             "| pair | method | stream interval | host loop ms | alone tok/s | triton tok/s | triton / alone | "
             "alone verify GPU ms | triton verify GPU ms | triton serve ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in data["turns"]:
        lines.append(f"| {t['repeat']} | {t['method']} | {t.get('stream_interval', 1)} | {t['host_loop_ms']:.1f} | "
                     f"{t['alone']['tokens_per_s']:.1f} | "
                     f"{t['triton']['tokens_per_s']:.1f} | {t['ratio']:.2f} | "
                     f"{t['alone']['stages'].get('verify_gpu_ms', 0.0):.2f} | "
                     f"{t['triton']['stages'].get('verify_gpu_ms', 0.0):.2f} | "
                     f"{t['triton']['stages'].get('serve_ms', 0.0):.2f} |")
    lines += ["", "| method | median triton / alone | min | max |", "|---|---|---|---|"]
    lines += [f"| {name} | {s['median_ratio']:.2f} | {s['min_ratio']:.2f} | {s['max_ratio']:.2f} |"
              for name, s in data["summary"].items()]
    return "\n".join(lines)


def table(result: dict) -> str:
    if "interleaved" in result:
        return interleaved_table(result)
    lines = ["| run | side | method | tok/s | vs alone (this interpreter's if none) | draft ms | verify ms | verify GPU ms | host ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, runs in result["runs"].items():
        alone = runs.get("alone") or result["runs"].get("this interpreter", {}).get("alone", {})
        for side in dict.fromkeys((*SIDES, *TRITON_SIDES.values())):
            for name, r in runs.get(side, {}).items():
                base = alone.get(name, {}).get("tokens_per_s")
                s = r["stages"]
                ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
                lines.append(f"| {label} | {side} | {name} | {r['tokens_per_s']:.1f} | {ratio} | {s['draft_ms']:.2f} | "
                             f"{s['verify_ms']:.2f} | {s.get('verify_gpu_ms', 0.0):.2f} | {s['host_ms']:.2f} |")
    runs = result["runs"]
    if "this interpreter" in runs and "shared libpython" in runs:
        lines += ["", "Shared libpython / this interpreter (tok/s, same side and method):", "",
                  "| side | method | ratio |", "|---|---|---|"]
        for side in SIDES:
            for name, r in runs["this interpreter"].get(side, {}).items():
                other = runs["shared libpython"].get(side, {}).get(name)
                if other:
                    lines.append(f"| {side} | {name} | {other['tokens_per_s'] / r['tokens_per_s']:.2f} |")
    cpu_rows = [(label, side, name, r["cpu_s_per_request"]) for label, run in runs.items()
                for side in TRITON_SIDES.values() for name, r in run.get(side, {}).items() if "cpu_s_per_request" in r]
    if cpu_rows:
        labels = sorted({k for *_, cpu in cpu_rows for k in cpu})
        lines += ["", "CPU seconds per request of each process while it was served (server, stubs, this client):", "",
                  "| run | side | method | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)]
        lines += [f"| {label} | {side} | {name} | " + " | ".join(f"{cpu.get(k, 0.0):.3f}" for k in labels) + " |"
                  for label, side, name, cpu in cpu_rows]
        lines += ["", "The generation model's stub: its busiest threads while served (share of the wall time):", ""]
        lines += [f"- {label}, {side}, {name}: " + "; ".join(r["engine_stub_threads"])
                  for label, run in runs.items() for side in TRITON_SIDES.values()
                  for name, r in run.get(side, {}).items() if r.get("engine_stub_threads")]
    late = {label: len(r["late_programs"]) for label, r in runs.items() if "late_programs" in r}
    lines += ["", f"Static programs made after warm-up (captured inside measured requests): {late}"]
    for label, processes in result.get("gpu_processes", {}).items():
        if processes:
            lines += ["", f"Processes on the GPU while tritonserver ({label}) served (nvidia-smi): " + "; ".join(processes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--methods", default="ar,ddtree-16", help="comma-separated: ar, dflash, ddtree-<budget>")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--shared-python", default="", help="a python launcher linked against the shared libpython: "
                        "the same measurement again under it (the Triton stub's interpreter)")
    parser.add_argument("--foreign-context", action="store_true", help="the in-process sides with another process "
                        "holding an idle CUDA context on the device (what a tritonserver beside the stub does)")
    parser.add_argument("--triton-args", action="append", default=None, help="extra tritonserver arguments for the "
                        "triton side (e.g. '--allow-gpu-metrics=false'); repeat for several servers, one after another "
                        "(an empty value: the default server)")
    parser.add_argument("--triton-streams", default="stream", help="comma-separated: stream (a response per round), "
                        "final (stream=false: one response per request)")
    parser.add_argument("--repeats", type=int, default=0, help="instead of the sides: the engine alone and through "
                        "Triton (the first --triton-args and --triton-streams) in turns this many times, both alive")
    parser.add_argument("--stream-intervals", default="1", help="with --repeats: comma-separated stream_interval "
                        "values, the Triton side measured with each (the alone side again before each)")
    parser.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="serve_overhead_cpu")
    add_freeze_heap_arg(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.target, args.drafter = str(Path(args.target).resolve()), str(Path(args.drafter).resolve())
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := set(args.sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {SIDES}")
    args.triton_streams = [s for s in args.triton_streams.split(",") if s]
    if not args.triton_streams or set(args.triton_streams) - set(TRITON_SIDES):
        parser.error(f"--triton-streams: choose from {sorted(TRITON_SIDES)}")
    args.triton_args = args.triton_args or [""]
    args.stream_intervals = [int(k) for k in args.stream_intervals.split(",") if k]
    methods = []
    for name in args.methods.split(","):
        mode, _, budget = name.partition("-")
        methods.append(Method(mode, int(budget or 1)))
    prompt_texts = json.loads((ROOT / "perf/prompts.json").read_text())[: args.num_prompts]
    # the ids the Triton side's preprocessing makes from the same chat messages: the same requests on every side
    prompts = encode_prompts(Tokenizer(args.target), prompt_texts)
    config = engine_config(args, prompts, methods)
    if args.child_out:   # the run under the shared-libpython launcher: its results to the parent
        result = measure(args, config, prompts, methods) | {"interpreter": interpreter()}
        Path(args.child_out).write_text(json.dumps(result))
        return result
    result = {"header": header(), "target": args.target, "drafter": args.drafter, "device": args.device,
              "dtype": args.dtype, "max_tokens": args.max_tokens, "num_prompts": len(prompts),
              "methods": [m.name for m in methods], "foreign_context": args.foreign_context,
              "triton_args": args.triton_args, "freeze_heap": args.freeze_heap, "runs": {}}
    if args.repeats > 0:
        result["interleaved"] = interleaved(args, config, prompts, prompt_texts, methods)
        write_results(Path(args.out), args.name, result, table(result))
        return result
    in_process = [side for side in args.sides if side != "triton"]
    # a triton-only run builds no engine here: this process then holds no CUDA context beside the server's
    result["runs"]["this interpreter"] = (measure(args, config, prompts, methods) if in_process else {}) | {
        "interpreter": interpreter()}
    if "triton" in args.sides:
        result["gpu_processes"] = {}
        for extra in args.triton_args:   # the default server's sides sit beside the in-process ones
            label = f"triton {extra}" if extra else "this interpreter"
            sides, result["gpu_processes"][extra or "default"] = measure_triton(
                config, prompt_texts, methods, args.max_tokens, shlex.split(extra), args.triton_streams)
            result["runs"].setdefault(label, {}).update(sides)
    if args.shared_python and in_process:
        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "child.json"
            child_argv = argv + ["--sides", ",".join(in_process)]
            env = os.environ | {"DDTREE_SHARED_PYTHON": "1",
                                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))
                                + os.pathsep + os.environ.get("PYTHONPATH", "")}
            subprocess.run([args.shared_python, str(Path(__file__).resolve()), *child_argv, "--child-out", str(child)],
                           check=True, env=env)
            result["runs"]["shared libpython"] = json.loads(child.read_text())
    write_results(Path(args.out), args.name, result, table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
