"""The few-rows kernel's NORM and GLU forms against the chain's own kernel beside the product, at 27B shapes, for a
tree's rows.

In a verify of 16 or 17 rows each layer's input norm and post-attention norm run as a compiled kernel of their own
(129 a 27B verify, ~0.34 ms of an H100's 20 ms), because a prologue computing the chain per program made the
few-rows kernel 2-3x slower (perf/results/gemv_rows_h200.md, gpu_ratios_h200_rowpro.md). The NORM form
(gemv_kernel.linear_rows' norm_input) leaves the product's input untouched: it takes x = h * p, which the kernel
before it would write beside h, and gathers each row's statistic from h with a load of its own, applying rstd to the
product's sum. This measures whether that costs less than the norm's kernel, the Linears alone; the engine's use
(DDTREE_ROWS_NORM=1, kernels.rows_norm) in whole rounds: perf/gpu_ratios.py --round-variants static-rowsnorm.

Every Linear of the random Qwen3.6-27B-shaped target that follows a norm (each layer's fused input projections and
its MLP's gate/up; perf/gemv_bench.linears' "norm"), with its own weights, in forward order, one CUDA graph per
variant, timed in turns (each turn every variant in a rotating order; medians over turns):
- norm+rows: the compiled zero-centered norm (ddtree.models.fused, as a static forward runs it), then the few-rows
  kernel (what a verify does now);
- rows NORM: the few-rows kernel's NORM form alone;
- rows: the few-rows kernel alone on x (the NORM form's floor: its extra load and epilogue cost the difference).
And, in the same turns, each MLP's fused gate/up product (the few-rows kernel's GLU form, DDTREE_ROWS_GLU=1):
- rows+silu: the product, then the compiled silu(gate) * up (what a verify does now);
- rows GLU: the product with silu(gate) * up in its epilogue (gemv_kernel.linear_rows' glu).
Also each variant's largest difference from a float32 reference on one weight of each shape.

    python perf/rows_norm_bench.py --name rows_norm_h100

Writes perf/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.tree_kernel_bench import capture, replay_ms  # noqa: E402

VARIANTS = ("norm+rows", "rows NORM", "rows", "rows+silu", "rows GLU")
EPS = 1e-6


def step_fns(weights: list[torch.Tensor], mlps: list[torch.Tensor], rows: int, generator: torch.Generator
             ) -> tuple[dict, dict]:
    """Per variant a function running every weight's product once (inputs fixed per weight width), and the inputs;
    the last two over the MLPs' fused gate/up weights (mlps) alone."""
    from ddtree.models import fused
    from ddtree.models.gemv_kernel import linear_rows

    widths = sorted({w.shape[1] for w in weights})
    device, dtype = weights[0].device, weights[0].dtype
    inputs = {}
    for k in widths:
        h = torch.randn(rows, k, generator=generator, device="cpu").to(device, dtype)
        p = (1.0 + 0.1 * torch.randn(k, generator=generator)).to(device)   # Qwen3.5's 1 + weight, float32
        inputs[k] = (h, p, (h.float() * p).to(dtype))

    def norm_rows():
        with fused.static():
            for w in weights:
                h, p, _ = inputs[w.shape[1]]
                linear_rows(fused.zero_centered_rms_norm(h, p, EPS), w)

    def rows_norm():
        for w in weights:
            h, _, xs = inputs[w.shape[1]]
            linear_rows(xs, w, norm_input=h, eps=EPS)

    def rows_alone():
        for w in weights:
            linear_rows(inputs[w.shape[1]][2], w)

    def rows_silu():
        with fused.static():
            for w in mlps:
                fused.silu_mul(*linear_rows(inputs[w.shape[1]][2], w).split(w.shape[0] // 2, dim=-1))

    def rows_glu():
        for w in mlps:
            linear_rows(inputs[w.shape[1]][2], w, glu=True)

    return {"norm+rows": norm_rows, "rows NORM": rows_norm, "rows": rows_alone, "rows+silu": rows_silu,
            "rows GLU": rows_glu}, inputs


def differences(weights: list[torch.Tensor], mlps: list[torch.Tensor], inputs: dict) -> dict:
    """Each variant's largest |output - float32 reference| on one weight of each shape, over the reference's scale
    (the GLU pair against silu(gate) * up of the float32 product)."""
    from ddtree.models import fused
    from ddtree.models.gemv_kernel import linear_rows

    def largest(ref: torch.Tensor, got: dict) -> dict:
        return {v: (g.float() - ref).abs().max().item() / ref.abs().max().item() for v, g in got.items()}

    out = {}
    for w in {tuple(w.shape): w for w in weights}.values():
        h, p, xs = inputs[w.shape[1]]
        ref = F.linear(fused.zero_centered_rms_norm.eager(h.float(), p, EPS), w.float())
        with fused.static():
            got = {"norm+rows": linear_rows(fused.zero_centered_rms_norm(h, p, EPS), w),
                   "rows NORM": linear_rows(xs, w, norm_input=h, eps=EPS)}
        out[f"{w.shape[0]}x{w.shape[1]}"] = largest(ref, got)
    for w in {tuple(w.shape): w for w in mlps}.values():
        xs, half = inputs[w.shape[1]][2], w.shape[0] // 2
        ref = fused.silu_mul.eager(*F.linear(xs.float(), w.float()).split(half, dim=-1))
        with fused.static():
            got = {"rows+silu": fused.silu_mul(*linear_rows(xs, w).split(half, dim=-1)),
                   "rows GLU": linear_rows(xs, w, glu=True)}
        out[f"{w.shape[0]}x{w.shape[1]} gate/up"] = largest(ref, got)
    return out


def table(result: dict) -> str:
    lines = [f"{result['linears']} Linears after a norm ({result['weight_bytes'] / 1e9:.2f} GB of weights; the last two "
             f"variants: the {result['mlps']} MLPs' gate/up products alone), one CUDA graph per variant, "
             f"{result['turns']} turns of {result['repeats']} replays (median of the turns' medians, ms; a ratio: the "
             "median of each turn's ratio)\n",
             "| rows | " + " | ".join(VARIANTS) + " | rows NORM / norm+rows | rows / norm+rows | saved a Linear, us | "
             "rows GLU / rows+silu | saved an MLP, us |",
             "|---|" + "---|" * (len(VARIANTS) + 5)]
    for rows, r in result["rows"].items():
        lines.append(f"| {rows} | " + " | ".join(f"{r['ms'][v]:.3f}" for v in VARIANTS)
                     + f" | {r['ratio']['rows NORM']:.3f} | {r['ratio']['rows']:.3f} | "
                     f"{(r['ms']['norm+rows'] - r['ms']['rows NORM']) * 1e3 / result['linears']:.2f} | "
                     f"{r['glu_ratio']:.3f} | {(r['ms']['rows+silu'] - r['ms']['rows GLU']) * 1e3 / result['mlps']:.2f} |")
    lines += ["", "Largest difference from a float32 reference, over the reference's largest output\n",
              "| rows | N x K | variant | difference |", "|---|---|---|---|"]
    for rows, r in result["rows"].items():
        for shape, d in r["differences"].items():
            lines += [f"| {rows} | {shape} | {v} | {x:.2e} |" for v, x in d.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen36-27b")
    parser.add_argument("--rows", default="16,17")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="rows_norm")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from tqdm import tqdm

    from perf.gemv_bench import linears
    from perf.hybrid_verify import random_target

    torch.set_grad_enabled(False)
    model = random_target(args.shape, torch.bfloat16, "cuda")
    weights = [w for w, kind, _, _ in linears(model) if kind == "norm"]
    mlps = [layer.mlp.fused_proj.weight for layer in model.layers]
    result = {"header": header(), "shape": args.shape, "linears": len(weights), "mlps": len(mlps), "turns": args.turns,
              "repeats": args.repeats, "weight_bytes": sum(w.numel() * w.element_size() for w in weights), "rows": {}}
    generator = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        fns, inputs = step_fns(weights, mlps, rows, generator)
        graphs = {v: capture(fn) for v, fn in tqdm(fns.items(), desc=f"{rows} rows: capturing")}
        turns = []
        for turn in tqdm(range(args.turns), desc=f"{rows} rows: turns"):
            order = VARIANTS[turn % len(VARIANTS):] + VARIANTS[:turn % len(VARIANTS)]
            turns.append({v: replay_ms(graphs[v], args.repeats) for v in order})
        result["rows"][rows] = {
            "turns": turns, "ms": {v: statistics.median(t[v] for t in turns) for v in VARIANTS},
            "ratio": {v: statistics.median(t[v] / t["norm+rows"] for t in turns) for v in VARIANTS},
            "glu_ratio": statistics.median(t["rows GLU"] / t["rows+silu"] for t in turns),
            "differences": differences(weights, mlps, inputs)}
        print(f"{rows} rows: {result['rows'][rows]['ms']}", flush=True)
        del graphs
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
