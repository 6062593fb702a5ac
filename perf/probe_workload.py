"""Small timed workloads and the process's facts, run the same way in any process (perf/stub_probe.py runs it here
and inside a Triton Python-backend stub). Imports torch and numpy only: the stub's environment has both."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import sysconfig
import threading
import time

TIMINGS = {
    "python_loop_ms": "ms for 200k iterations of a pure-Python loop",
    "torch_cpu_ops_us": "us per small CPU torch op (dispatch)",
    "cuda_eager_launch_us": "us of host time per eager CUDA kernel launch",
    "graph_launch_ms": "ms of host time per replay of an 800-kernel CUDA graph",
    "graph_gpu_ms": "ms of GPU time per replay of that graph (events)",
    "graph_wall_ms": "ms per replay + synchronize",
}

_SKIP_ENV = ("LS_COLORS", "PS1", "OLDPWD", "PWD", "SHLVL", "_", "TERM")


def facts() -> dict:
    import numpy
    import torch

    libraries = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if ".so" in path:
                    libraries.add(os.path.basename(path))
    except OSError:
        pass
    monitoring = getattr(sys, "monitoring", None)
    interpreter = {"executable": sys.executable, "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
                   "monitoring_tools": [monitoring.get_tool(i) for i in range(6)] if monitoring else None,
                   "switch_interval": sys.getswitchinterval(), "flags": repr(sys.flags),
                   "gc": {"enabled": gc.isenabled(), "threshold": gc.get_threshold(), "objects": len(gc.get_objects())},
                   "threads": [t.name for t in threading.enumerate()],
                   "cflags": sysconfig.get_config_var("PY_CFLAGS"), "ldlibrary": sysconfig.get_config_var("LDLIBRARY")}
    return {"pid": os.getpid(), "python": sys.version.split()[0], "numpy": numpy.__version__, "interpreter": interpreter,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "nice": os.nice(0), "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
            "libraries": sorted(libraries),
            "environment": {k: v for k, v in os.environ.items() if k not in _SKIP_ENV}}


def proc_stat(path: str) -> tuple[str, list[str]]:
    """(name, the fields after it) of a /proc/<pid>[/task/<tid>]/stat file (the name may hold spaces and parentheses);
    OSError where it is gone."""
    with open(path) as f:
        stat = f.read()
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def cpu_of(fields: list[str]) -> float:
    """CPU seconds (user + system) from proc_stat()'s fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process so far: {"<tid> <name>": seconds}, {} without /proc."""
    used = {}
    task = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return used
    for tid in tids:
        try:
            name, fields = proc_stat(f"{task}/{tid}/stat")
        except OSError:
            continue
        used[f"{tid} {name}"] = cpu_of(fields)
    return used


def busy_threads(before: dict[str, float], after: dict[str, float], seconds: float, me: int, main: int,
                 top: int = 6) -> list[str]:
    """The threads that used the most CPU between two thread_cpu() readings, as "<label>: <share of the wall>"."""
    delta = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)[:top]
    rows = []
    for used, key in delta:
        tid = int(key.split()[0])
        role = " (this thread)" if tid == me else " (main)" if tid == main else ""
        rows.append(f"{key}{role}: {used / max(seconds, 1e-9):.0%}")
    return rows


def python_loop_ms() -> float:
    """ms for 200k iterations of a pure-Python loop: the interpreter's speed on this CPU now."""
    start = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    return (time.perf_counter() - start) * 1e3


def cpu_ops_us(x) -> float:
    """us per small CPU torch op on tensor x (dispatch cost)."""
    start = time.perf_counter()
    y = x
    for _ in range(2000):
        y = y.add(1.0)
    return (time.perf_counter() - start) / 2000 * 1e6


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


_ENGINES: dict = {}   # one engine per configuration and process, reused by later probes (its warm-up is minutes)


def engine_probe(target: str, drafter: str, device: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 methods: list[str]) -> dict:
    """The real engine's own loop (Engine.generate_ids, as the in-process benchmarks run it) on this thread:
    {method: tokens/s and per-round stage ms}. The engine is built and warmed once per process."""
    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.sampling_params import SamplingParams
    from perf.common import engine_stages, per_round_ms

    key = (target, drafter, device, dtype, max(map(len, prompts)) + max_tokens)
    if key not in _ENGINES:
        budgets = [int(m.partition("-")[2] or 1) for m in methods]
        config = EngineConfig(target_path=target, drafter_path=drafter, device=device, dtype=dtype,
                              max_tree_budget=max(budgets + [16]), max_model_len=key[-1] + 64)
        _ENGINES[key] = Engine(config)
        _ENGINES[key].warm_up()
    engine, result = _ENGINES[key], {}
    for name in methods:
        mode, _, budget = name.partition("-")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=mode, tree_budget=int(budget or 1), seed=0)
        engine.generate_ids(prompts[0], params)   # unmeasured: this thread's first use of the method
        before, start = engine_stages(engine), time.perf_counter()
        tokens = sum(engine.generate_ids(ids, params).num_output_tokens for ids in prompts)
        seconds = time.perf_counter() - start
        result[name] = {"tokens_per_s": tokens / seconds, "stages": per_round_ms(before, engine_stages(engine))}
    return result


def probe(device: str = "cpu", repeats: int = 5, engine: dict | None = None) -> dict:
    """The timings (TIMINGS), the process's facts and its busiest threads; with `engine` (engine_probe's arguments
    but the device), the real engine's loop too."""
    threads_before, wall_start = thread_cpu(), time.perf_counter()
    result = _probe(device, repeats)
    if engine:
        result["engine"] = engine_probe(device=device, **engine)
    result["busy_threads"] = busy_threads(threads_before, thread_cpu(), time.perf_counter() - wall_start,
                                          threading.get_native_id(), os.getpid())
    return result


def _probe(device: str, repeats: int) -> dict:
    import torch

    x = torch.ones(64)
    timings = {"python_loop_ms": _median(python_loop_ms, repeats),
               "torch_cpu_ops_us": _median(lambda: cpu_ops_us(x), repeats)}
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        a = torch.ones(4096, device=dev)
        torch.cuda.synchronize(dev)

        def eager() -> float:
            start = time.perf_counter()
            y = a
            for _ in range(1000):
                y = y.add(1.0)
            launched = time.perf_counter() - start
            torch.cuda.synchronize(dev)
            return launched / 1000 * 1e6

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):   # warm the kernels outside the capture
            eager()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        static = a.clone()
        with torch.cuda.graph(graph):
            y = static
            for _ in range(400):
                y = y.mul(1.0001).add(1.0)   # 800 tiny kernels: a host-bound replay, like a decode step
        torch.cuda.synchronize(dev)
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launch, gpu, wall = [], [], []
        for _ in range(max(repeats, 5) * 4):
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            start_event.record()
            graph.replay()
            end_event.record()
            launched = time.perf_counter()
            end_event.synchronize()
            done = time.perf_counter()
            launch.append((launched - start) * 1e3)
            wall.append((done - start) * 1e3)
            gpu.append(start_event.elapsed_time(end_event))
        timings |= {"cuda_eager_launch_us": _median(eager, repeats), "graph_launch_ms": statistics.median(launch),
                    "graph_gpu_ms": statistics.median(gpu), "graph_wall_ms": statistics.median(wall)}
        return {"timings": timings, "facts": facts() | {"attention_kernels": attention_kernels(dev)}}
    return {"timings": timings, "facts": facts()}


def attention_kernels(device) -> list[str]:
    """The kernels one masked decode-shaped attention (as the engine calls F.scaled_dot_product_attention) runs: which
    SDPA backend this process gets (cuDNN, memory-efficient, or the math fallback's several kernels)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 9, 1, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 9, 256, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, 1, 256, device=device, dtype=torch.bool)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.synchronize(device)
    return [e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
