"""Static prefill against the eager prefill at a shape's real dimensions (random weights): a lone prompt's time to its
first token (an `ar` request of one token, synchronized), median over repeats, at each prompt length, the two forms
in turns on one engine; the memory the prefill programs hold (EngineConfig.static_prefill: their outputs cover every
row's features and, since f06d12a, the last row's logits). A 27B hybrid's prefill takes the ancestor-masked GDN form
(graphs.StaticTarget._hybrid), whose cost at 256 rows is what this checks before the setting's "auto" reaches the
user's model. With --group G, G prompts of each length are admitted together (one step): their shared static prefill
(one program of G prompts, since 70e5701) against their packed eager prefill.

    python perf/prefill_probe.py --device cuda --dtype bfloat16 --shape qwen36-27b --lengths 16,64,128,256
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
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402
from perf.gpu_ratios import build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="qwen36-27b")
    parser.add_argument("--lengths", default="16,64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=1, help="prompts admitted together (max_num_seqs)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="prefill_probe_h200")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    target, drafter = build(args.shape, getattr(torch, args.dtype), args.device)
    config = EngineConfig(target_path="(random)", drafter_path="(random)", dtype=args.dtype, device=args.device,
                          max_model_len=max(lengths) + 8, static_prefill=max(lengths), max_num_seqs=args.group,
                          static_forward="auto" if args.device == "cuda" else "on")   # the CPU: run eagerly
    engine = Engine(config, target=target, drafter=drafter)
    before = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    t0 = time.perf_counter()
    engine._warm_prefills()
    warm_s = time.perf_counter() - t0
    held = (torch.cuda.memory_allocated() - before) / 2**20 if args.device == "cuda" else 0.0
    params = SamplingParams(mode="ar", max_tokens=1, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    vocab = target.config.vocab_size
    ms: dict[str, dict[int, list[float]]] = {"static": {}, "eager": {}}
    for n in lengths:
        prompt = [1 + (7 * i) % (vocab - 1) for i in range(n)]
        for turn in range(args.repeats + 1):
            for form in ("static", "eager") if turn % 2 == 0 else ("eager", "static"):
                engine.static_prefill = max(lengths) if form == "static" else 0
                sync()
                t = time.perf_counter()
                for i in range(args.group):
                    engine.add(Request(f"p{i}", prompt, params))
                while engine.has_work:
                    engine.step()
                sync()
                if turn:   # the first turn unmeasured (the eager form's attention plans, allocations)
                    ms[form].setdefault(n, []).append(1e3 * (time.perf_counter() - t))
    rows = {n: {form: statistics.median(ms[form][n]) for form in ms} for n in lengths}
    lines = [f"- shape: `{args.shape}`, {args.dtype}; {args.group} prompt(s) admitted together; {len(engine.graphs.programs)} "
             f"prefill programs made in {warm_s:.1f} s, holding {held:.0f} MiB", "",
             "| prompt tokens | static ms | eager ms | static / eager |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {r['static']:.2f} | {r['eager']:.2f} | {r['static'] / r['eager']:.2f} |" for n, r in rows.items()]
    print("\n".join(lines))
    write_results(Path(args.out), args.name, {"header": header(), "shape": args.shape, "group": args.group, "warm_s": warm_s,
                                              "held_mib": held, "ms": ms, "median_ms": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
