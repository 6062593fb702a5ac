"""The same small workloads in this process and inside a Triton Python-backend stub: is the stub itself slower?

perf/serve_overhead.py found the engine's CUDA graphs slower inside the stub (host time of cudaGraphLaunch and the
verify's GPU timeline) with no difference in process between the interpreter kinds or threads. This takes the engine
out: one probe (perf/probe_workload.py) times the interpreter, torch's CPU dispatch, eager CUDA launches and the
replay of a captured graph of many small kernels (host launch time and GPU time), and records the process's facts
(torch threads, CPU affinity, niceness, loaded shared libraries, environment). It runs here, then inside a real
tritonserver's stub (a one-model repository, decoupled like the generation model), once per --triton-args variant,
three ways: in execute() on the stub's main thread; on a thread of its own after execute() returned (as the engine
thread runs); and the same with another thread sending a small response --sends-per-s times a second meanwhile
(as the outbox streams a response per round). The table sets them side by side; the facts that differ from this
process are listed.

    python perf/stub_probe.py --device cuda --triton-args= --triton-args=--allow-gpu-metrics=false --name stub_probe_h200
"""

from __future__ import annotations

import argparse
import json
import queue
import shlex
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.probe_workload import TIMINGS, probe  # noqa: E402

MODEL_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "REQUEST", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "RESULT", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_MODEL } ]
model_transaction_policy { decoupled: true }
"""

MODEL_PY = '''
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from perf.probe_workload import probe


def response(payload):
    return pb_utils.InferenceResponse([pb_utils.Tensor("RESULT", np.array([payload], dtype=np.object_))])


def run(settings, sender):
    stop, ticker = threading.Event(), None
    rate = settings.pop("sends_per_s", 0)
    if rate:
        def tick():
            while not stop.wait(1.0 / rate):
                sender.send(response(b"tick"))
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
    try:
        result = json.dumps(probe(**settings)).encode()
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
    sender.send(response(result), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            settings = json.loads(pb_utils.get_input_tensor_by_name(request, "REQUEST").as_numpy()[0])
            sender = request.get_response_sender()
            if settings.pop("thread", False):
                threading.Thread(target=run, args=(settings, sender), daemon=True).start()
            else:
                run(settings, sender)
        return None
'''

WAYS = {"main thread": {"thread": False}, "own thread": {"thread": True}}


def stream_probe(url: str, settings: dict, timeout_s: float = 600.0) -> dict:
    """One request to the decoupled probe model over a gRPC stream: its final response's result (ticks skipped)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        request = grpcclient.InferInput("REQUEST", [1], "BYTES")
        request.set_data_from_numpy(np.array([json.dumps(settings).encode()], dtype=np.object_))
        client.async_stream_infer("probe", [request])
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise RuntimeError(str(error))
            payload = result.as_numpy("RESULT")[0]
            if payload != b"tick":
                return json.loads(payload)
    finally:
        client.stop_stream()
        client.close()


def probe_in_stub(settings: dict, sends_per_s: float, server_args: list[str], workdir: Path) -> dict:
    """{way: probe result} from one tritonserver's stub, each way of running it (WAYS, and the ticking thread)."""
    from triton_env import TritonServer

    model = workdir / "repo" / "probe"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(MODEL_CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    ways = WAYS | {f"own thread + {sends_per_s:g} sends/s": {"thread": True, "sends_per_s": sends_per_s}}
    with TritonServer(str(workdir / "repo"), log_path=str(workdir / "server.log"), extra_args=server_args) as server:
        return {way: stream_probe(server.grpc_url, settings | extra) for way, extra in ways.items()}


def differences(here: dict, there: dict) -> dict:
    """The facts in which the stub's process differs from this one."""
    diff = {}
    for key in ("torch_threads", "interop_threads", "affinity", "nice", "python", "numpy", "interpreter",
                "attention_kernels"):
        if here["facts"].get(key) != there["facts"].get(key):
            diff[key] = {"here": here["facts"].get(key), "stub": there["facts"].get(key)}
    libs_here, libs_there = set(here["facts"]["libraries"]), set(there["facts"]["libraries"])
    diff["libraries only in the stub"] = sorted(libs_there - libs_here)
    diff["libraries only here"] = sorted(libs_here - libs_there)
    env_here, env_there = here["facts"]["environment"], there["facts"]["environment"]
    diff["environment"] = {k: {"here": env_here.get(k), "stub": env_there.get(k)}
                           for k in sorted(set(env_here) | set(env_there)) if env_here.get(k) != env_there.get(k)}
    return diff


def table(result: dict) -> str:
    runs = result["runs"]
    base = runs["in process"]["timings"]
    keys = [k for k in TIMINGS if k in base]
    lines = ["| where | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for label, run in runs.items():
        cells = [f"{run['timings'][k]:.3f} ({run['timings'][k] / base[k]:.2f}x)" if base[k] else
                 f"{run['timings'][k]:.3f}" for k in keys]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Units: " + "; ".join(f"{k}: {TIMINGS[k]}" for k in keys), ""]
    if "engine" in runs["in process"]:
        lines += ["The real engine's loop (Engine.generate_ids; each process builds and warms its engine once):", "",
                  "| where | method | tok/s | vs in process | draft ms | verify ms | verify GPU ms | host ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, run in runs.items():
            for name, r in run.get("engine", {}).items():
                st, base = r["stages"], runs["in process"]["engine"][name]["tokens_per_s"]
                lines.append(f"| {label} | {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
                             f"{st['draft_ms']:.2f} | {st['verify_ms']:.2f} | {st.get('verify_gpu_ms', 0.0):.2f} | "
                             f"{st['host_ms']:.2f} |")
        lines.append("")
    lines += ["Threads that used the most CPU while each probe ran (share of its wall time):", ""]
    lines += [f"- {label}: " + "; ".join(run.get("busy_threads", [])) for label, run in runs.items()]
    lines.append("")
    for label, diff in result["differences"].items():
        lines += [f"Facts of the stub ({label}) that differ from this process:", "", "```",
                  json.dumps(diff, indent=1)[:6000], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="each timing is the median of this many")
    parser.add_argument("--sends-per-s", type=float, default=300.0, help="the ticking thread's responses per second "
                        "(the outbox sends one per round)")
    parser.add_argument("--triton-args", action="append", default=None,
                        help="extra tritonserver arguments; repeat for several servers (an empty value: the default)")
    parser.add_argument("--engine-target", default="", help="also run the real engine's loop (built once per process) "
                        "with this target")
    parser.add_argument("--engine-drafter", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="ar,ddtree-16")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="stub_probe_cpu")
    args = parser.parse_args(argv)
    settings = {"device": args.device, "repeats": args.repeats}
    if args.engine_target:
        from ddtree.tokenizer import Tokenizer
        from perf.humaneval import encode_prompts

        texts = json.loads((ROOT / "perf/prompts.json").read_text())[: args.num_prompts]
        settings["engine"] = {"target": str(Path(args.engine_target).resolve()),
                              "drafter": str(Path(args.engine_drafter).resolve()), "dtype": args.dtype,
                              "prompts": encode_prompts(Tokenizer(args.engine_target), texts),
                              "max_tokens": args.max_tokens, "methods": args.methods.split(",")}
    result = {"header": header(), "settings": settings, "runs": {"in process": probe(**settings)}, "differences": {}}
    own: dict = {}   # the same on a thread of this process (the engine thread's situation, without the stub)
    thread = threading.Thread(target=lambda: own.update(probe(**settings)))
    thread.start()
    thread.join()
    result["runs"]["in process, own thread"] = own
    for extra in args.triton_args or [""]:
        with tempfile.TemporaryDirectory() as tmp:
            for way, run in probe_in_stub(settings, args.sends_per_s, shlex.split(extra), Path(tmp)).items():
                label = f"stub {extra}, {way}" if extra else f"stub, {way}"
                result["runs"][label] = run
        result["differences"][extra or "default"] = differences(result["runs"]["in process"], run)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
