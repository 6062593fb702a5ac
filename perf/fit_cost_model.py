"""Measure verify time against the number of query rows (and one drafter pass) on this machine and
store it as the budget policy's cost model (ddtree/data/cost_model_<name>.json).

    python perf/fit_cost_model.py --name cpu                       # the embedded default, fp32 CPU
    python perf/fit_cost_model.py --device cuda --dtype bfloat16 --name h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.models.dense import Segment  # noqa: E402
from perf.common import ROOT, add_model_args, write_cost_model  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def measure(engine: Engine, device: str, context: int, repeats: int) -> tuple[list[float], float]:
    target, cache = engine.target, engine.cache
    ids = torch.randint(0, target.config.vocab_size, (context,), device=device)
    target(ids, torch.arange(context, device=device), cache, 0,
           torch.ones(context, context, dtype=torch.bool, device=device).tril())
    cache.compact(0, list(range(context)))
    verify_ms = []
    for rows in ROWS:
        query = torch.randint(0, target.config.vocab_size, (rows,), device=device)
        positions = torch.arange(context, context + rows, device=device)
        visibility = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        times = []
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            target.forward_packed(query, positions, [Segment.of(cache, context, visibility)], engine.tap_layers)
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        verify_ms.append(statistics.median(times[1:]))
        print(f"verify rows {rows}: {verify_ms[-1]:.2f} ms", flush=True)
    drafter, draft_cache = engine.drafter, engine.draft_caches[0]
    taps = torch.randn(context, drafter.fc.in_features, device=device, dtype=drafter.fc.weight.dtype)
    drafter.add_context(draft_cache, taps)
    block = target.embed(torch.zeros(drafter.block_size, dtype=torch.long, device=device))
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        target.logits(drafter(draft_cache, block, context)[1:])
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return verify_ms, statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args()
    engine = Engine(EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device,
                                 dtype=args.dtype, max_tree_budget=max(ROWS)))
    verify_ms, draft_ms = measure(engine, args.device, args.context, args.repeats)
    out = ROOT / "ddtree" / "data" / f"cost_model_{args.name}.json"
    write_cost_model(out, list(ROWS), verify_ms, draft_ms, target=args.target, context=args.context)
    print(f"wrote {out}: draft {draft_ms:.2f} ms, verify {dict(zip(ROWS, [round(v, 2) for v in verify_ms]))}")


if __name__ == "__main__":
    main()
