"""What an engine's warm-up costs at a shape's real dimensions (random weights): the time, the static programs made and
the device memory they hold, by part of Engine.warm_up (the short requests of each mode, the batch-1 shapes, the
batched `ar` steps and drafts, the device trees, the batched verifies within static_batch_memory, the static prefills
within static_prefill_memory). Written after every part, so a run cut off by a time limit keeps what it measured.

    python perf/warmup_probe.py --device cuda --dtype bfloat16 --shape qwen36-27b --max-model-len 8192 --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402
from perf.gpu_ratios import build  # noqa: E402

# Engine.warm_up's parts, in the order it runs them (generate_ids: its short requests of each mode)
PARTS = ("generate_ids", "_warm_shapes", "_warm_batched_steps", "_warm_batched_drafts", "_warm_device_trees",
         "_warm_batched_verifies", "_warm_prefills")


def allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def timed(engine: Engine, parts: dict, device: str, write) -> None:
    """Wrap each warm-up part of this engine: calls, seconds (synchronized), programs made, bytes held after it."""
    for name in PARTS:
        real = getattr(engine, name)

        @functools.wraps(real)
        def wrapper(*args, real=real, name=name, **kwargs):
            entry = parts.setdefault(name, {"calls": 0, "seconds": 0.0, "programs": 0, "held_mib": 0.0})
            programs, before, t0 = len(engine.graphs.programs), allocated(device), time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                if device == "cuda":
                    torch.cuda.synchronize()
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - t0
                entry["programs"] += len(engine.graphs.programs) - programs
                entry["held_mib"] += (allocated(device) - before) / 2**20
                write()

        setattr(engine, name, wrapper)


def table(result: dict) -> str:
    parts = result["parts"]
    lines = [f"- shape: `{result['shape']}`, max_model_len {result['max_model_len']}, max_num_seqs "
             f"{result['max_num_seqs']}, static_batch_memory {result['static_batch_memory']} MiB, static_prefill_memory "
             f"{result['static_prefill_memory']} MiB; weights {result['weights_gib']:.1f} GiB, caches "
             f"{result['caches_gib']:.1f} GiB",
             f"- warm-up: {result.get('warm_s', float('nan')):.1f} s, {result.get('programs', 0)} static programs, "
             f"holding {result.get('held_gib', float('nan')):.2f} GiB; peak reserved "
             f"{result.get('peak_reserved_gib', float('nan')):.1f} GiB" + ("" if "warm_s" in result else
                                                                             " (cut off before its end)"),
             "", "| part | calls | seconds | programs made | MiB held after it |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {p['calls']} | {p['seconds']:.1f} | {p['programs']} | {p['held_mib']:.0f} |"
              for name, p in parts.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="qwen36-27b")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="another EngineConfig field (repeatable), e.g. static_batch_memory=0")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="warmup_probe_h200")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    target, drafter = build(args.shape, getattr(torch, args.dtype), args.device)
    weights = allocated(args.device)
    config = EngineConfig.from_dict({"target_path": "(random)", "drafter_path": "(random)", "dtype": args.dtype,
                                     "device": args.device, "max_model_len": str(args.max_model_len),
                                     "max_num_seqs": str(args.max_num_seqs),
                                     **dict(item.split("=", 1) for item in args.engine)})
    engine = Engine(config, target=target, drafter=drafter)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    result = {"header": header(), "shape": args.shape, "max_model_len": config.max_model_len,
              "max_num_seqs": config.max_num_seqs, "static_batch_memory": config.static_batch_memory,
              "static_prefill_memory": config.static_prefill_memory, "weights_gib": weights / 2**30,
              "caches_gib": (allocated(args.device) - weights) / 2**30, "parts": {}}
    out = Path(args.out)
    write = lambda: write_results(out, args.name, result, table(result))   # noqa: E731
    timed(engine, result["parts"], args.device, write)
    before = allocated(args.device)
    t0 = time.perf_counter()
    engine.warm_up()
    result.update(warm_s=time.perf_counter() - t0, programs=len(engine.graphs.programs),
                  held_gib=(allocated(args.device) - before) / 2**30,
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else 0.0)
    write()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
