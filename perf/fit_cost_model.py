"""Measure verify time against the number of query rows (and the draft stage) on this machine, through the engine's
own decoding rounds, and store it as the budget policy's cost model (ddtree/data/cost_model_<name>.json).

Each point is a request decoded alone in the mode that verifies that many rows a round (rows 1: `ar`; rows n:
`ddtree` with budget n - 1), timed by the engine's stage counters: the forward the engine serves with (static, CUDA
graphs, on CUDA; dynamic on the CPU), its launches and its device-to-host read, not a bare forward. (The first data,
from bare dynamic forwards, put the embedded default's verify on the H200 at 17-29 ms for every row count, ~10x what
its rounds take, and the policy arm took whole 64-node trees at 32 streams: concurrency_h200_turns.md.)

    python perf/fit_cost_model.py --name cpu                       # the embedded default, fp32 CPU
    python perf/fit_cost_model.py --device cuda --dtype bfloat16 --name h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from perf.common import ROOT, add_model_args, write_cost_model  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@torch.inference_mode()
def measure(engine: Engine, rows: tuple[int, ...], context: int, max_tokens: int, repeats: int) -> dict:
    """Per point: the median over `repeats` requests of verify ms per round, draft ms per round and the rows a round
    verified (mean); each point's first request is not measured (captures, allocations)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.target.config.vocab_size, (context,), generator=gen).tolist()
    points = {}
    for n in tqdm(rows, desc="cost model points"):
        params = SamplingParams(mode="ar" if n == 1 else "ddtree", tree_budget=max(n - 1, 1), max_tokens=max_tokens,
                                ignore_eos=True)
        engine.generate_ids(prompt, params)
        runs = []
        for _ in range(repeats):
            t = engine.stage_times
            before = (t.verify, t.draft, t.batch_rounds, t.tree_nodes)
            engine.generate_ids(prompt, params)
            count = t.batch_rounds - before[2]
            runs.append(((t.verify - before[0]) / count * 1e3, (t.draft - before[1]) / count * 1e3,
                         1 + (t.tree_nodes - before[3]) / count))
        points[n] = {"verify_ms": statistics.median(r[0] for r in runs), "draft_ms": statistics.median(r[1] for r in runs),
                     "mean_rows": statistics.mean(r[2] for r in runs)}
        print(f"rows {n}: {points[n]}", flush=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "ddtree" / "data"))
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    engine = Engine(EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device,
                                 dtype=args.dtype, max_tree_budget=max(rows), default_tree_budget=max(rows),
                                 max_model_len=args.context + args.max_tokens + max(rows) + 16,
                                 # the stages timed apart: a round that builds its tree on the device waits for its
                                 # draft in the verify stage
                                 device_tree=False))
    points = measure(engine, rows, args.context, args.max_tokens, args.repeats)
    draft_ms = statistics.median(p["draft_ms"] for n, p in points.items() if n > 1)
    out = Path(args.out) / f"cost_model_{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_cost_model(out, list(rows), [points[n]["verify_ms"] for n in rows], draft_ms, target=args.target,
                     context=args.context, measured="engine rounds (stage counters), one request at a time",
                     mean_rows=[round(points[n]["mean_rows"], 2) for n in rows])
    print(f"wrote {out}: draft {draft_ms:.2f} ms, verify {dict((n, round(points[n]['verify_ms'], 2)) for n in rows)}")


if __name__ == "__main__":
    main()
