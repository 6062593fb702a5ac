"""A decode step's matrix products at 27B shapes: cuBLAS against our Triton GEMV (one row) and few-rows kernel (a small
tree's rows, a drafter's block), and the read bandwidth they chase.

Every Linear of the random Qwen3.6-27B-shaped target (perf/hybrid_verify.random_target: the fused projections as
served, and the lm_head) in forward order, each with its own weights, timed as one CUDA graph replay for M input
rows. Variants:
- cublaslt: F.linear as the engine runs it (PyTorch's default BLAS backend, cuBLASLt);
- cublas: the same with torch.backends.cuda.preferred_blas_library("cublas") (the legacy API's GEMV kernels);
- ours: ddtree.models.gemv_kernel.linear_rows with, per weight shape, the best of CONFIG_GRID (one row) or ROWS_GRID
  (more) (each shape's configurations timed first on that shape's weights alone);
- ours_swap (more than one row, --forms swap): the few-rows kernel's swapped form (the weight's columns the tile's
  long side, as cuBLAS tiles skinny products), each shape at the best of SWAP_GRID;
- ours_prologues: the same with the prologue the engine gives each Linear (the chain before it: norm, silu * up,
  gated norm, sigmoid gate) and the residual add in the epilogue of the layer's output and down projections, each
  (shape, prologue) at its own best configuration; more than one row: the add alone (the few-rows kernel takes no
  prologue: computed per program, the chains made 16 rows' products 2.6x slower, perf/results/gemv_rows_h200.md).
  Not comparable with the GEMMs alone: it does the chains' work
  too.
Also: bytes-read bandwidth (a sum over 4 GiB) and copy bandwidth (read + written), measured in the same run.

    python perf/gemv_bench.py --name gemv_h200
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.hybrid_verify import copy_bandwidth, random_target, timed  # noqa: E402
from perf.tree_kernel_bench import graph_ms  # noqa: E402

CONFIG_GRID = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (3, 4))
               if bn * bk <= 16384]
# the few-rows kernel's (more than one row): tl.dot tiles of at least 16 columns; with a prologue, the best ROWS_TOP of
# the shape's plain configurations
ROWS_GRID = list(itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4)))
# the swapped form's: the weight's columns are the tile's first dimension (Hopper's wgmma tiles are 64 of it a warp group)
SWAP_GRID = list(itertools.product((16, 32, 64, 128, 256), (64, 128), (4, 8), (3, 4)))
ROWS_TOP = 4


def read_bandwidth(gib: float = 4.0) -> float:
    """Bytes read per second by a float32-accumulated sum over a bf16 tensor (median of 10)."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    times = timed(lambda: src.sum(dtype=torch.float32), "cuda", 12)[2:]
    return src.numel() * src.element_size() / (statistics.median(times) / 1e3)


def linears(model: torch.nn.Module) -> list[tuple[torch.Tensor, str | None, int, bool]]:
    """Every Linear's weight in forward order with what the engine's one-row forward gives it: the prologue (the
    chain before it: ddtree.models.layers.Prologue), its group width, and whether its epilogue adds the residual
    stream (a layer's output projections and down projection). A dense model's o_proj has no prologue (the sigmoid
    gate is the hybrid's)."""
    c, out = model.config, []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if name.endswith("fused_proj"):
            kind, group = "norm", 1
        elif name.endswith("down_proj"):
            kind, group = "silu_mul", 1
        elif name.endswith("out_proj"):
            kind, group = "gated_norm", c.linear_value_head_dim
        elif name.endswith("o_proj") and hasattr(c, "linear_value_head_dim"):   # a hybrid's gated attention output
            kind, group = "sigmoid_gate", c.head_dim
        else:
            kind, group = None, 1
        out.append((m.weight, kind, group, name.endswith(("down_proj", "out_proj", "o_proj"))))
    return out


def prologue_inputs(kind: str | None, rows: int, n: int, k: int, group: int, add: bool, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, dict]:
    def rand(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt)

    x, kwargs = rand(rows, k), {"add": rand(rows, n)} if add else {}
    if rows > 1:   # the few-rows kernel takes no prologue (its add only)
        return x, kwargs
    if kind == "norm":
        kwargs.update(prologue=kind, p=1.0 + 0.1 * rand(k, dt=torch.float32), eps=1e-6)
    elif kind == "silu_mul":
        kwargs.update(prologue=kind, a=rand(rows, k))
    elif kind == "gated_norm":
        kwargs.update(prologue=kind, a=rand(rows, k), p=rand(group), eps=1e-6, group=group)
    elif kind == "sigmoid_gate":
        kwargs.update(prologue=kind, a=rand(rows, k // group, 2 * group)[..., group:], group=group)
    return x, kwargs


def best_configs(weights: list[tuple[torch.Tensor, str | None, int, bool]], rows: int, repeats: int,
                 forms: tuple[str, ...] = ("rows",), swap_grid: list[tuple[int, int, int, int]] | None = None) -> dict:
    """Per (weight shape, prologue): cuBLASLt's time, and ours plain and with the prologue (and the residual add
    where the engine adds it) at their best configurations (up to 16 of the shape's weights in one graph); forms
    (more than one row): "rows" the few-rows kernel's rows-first form (variants plain, prologue), "swap" its swapped
    one (swap, swap_prologue); swap_grid: the swapped form's configurations to search (default SWAP_GRID)."""
    from ddtree.models.gemv_kernel import fit_shared, linear_rows, rows_block, shared_budget

    groups: dict[tuple, list[torch.Tensor]] = {}
    for w, kind, group, add in weights:
        groups.setdefault((*w.shape, kind, group, add), []).append(w)
    chosen = {}
    for (n, k, kind, group, add), ws in groups.items():
        ws = ws[:16]
        x, kwargs = prologue_inputs(kind, rows, n, k, group, add, ws[0].dtype)
        gbytes = sum(w.numel() * w.element_size() for w in ws) / 1e9
        entry = {"weights": len(ws), "cublaslt_ms": graph_ms(lambda: [F.linear(x, w) for w in ws], repeats)}
        variants = []
        for form in ("rows",) if rows == 1 else forms:
            swap = {"swap": form == "swap"} if rows > 1 else {}
            variants.append(("plain" if form == "rows" else "swap", swap))
            if kwargs:
                variants.append(("prologue" if form == "rows" else "swap_prologue", {**kwargs, **swap}))
        for variant, kw in variants:
            first = "swap" if variant.startswith("swap") else "plain"
            times, grid = {}, CONFIG_GRID if rows == 1 else (swap_grid or SWAP_GRID) if first == "swap" else ROWS_GRID
            if rows > 1 and variant != first:
                grid = [tuple(c) for c, _ in entry[first]["top"][:ROWS_TOP]]
            if rows > 1:   # configurations whose tiles do not fit in shared memory are cut down by linear_rows: skipped
                grid = [c for c in grid if fit_shared(rows_block(rows), c[0], c[1], c[3], x.element_size(),
                                                  shared_budget(x.device)) == (c[1], c[3])]
            for config in grid:
                try:
                    times[config] = graph_ms(lambda: [linear_rows(x, w, config, **kw) for w in ws], repeats)
                except Exception as exc:   # a configuration the compiler refuses (registers, shared memory)
                    print(f"{n}x{k} {kind} {config}: {exc!r:.120}", flush=True)
            best = min(times, key=times.get)
            ranked = sorted(([list(c), t] for c, t in times.items()), key=lambda ct: ct[1])
            entry[variant] = {"config": list(best), "ms": times[best], "tb_per_s": gbytes / times[best],
                              "top": ranked[:ROWS_TOP]}
        entry["cublaslt_tb_per_s"] = gbytes / entry["cublaslt_ms"]
        chosen[(n, k, kind, group, add)] = entry
        print(f"{rows} rows {n}x{k} {kind}: cublaslt {entry['cublaslt_ms']:.3f} ms, "
              + ", ".join(f"{v} {entry[v]['ms']:.3f} ({entry[v]['tb_per_s']:.2f} TB/s) {tuple(entry[v]['config'])}"
                          for v in ("plain", "prologue", "swap", "swap_prologue") if v in entry), flush=True)
    return chosen


def whole_step(weights: list[tuple[torch.Tensor, str | None, int, bool]], rows: int, chosen: dict, repeats: int) -> dict:
    """Every Linear of a step in one graph: cuBLASLt, ours plain, ours with the engine's prologues."""
    from ddtree.models.gemv_kernel import linear_rows

    inputs = {key: prologue_inputs(key[2], rows, key[0], key[1], key[3], key[4], weights[0][0].dtype) for key in chosen}
    plan = [(w, *inputs[(*w.shape, kind, group, add)], chosen[(*w.shape, kind, group, add)])
            for w, kind, group, add in weights]
    out = {"cublaslt": graph_ms(lambda: [F.linear(x, w) for w, x, _, _ in plan], repeats)}
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublas")
        out["cublas"] = graph_ms(lambda: [F.linear(x, w) for w, x, _, _ in plan], repeats)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    first = next(iter(chosen.values()))
    for name, plain, pro, swap in (("ours", "plain", "prologue", False), ("ours_swap", "swap", "swap_prologue", True)):
        if plain not in first:
            continue
        flag = {"swap": swap} if rows > 1 else {}
        out[name] = graph_ms(lambda: [linear_rows(x, w, tuple(e[plain]["config"]), **flag) for w, x, _, e in plan],
                             repeats)
        out[f"{name}_prologues"] = graph_ms(lambda: [linear_rows(x, w, tuple(e.get(pro, e[plain])["config"]),
                                                                 **{**kw, **flag}) for w, x, kw, e in plan], repeats)
    diffs = {}
    for (n, k, kind, group, add), (x, _) in inputs.items():   # agreement with cuBLAS, plain, one weight of each shape
        w = next(w for w, *_ in weights if tuple(w.shape) == (n, k))
        ref = F.linear(x.float(), w.float())
        diffs[f"{n}x{k}"] = {"ours": (linear_rows(x, w).float() - ref).abs().max().item(),
                             "cublaslt": (F.linear(x, w).float() - ref).abs().max().item()}
        if rows > 1 and "swap" in first:
            diffs[f"{n}x{k}"]["ours_swap"] = (linear_rows(x, w, swap=True).float() - ref).abs().max().item()
    out["max_abs_diff_vs_fp32"] = diffs
    return out


def table(result: dict) -> str:
    gb = result["weight_bytes"] / 1e9
    lines = [f"read bandwidth {result['read_bytes_per_s'] / 1e12:.2f} TB/s (a sum), copy {result['copy_bytes_per_s'] / 1e12:.2f}"
             f" TB/s (read + written); a step's Linear weights {gb:.2f} GB (floor at copy bandwidth "
             f"{gb / result['copy_bytes_per_s'] * 1e12:.2f} ms)\n",
             "Every Linear of a step in one CUDA graph replay, ms (/ floor at copy bandwidth)\n",
             "| rows | cublaslt | cublas | ours | ours with the prologues | ours swapped | ours swapped with the prologues |",
             "|---|---|---|---|---|---|---|"]
    floor = gb / result["copy_bytes_per_s"] * 1e12
    variants = ("cublaslt", "cublas", "ours", "ours_prologues", "ours_swap", "ours_swap_prologues")
    for rows, step in result["steps"].items():
        lines.append(f"| {rows} | " + " | ".join(f"{step[v]:.3f} ({step[v] / floor:.3f})" if v in step else "-"
                                                 for v in variants) + " |")
    lines += ["", "Per weight shape and prologue (up to 16 of its weights in one graph), ms (TB/s), best configuration "
              "of ours (BLOCK_N, BLOCK_K, warps, stages)\n",
              "| rows | N x K | prologue | weights | cublaslt | ours | config | ours with the prologue | config "
              "| ours swapped | config | swapped with the prologue | config |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rows, shapes in result["shapes"].items():
        for key, s in shapes.items():
            cells = [f"{s[v]['ms']:.3f} ({s[v]['tb_per_s']:.2f}) | {tuple(s[v]['config'])}" if v in s else "- | -"
                     for v in ("plain", "prologue", "swap", "swap_prologue")]
            lines.append(f"| {rows} | {key.rsplit(' ', 1)[0]} | {key.rsplit(' ', 1)[1]} | {s['weights']} | "
                         f"{s['cublaslt_ms']:.3f} ({s['cublaslt_tb_per_s']:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen36-27b",
                        help="a hybrid shape (perf/hybrid_verify.SHAPES) or a dense one (perf/gpu_ratios.DENSE_SHAPES)")
    parser.add_argument("--rows", default="1", help="input rows, comma-separated (one: the GEMV; more: the few-rows kernel)")
    parser.add_argument("--forms", default="rows", help="the few-rows kernel's forms to measure: rows, swap or both")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--swap-grid", default="", metavar="BN,../BK,../WARPS,../STAGES,..",
                        help="the swapped form's search, one list per field (default SWAP_GRID's; a narrower one compiles "
                             "fewer kernels: e.g. 64,128/64,128/4,8/3,4)")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="gemv")
    args = parser.parse_args(argv)
    swap_grid = (list(itertools.product(*([int(v) for v in field.split(",")] for field in args.swap_grid.split("/"))))
                 if args.swap_grid else None)
    if swap_grid and len(swap_grid[0]) != 4:
        parser.error("--swap-grid: four fields, BN/BK/WARPS/STAGES")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.set_grad_enabled(False)
    from perf.gpu_ratios import DENSE_SHAPES, dense_target  # dense shapes too (smollm2-135m: the embedded default's)

    model = (dense_target(args.shape, torch.bfloat16, "cuda") if args.shape in DENSE_SHAPES
             else random_target(args.shape, torch.bfloat16, "cuda"))
    weights = linears(model)
    result = {"header": header(), "shape": args.shape, "repeats": args.repeats,
              "weight_bytes": sum(w.numel() * w.element_size() for w, *_ in weights),
              "read_bytes_per_s": read_bandwidth(), "copy_bytes_per_s": copy_bandwidth("cuda"),
              "shapes": {}, "steps": {}}
    print(f"read {result['read_bytes_per_s'] / 1e12:.2f} TB/s, copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    result["swap_grid"] = swap_grid or SWAP_GRID
    for rows in (int(r) for r in args.rows.split(",")):
        chosen = best_configs(weights, rows, args.repeats, tuple(args.forms.split(",")), swap_grid)
        result["shapes"][rows] = {f"{n}x{k} {kind}{'+add' if add else ''}": v for (n, k, kind, _, add), v in chosen.items()}
        result["steps"][rows] = whole_step(weights, rows, chosen, args.repeats)
        print(f"rows {rows}: {result['steps'][rows]}", flush=True)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
