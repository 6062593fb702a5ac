"""Benchmark ar / dflash / ddtree (budgets 16, 32, 64) on the embedded default.

In process (the engine alone) and through the Triton stream (perf_analyzer, gRPC streaming,
concurrency 1), side by side in one run. Every request generates exactly --max-tokens tokens
(ignore_eos) so both sides decode the same amount. Writes perf/results/<name>.{json,md}.

    python perf/bench.py --out perf/results                      # CPU
    python perf/bench.py --device cuda --dtype bfloat16 --name bench_h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402

METHODS = [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64)]


def method_name(mode: str, budget: int) -> str:
    return f"ddtree-{budget}" if mode == "ddtree" else mode


@dataclass(frozen=True, slots=True)
class Method:
    """A decoding mode and its tree budget (the cap, for auto), as the benchmarks send them."""
    mode: str
    budget: int

    @property
    def name(self) -> str:
        return method_name(self.mode, self.budget)


def chat_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]


def bench_in_process(engine: Engine, prompt_ids: list[list[int]], max_tokens: int, temperature: float) -> dict:
    results = {}
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    for mode, budget in METHODS:
        name = method_name(mode, budget)
        warm.mode, warm.tree_budget = mode, budget
        engine.generate_ids(prompt_ids[0], warm)   # warm-up, excluded
        tokens, seconds, taus = 0, 0.0, []
        for ids in tqdm(prompt_ids, desc=f"in-process {name}", leave=False):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, mode=mode, tree_budget=budget,
                                    temperature=temperature, seed=0)
            start = time.perf_counter()
            request = engine.generate_ids(ids, params)
            seconds += time.perf_counter() - start
            tokens += request.num_output_tokens
            taus.append(request.mean_acceptance_length)
        results[name] = {"tokens_per_s": tokens / seconds, "mean_acceptance_length": statistics.mean(taus),
                         "num_tokens": tokens, "seconds": seconds}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="bench_cpu")
    args = parser.parse_args()
    args.target, args.drafter = str(Path(args.target).resolve()), str(Path(args.drafter).resolve())

    from transformers import AutoTokenizer

    prompts = json.loads((ROOT / "perf/prompts.json").read_text())[: args.num_prompts]
    prompt_ids = chat_prompts(AutoTokenizer.from_pretrained(args.target), prompts)
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_tree_budget=64)
    result = {"header": header(), "target": args.target, "drafter": args.drafter, "device": args.device,
              "dtype": args.dtype, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "prompts": prompts}
    if not args.skip_in_process:
        engine = Engine(config)
        engine.warm_up()
        result["in_process"] = bench_in_process(engine, prompt_ids, args.max_tokens, args.temperature)
        del engine
    write_results(Path(args.out), args.name, result, table(result))   # kept if the Triton part fails
    if not args.skip_triton:
        from perf.triton_bench import bench_triton

        result["triton"] = bench_triton(config, prompts, [(m, b, method_name(m, b)) for m, b in METHODS],
                                        args.max_tokens, args.temperature)
    write_results(Path(args.out), args.name, result, table(result))


def table(result: dict) -> str:
    rows = ["| method | in-process tok/s | mean acceptance length | Triton tok/s (perf_analyzer) | Triton / in-process |",
            "|---|---|---|---|---|"]
    in_process = result.get("in_process") or {n: {"tokens_per_s": float("nan"), "mean_acceptance_length": float("nan")}
                                               for n in result.get("triton", {})}
    ar = in_process.get("ar", {}).get("tokens_per_s", float("nan"))
    for name, r in in_process.items():
        t = result.get("triton", {}).get(name, {}).get("tokens_per_s")
        tps = r["tokens_per_s"]
        triton = "-" if t is None else f"{t:.1f}"
        ratio = "-" if t is None else f"{t / tps:.2f}"
        rows.append(f"| {name} | {tps:.1f} ({tps / ar:.2f}x ar) | {r['mean_acceptance_length']:.2f} | "
                    f"{triton} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
