"""A decode step's matrix products at 27B shapes: cuBLAS against our Triton GEMV, and the read bandwidth they chase.

Every Linear of the random Qwen3.6-27B-shaped target (perf/hybrid_verify.random_target: the fused projections as
served, and the lm_head) in forward order, each with its own weights, timed as one CUDA graph replay for M input
rows. Variants:
- cublaslt: F.linear as the engine runs it (PyTorch's default BLAS backend, cuBLASLt);
- cublas: the same with torch.backends.cuda.preferred_blas_library("cublas") (the legacy API's GEMV kernels);
- ours: ddtree.models.gemv_kernel.linear_rows with, per weight shape, the best of CONFIG_GRID (one row) or DOT_GRID
  (several: tl.dot tiles) (each shape's configurations timed first on that shape's weights alone).
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

CONFIG_GRID = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3, 4))
               if bn * bk <= 16384]
# several rows: tl.dot tiles (BLOCK_N, BLOCK_K, warps, stages)
DOT_GRID = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
            if bn * bk <= 16384]


def read_bandwidth(gib: float = 4.0) -> float:
    """Bytes read per second by a float32-accumulated sum over a bf16 tensor (median of 10)."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    times = timed(lambda: src.sum(dtype=torch.float32), "cuda", 12)[2:]
    return src.numel() * src.element_size() / (statistics.median(times) / 1e3)


def linears(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def best_configs(weights: list[torch.Tensor], rows: int, repeats: int) -> dict:
    from ddtree.models.gemv_kernel import linear_rows

    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for w in weights:
        by_shape.setdefault(tuple(w.shape), []).append(w)
    chosen = {}
    for shape, group in by_shape.items():
        group = group[:16]
        x = torch.randn(rows, shape[1], device="cuda", dtype=group[0].dtype)
        base = graph_ms(lambda: [F.linear(x, w) for w in group], repeats)
        times = {}
        for config in (CONFIG_GRID if rows == 1 else DOT_GRID):
            try:
                times[config] = graph_ms(lambda: [linear_rows(x, w, config) for w in group], repeats)
            except Exception as exc:   # a configuration the compiler refuses (registers, shared memory)
                print(f"{shape} {config}: {exc!r:.120}", flush=True)
        best = min(times, key=times.get)
        gbytes = sum(w.numel() * w.element_size() for w in group) / 1e9
        chosen[shape] = {"config": list(best), "ms": times[best], "cublaslt_ms": base, "weights": len(group),
                         "ours_tb_per_s": gbytes / times[best], "cublaslt_tb_per_s": gbytes / base,
                         "top5": sorted(([list(c), t] for c, t in times.items()), key=lambda ct: ct[1])[:5]}
        print(f"{shape}: cublaslt {base:.3f} ms ({gbytes / base:.2f} TB/s), ours {times[best]:.3f} "
              f"({gbytes / times[best]:.2f} TB/s) with {best}", flush=True)
    return chosen


def whole_step(weights: list[torch.Tensor], rows: int, chosen: dict, repeats: int) -> dict:
    from ddtree.models.gemv_kernel import linear_rows

    xs = {k: torch.randn(rows, k, device="cuda", dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}
    out = {}
    out["cublaslt"] = graph_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], repeats)
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublas")
        out["cublas"] = graph_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], repeats)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    configs = [tuple(chosen[tuple(w.shape)]["config"]) for w in weights]
    out["ours"] = graph_ms(lambda: [linear_rows(xs[w.shape[1]], w, c) for w, c in zip(weights, configs)], repeats)
    # agreement with cuBLAS on one weight of each shape
    diffs = {}
    for shape in chosen:
        w = next(w for w in weights if tuple(w.shape) == shape)
        x = xs[shape[1]]
        ref = F.linear(x.float(), w.float())
        diffs[f"{shape[0]}x{shape[1]}"] = {
            "ours": (linear_rows(x, w, tuple(chosen[shape]["config"])).float() - ref).abs().max().item(),
            "cublaslt": (F.linear(x, w).float() - ref).abs().max().item()}
    out["max_abs_diff_vs_fp32"] = diffs
    return out


def table(result: dict) -> str:
    gb = result["weight_bytes"] / 1e9
    lines = [f"read bandwidth {result['read_bytes_per_s'] / 1e12:.2f} TB/s (a sum), copy {result['copy_bytes_per_s'] / 1e12:.2f}"
             f" TB/s (read + written); a step's Linear weights {gb:.2f} GB (floor at copy bandwidth "
             f"{gb / result['copy_bytes_per_s'] * 1e12:.2f} ms)\n",
             "Every Linear of a step in one CUDA graph replay, ms (/ floor at copy bandwidth)\n",
             "| rows | cublaslt | cublas | ours |", "|---|---|---|---|"]
    floor = gb / result["copy_bytes_per_s"] * 1e12
    for rows, step in result["steps"].items():
        lines.append(f"| {rows} | " + " | ".join(f"{step[v]:.3f} ({step[v] / floor:.3f})" for v in ("cublaslt", "cublas", "ours")) + " |")
    lines += ["", "Per weight shape (up to 16 of its weights in one graph), best configuration of ours "
              "(BLOCK_N, BLOCK_K, warps, stages)\n",
              "| rows | N x K | weights | cublaslt ms | TB/s | ours ms | TB/s | config |", "|---|---|---|---|---|---|---|---|"]
    for rows, shapes in result["shapes"].items():
        for shape, s in shapes.items():
            lines.append(f"| {rows} | {shape} | {s['weights']} | {s['cublaslt_ms']:.3f} | {s['cublaslt_tb_per_s']:.2f} | "
                         f"{s['ms']:.3f} | {s['ours_tb_per_s']:.2f} | {tuple(s['config'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen36-27b")
    parser.add_argument("--rows", default="1,17,65", help="comma-separated input row counts (at most gemv_kernel.MAX_ROWS)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="gemv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.set_grad_enabled(False)
    model = random_target(args.shape, torch.bfloat16, "cuda")
    weights = linears(model)
    result = {"header": header(), "shape": args.shape, "repeats": args.repeats,
              "weight_bytes": sum(w.numel() * w.element_size() for w in weights),
              "read_bytes_per_s": read_bandwidth(), "copy_bytes_per_s": copy_bandwidth("cuda"),
              "shapes": {}, "steps": {}}
    print(f"read {result['read_bytes_per_s'] / 1e12:.2f} TB/s, copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        chosen = best_configs(weights, rows, args.repeats)
        result["shapes"][rows] = {f"{n}x{k}": v for (n, k), v in chosen.items()}
        result["steps"][rows] = whole_step(weights, rows, chosen, args.repeats)
        print(f"rows {rows}: {result['steps'][rows]}", flush=True)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
