"""Tree attention on the GPU: the static verify's masked attention (a few query rows per request against its cache
slot's keys, each row seeing the committed prefix and its tree ancestors) through the kernels we could use.

Variants, each timed as a whole verify's worth of attention layers (16 at Qwen3.6-27B dims: 24 query heads, 4 K/V
heads, head dim 256) in one CUDA graph replay, each layer with its own K/V:
- sdpa: what the engine runs (F.scaled_dot_product_attention with the boolean mask; PyTorch picks the backend);
- ours: ddtree.models.attention_kernel (the engine's, on CUDA): a K/V head's query heads together, keys split over
  programs, read in place in the pool;
- sdpa-efficient: the same call held to the memory-efficient backend;
- flex: torch.compile'd flex_attention with the mask read in a score_mod (PyTorch's kernel for short queries splits
  the keys over programs and packs a K/V head's query heads together);
- sdpa-nomask: the same shapes without a mask (not a correct tree attention: how much the mask itself costs);
- ours-<n>: ours with its keys split until the grid has about n programs (the engine's: 264);
- none: no attention at all (with --between: the matrix products alone).
Each variant's output is checked against a float32 reference. `--between 1` puts a layer's two attention-sized
matrix products (hidden -> heads x head dim, and back, each layer its own weights) around each attention call, as in
a verify, so that the graph's timing includes the switches between the attention kernels and the GEMMs (in whole
27B verifies our kernel's ~0.4 ms less device time came out ~0.15 ms slower per replay: gpu_ratios_h200_draftkernel.md).

    python perf/attention_bench.py --name attention_h200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.tree_kernel_bench import graph_ms  # noqa: E402

DIMS = {"qwen36-27b": dict(heads=24, kv_heads=4, head_dim=256, layers=16, hidden=5120)}


def tree_masks(requests: int, rows: int, keys: int, gen: torch.Generator) -> torch.Tensor:
    """[R, Q, E] bool: per request a random prefix, then a tree of a random number of its rows (random parents,
    each row seeing its ancestors); rows past the tree see key 0 only (as the engine's padding rows)."""
    masks = torch.zeros(requests, rows, keys, dtype=torch.bool)
    for r in range(requests):
        nodes = int(torch.randint(1, rows + 1, (1,), generator=gen))
        start = int(torch.randint(1, keys - nodes + 1, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
        masks[r, :, 0] = True
        masks[r, :nodes, :start] = True
        for i in range(nodes):
            node = i
            while node >= 0:
                masks[r, i, start + node] = True
                node = parents[node]
    return masks


def variants(scale: float):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, fullgraph=True)

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)

    def efficient(q, k, v, mask):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)

    def flexed(q, k, v, mask):
        def visible(score, b, h, qi, ki):
            return torch.where(mask[b, qi, ki], score, -float("inf"))
        return flex(q, k, v, score_mod=visible, scale=scale, enable_gqa=True)

    def nomask(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def ours_with(programs: int | None = None):
        """Our kernel with its keys split for about `programs` programs (None: the engine's, attention_kernel.split_target)."""
        split = {} if programs is None else {"target_programs": programs}

        def ours(q, k, v, mask):   # the engine's layouts: queries [R, Q, H, d], K/V as a pool [slots, E, KVH, d]
            from ddtree.models.attention_kernel import masked_attention
            slots = torch.arange(q.shape[0], device=q.device)
            out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), slots, k.shape[2], mask,
                                   scale, **split)
            return out.transpose(1, 2)
        return ours

    def none(q, k, v, mask):
        return q

    return {"sdpa": sdpa, "ours": ours_with(), "sdpa-efficient": efficient, "flex": flexed, "sdpa-nomask": nomask,
            "ours-66": ours_with(66), "ours-132": ours_with(132), "ours-528": ours_with(528), "none": none}


def measure(dims: dict, requests: int, rows: int, keys: int, repeats: int, names: list[str] | None = None,
            between: bool = False) -> dict:
    h, kvh, d, layers = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["layers"]
    gen = torch.Generator().manual_seed(rows * 1000 + keys + requests)
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(requests, h, rows, d, generator=gen).to(dev, dtype)
    kv = [(torch.randn(requests, kvh, keys, d, generator=gen).to(dev, dtype),
           torch.randn(requests, kvh, keys, d, generator=gen).to(dev, dtype)) for _ in range(layers)]
    mask = tree_masks(requests, rows, keys, gen).to(dev)
    ref = F.scaled_dot_product_attention(q.float(), kv[0][0].float(), kv[0][1].float(), attn_mask=mask[:, None],
                                         scale=d**-0.5, enable_gqa=True)
    result = {"requests": requests, "rows": rows, "keys": keys, "ms": {}, "max_abs_diff": {}}
    hidden = dims["hidden"]
    x = torch.randn(requests * rows, hidden, generator=gen).to(dev, dtype)
    # each layer's own weights (no layer's read from L2 after another's), as the verify's projections around attention
    weights = [(torch.randn(hidden, h * d, generator=gen).to(dev, dtype) * 0.01,
                torch.randn(h * d, hidden, generator=gen).to(dev, dtype) * 0.01) for _ in range(layers if between else 0)]

    def layer(fn, i, k, v):
        if between:
            y = x @ weights[i][0]
            out = fn(q, k, v, mask)
            return y @ weights[i][1], out
        return fn(q, k, v, mask)

    for name, fn in variants(d**-0.5).items():
        if names and name not in names:
            continue
        try:
            out = fn(q, kv[0][0], kv[0][1], mask)
            result["max_abs_diff"][name] = (out.float() - ref).abs().max().item() if name != "none" else 0.0
            result["ms"][name] = graph_ms(lambda fn=fn: [layer(fn, i, k, v) for i, (k, v) in enumerate(kv)], repeats)
        except Exception as exc:   # a backend that refuses these shapes: recorded, not fatal
            result["ms"][name] = float("nan")
            result["max_abs_diff"][name] = repr(exc)[:160]
    print(f"R={requests} Q={rows} E={keys}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in result["ms"].items()), flush=True)
    return result


def table(result: dict) -> str:
    names = list(result["cases"][0]["ms"])
    lines = [f"{result['layers']} attention layers ({result['shape']} dims) per CUDA graph replay"
             + (", each between its layer's two matrix products" if result.get("between") else "")
             + f", median of {result['repeats']}, ms; R requests x Q query rows against E cache positions each\n",
             "| R | Q | E | " + " | ".join(names) + " | max abs diff vs fp32 (" + ", ".join(names) + ") |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    for case in result["cases"]:
        diffs = ", ".join(f"{v:.1e}" if isinstance(v, float) else "error" for v in case["max_abs_diff"].values())
        lines.append(f"| {case['requests']} | {case['rows']} | {case['keys']} | "
                     + " | ".join(f"{case['ms'][n]:.3f}" for n in names) + f" | {diffs} |")
    errors = {n: e for case in result["cases"] for n, e in case["max_abs_diff"].items() if isinstance(e, str)}
    lines += [f"\n{name}: {error}" for name, error in errors.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen36-27b", choices=sorted(DIMS))
    parser.add_argument("--cases", default="1x1x1024,1x17x1024,1x65x1024,1x17x4096,4x17x1024,8x17x1024,8x5x2048",
                        help="RxQxE: requests x query rows x keys")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--between", type=int, default=0, help="1: a layer's two matrix products around each call")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dims = DIMS[args.shape]
    result = {"header": header(), "shape": args.shape, "layers": dims["layers"], "repeats": args.repeats,
              "between": bool(args.between), "cases": []}
    for case in args.cases.split(","):
        requests, rows, keys = (int(x) for x in case.split("x"))
        result["cases"].append(measure(dims, requests, rows, keys, args.repeats,
                                       [n for n in args.variants.split(",") if n], bool(args.between)))
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
