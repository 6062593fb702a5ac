"""What Python's cyclic garbage collector costs a loaded engine, and what freezing the heap after warm-up saves.

A serving process holds ~300k objects once torch, transformers and the models are loaded; a full collection walks all
of them while every stream waits (the engine thread and the outbox hold the GIL in turn). The Triton model freezes
them after warm-up (ddtree.serving.freeze_heap, gc.freeze). This loads an engine, warms it up, decodes a batch of
requests, then times full collections (median of --repeats), and counts the collections a batch of requests causes
(by generation, with their time), before and after the freeze.

    python perf/gc_probe.py --name gc_probe_cpu
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.serving import freeze_heap  # noqa: E402
from perf import batch_rounds  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402


class Collections:
    """Collections by generation and their seconds, from gc.callbacks, while active."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def decode_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """The collections one batch of requests causes (added at once, stepped until all finish)."""
    seen = Collections()
    gc.callbacks.append(seen)
    try:
        run = batch_rounds.run_batch(engine, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0))
    finally:
        gc.callbacks.remove(seen)
    return {"collections": seen.count, "collection_ms": [round(1e3 * s, 3) for s in seen.seconds],
            "batch_rounds": run["batch_rounds"], "seconds": run["seconds"]}


def table(result: dict) -> str:
    lines = ["| | objects walked by a full collection | full collection, ms (median) | a batch's collections, "
             "gen 0 / 1 / 2 | their ms, gen 0 / 1 / 2 |", "|---|---|---|---|---|"]
    for key, label in (("before", "before the freeze"), ("after", "after freeze_heap")):
        r = result[key]
        lines.append(f"| {label} | {r['objects']} | {r['full_ms']:.2f} | {' / '.join(map(str, r['batch']['collections']))} "
                     f"| {' / '.join(f'{ms:.2f}' for ms in r['batch']['collection_ms'])} |")
    lines.append(f"\n{result['frozen']} objects frozen; a batch is {result['requests']} requests x {result['max_tokens']} "
                 f"tokens ({result['after']['batch']['batch_rounds']} batch rounds).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="gc_probe_cpu")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device,
                                 dtype=args.dtype, max_num_seqs=max(args.requests, 1)))
    engine.warm_up()
    vocab = engine.target.config.vocab_size
    prompts = [[1 + (i * 31 + j * 7) % (vocab - 1) for j in range(8 + i % 8)] for i in range(args.requests)]
    decode_batch(engine, prompts, args.max_tokens)   # what serving leaves behind, before anything is measured
    result = {"header": header(), "target": args.target, "requests": args.requests, "max_tokens": args.max_tokens}
    try:
        result["before"] = {"objects": len(gc.get_objects()), "full_ms": full_collection_ms(args.repeats),
                            "batch": decode_batch(engine, prompts, args.max_tokens)}
        result["frozen"] = freeze_heap()
        result["after"] = {"objects": len(gc.get_objects()), "full_ms": full_collection_ms(args.repeats),
                           "batch": decode_batch(engine, prompts, args.max_tokens)}
    finally:
        gc.unfreeze()   # a caller's process (the tests) goes on collecting as before
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
