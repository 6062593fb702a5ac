"""The tree part of the Gated DeltaNet recurrence on the GPU: fla's fused recurrent kernel over each request's
root-to-leaf paths (the paths form as the engine's static verify runs it: the committed state copied per path,
inputs gathered into path order, one call per request) against our kernel (ddtree.models.tree_kernel: every
request's paths in one call, each from its slot of the recurrent pool, nodes read and written in place), over
our kernel's launch shapes.

One layer's dims of the target shape (Qwen3.6-27B: 16 key heads, 48 value heads, 128 x 128 states), a whole
verify's worth of layers (48) per timed CUDA graph replay, trees built by the engine's own builder from drafter-like
distributions (peaked: deep trees with side branches; flat: bushy ones), budgets and batch sizes as given.
Writes perf/results/<name>.{json,md}.

    python perf/tree_kernel_bench.py --name tree_kernel_h200
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.gdn import TreePaths, gdn_paths, leaves, tree_paths  # noqa: E402
from ddtree.models.graphs import row_bucket  # noqa: E402
from ddtree.models.kernels import step_gdn_kernel  # noqa: E402
from ddtree.models.qwen3_5 import PATHS_MAX_LEN  # noqa: E402
from ddtree.tree import build_tree, top_log_probs  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402

DIMS = {"qwen36-27b": dict(h=16, hv=48, dk=128, dv=128, layers=48)}


def make_trees(budget: int, count: int, peak: float, seed: int) -> list[list[int]]:
    """`count` verify trees (root + `budget` nodes) from drafter-like distributions: logits ~ N(0, peak^2)."""
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(count):
        log_probs, token_ids = top_log_probs(torch.randn(15, 4096, generator=gen) * peak, budget)
        trees.append(build_tree(log_probs, token_ids, budget).parents)
    return trees


def graph_ms(fn, repeats: int) -> float:
    """Median ms of one replay of a CUDA graph of fn (warmed up eagerly first)."""
    return replay_ms(capture(fn), repeats)


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, run eagerly twice first (compiles, allocator warm-up) on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Median ms of `repeats` replays of graph, after two untimed ones."""
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def depth(parents: list[int]) -> int:
    """The most rows on a root-to-leaf path of a tree."""
    rows = []
    for p in parents:
        rows.append(1 if p < 0 else rows[p] + 1)
    return max(rows)


def measure(dims: dict, trees: list[list[int]], configs: list[tuple[int, int, int]], chunk_configs: list[tuple],
            repeats: int) -> dict:
    from ddtree.models.gdn import ancestors_from_parents
    from ddtree.models.tree_kernel import batched_tree_chunks, batched_tree_paths

    h, hv, dk, dv, layers = dims["h"], dims["hv"], dims["dk"], dims["dv"], dims["layers"]
    reqs, rows = len(trees), row_bucket(max(len(p) for p in trees))
    n, dev, gen = reqs * rows, "cuda", torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(n, h, dk, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(n, hv, dv, device=dev, generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(n, hv, device=dev, generator=gen) * 0.5
    beta = torch.rand(n, hv, device=dev, generator=gen, dtype=torch.bfloat16)
    pool = torch.randn(max(reqs, 2), layers, hv, dk, dv, device=dev, generator=gen) * 0.05   # [slots, L, ...]
    slots = list(range(reqs))
    # the engine's static paths form: for fla's kernel the path count to its bucket, tokens padded to bucket x
    # PATHS_MAX_LEN; for ours as many paths as rows (graphs.StaticTarget: padding paths read nothing)
    num_paths = row_bucket(max(len(leaves(p)) for p in trees))

    def paths_of(count: int) -> list[TreePaths]:
        return [TreePaths(*(torch.from_numpy(a).to(dev) for a in tree_paths(parents, PATHS_MAX_LEN, count,
                                                                            count * PATHS_MAX_LEN, num_nodes=rows)))
                for parents in trees]

    per_request = paths_of(num_paths)
    fla = step_gdn_kernel(torch.device(dev))

    def run_fla():
        outs = []
        for layer in range(layers):
            for r, paths in enumerate(per_request):
                at = slice(r * rows, (r + 1) * rows)
                outs.append(gdn_paths(fla, q[at], k[at], v[at], g[at], beta[at], paths, pool[slots[r], layer]))
        return outs

    # ours: every request's paths in one call per layer (the flat form the batched engine builds once per forward)
    def flat(paths: list[TreePaths], count: int) -> tuple[torch.Tensor, ...]:
        return (torch.cat([p.tokens + r * rows for r, p in enumerate(paths)]),
                torch.cat([p.cu_seqlens[:-1] + r * p.tokens.shape[0] for r, p in enumerate(paths)]),
                torch.cat([p.cu_seqlens[1:] + r * p.tokens.shape[0] for r, p in enumerate(paths)]),
                torch.tensor(slots, device=dev).repeat_interleave(count))

    engine_form, leaf_form = flat(paths_of(rows), rows), flat(per_request, num_paths)

    def run_ours(config, form=engine_form):
        (bv, warps, stages), (tokens, first, last, path_state) = config, form
        return [batched_tree_paths(q, k, v, g, beta, tokens, first, last, pool[:, layer], path_state, block_v=bv,
                                   num_warps=warps, num_stages=stages) for layer in range(layers)]

    want = run_fla()
    result = {"requests": reqs, "rows": rows, "paths": [len(leaves(p)) for p in trees], "path_bucket": num_paths,
              "depth": max(depth(p) for p in trees),
              "fla_ms": graph_ms(run_fla, repeats), "ours": {}}
    for config in configs:
        got = run_ours(config)
        error = max((got[layer][r * rows : r * rows + len(p)].float()
                     - want[layer * reqs + r][: len(p)].float()).abs().max().item()
                    for layer in (0, layers - 1) for r, p in enumerate(trees))
        result["ours"]["bv{}_w{}_s{}".format(*config)] = {"ms": graph_ms(lambda: run_ours(config), repeats),
                                                          "max_abs_diff": error}
    # the chunk form (batched_tree_chunks): every tree whole, no paths; the engine's padded parents (padding rows roots)
    parents = torch.tensor([p + [-1] * (rows - len(p)) for p in trees], device=dev)
    ancestors = ancestors_from_parents(parents)
    row0 = torch.arange(reqs, device=dev) * rows
    sizes = torch.full((reqs,), rows, device=dev)
    tree_state = torch.tensor(slots, device=dev)

    def run_chunks(config):
        bv, warps, precision, bk = config
        return [batched_tree_chunks(q, k, v, g, beta, row0, sizes, ancestors, pool[:, layer], tree_state, rows,
                                    PATHS_MAX_LEN, block_v=bv, num_warps=warps, block_k=bk, precision=precision)
                for layer in range(layers)]

    def chunk_name(config):   # the key block only where it was named: best_chunk_shapes reads the rest
        bv, warps, precision, bk = config
        return f"bv{bv}_w{warps}_{precision}" + ("" if bk is None else f"_k{bk}")

    result["chunks"] = {}
    for config in chunk_configs:
        try:
            got = run_chunks(config)
        except Exception as exc:   # a shape that does not compile (shared memory): reported, not fatal
            result["chunks"][chunk_name(config)] = {"ms": float("nan"), "error": repr(exc)[:200]}
            continue
        error = max((got[layer][r * rows : r * rows + len(p)].float()
                     - want[layer * reqs + r][: len(p)].float()).abs().max().item()
                    for layer in (0, layers - 1) for r, p in enumerate(trees))
        result["chunks"][chunk_name(config)] = {"ms": graph_ms(lambda: run_chunks(config), repeats), "max_abs_diff": error}
    print("  chunks: " + ", ".join(f"{name} {c['ms']:.3f} ms ({c.get('max_abs_diff', c.get('error'))})"
                                    for name, c in result["chunks"].items()), flush=True)
    best = min(result["ours"].items(), key=lambda kv: kv[1]["ms"])
    result["best"] = {"config": best[0], "ms": best[1]["ms"], "fla_over_best": result["fla_ms"] / best[1]["ms"]}
    # what padding the paths to the rows costs: the best shape with the paths padded to the leaves' bucket instead
    best_config = configs[list(result["ours"]).index(best[0])]
    result["best"]["leaf_bucket_ms"] = graph_ms(lambda: run_ours(best_config, leaf_form), repeats)
    print(f"R={reqs} rows={rows} paths={result['paths']}: fla {result['fla_ms']:.3f} ms, best {best[0]} "
          f"{best[1]['ms']:.3f} ms", flush=True)
    return result


def table(result: dict) -> str:
    lines = [f"Time of {result['layers']} layers' tree recurrence (one CUDA graph replay, median of {result['repeats']}), "
             "ms; fla = the engine's paths form per request; ours = one call per layer for the batch.\n",
             "ours runs the engine's static form, paths padded to the rows; the last column, the same with the paths "
             "padded to the leaves' bucket (what the padding costs).\n",
             "| trees | budget | requests | paths (bucket) | fla ms | best ours | ours ms | fla / ours | max abs diff | "
             "ours, leaves' bucket ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        best = case["best"]
        lines.append(f"| {case['trees']} | {case['budget']} | {case['requests']} | {max(case['paths'])} ({case['path_bucket']}) | "
                     f"{case['fla_ms']:.3f} | {best['config']} | {best['ms']:.3f} | {best['fla_over_best']:.2f} | "
                     f"{case['ours'][best['config']]['max_abs_diff']:.2e} | {best.get('leaf_bucket_ms', float('nan')):.3f} |")
    chunks = list(result["cases"][0].get("chunks", {}))
    if chunks:
        lines += ["", "The chunk form (batched_tree_chunks: each tree whole, ancestor-masked WY form on tensor cores), ms, "
                  "and its max abs diff from fla's paths form; bv = value columns per program, w = warps, then the "
                  "products' input precision\n",
                  "| trees | budget | requests | best paths ms | " + " | ".join(chunks) + " | best chunk diff |",
                  "|---|---|---|---|" + "---|" * len(chunks) + "---|"]
        for case in result["cases"]:
            best = min(case["chunks"].values(), key=lambda c: c["ms"] if c["ms"] == c["ms"] else float("inf"))
            lines.append(f"| {case['trees']} | {case['budget']} | {case['requests']} | {case['best']['ms']:.3f} | "
                         + " | ".join(f"{case['chunks'][c]['ms']:.3f}" for c in chunks)
                         + f" | {best.get('max_abs_diff', float('nan')):.2e} |")
    configs = list(result["cases"][0]["ours"])
    lines += ["", "Every launch shape (ms): bv = value columns per program, w = warps, s = pipeline stages\n",
              "| trees | budget | requests | " + " | ".join(configs) + " |", "|---|---|---|" + "---|" * len(configs)]
    for case in result["cases"]:
        lines.append(f"| {case['trees']} | {case['budget']} | {case['requests']} | "
                     + " | ".join(f"{case['ours'][c]['ms']:.3f}" for c in configs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen36-27b", choices=sorted(DIMS))
    parser.add_argument("--budgets", default="16,32,64")
    parser.add_argument("--requests", default="1,4,8")
    parser.add_argument("--peaks", default="peaked=8,flat=1", help="tree kinds: name=logit scale")
    parser.add_argument("--configs", default="8x1x1,8x1x2,8x1x3,16x1x2,16x2x2,32x2x2,32x4x2,32x4x1")
    parser.add_argument("--chunk-configs", default="32x4xtf32,64x4xtf32,64x8xtf32,128x8xtf32,32x4xtf32x3,64x8xtf32x3",
                        help="the chunk form's launch shapes: value columns x warps x input precision, then optionally "
                             ":k<key columns per step> (default: the engine's, tree_kernel.chunk_shape), e.g. 64x4xtf32:k16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="tree_kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or step_gdn_kernel(torch.device("cuda")) is None:
        raise SystemExit("needs a CUDA GPU with fla installed")
    dims = DIMS[args.shape]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    chunk_configs = []
    for c in filter(None, args.chunk_configs.split(",")):
        shape, _, bk = c.partition(":k")
        bv, w, precision = shape.split("x", 2)
        chunk_configs.append((int(bv), int(w), precision, int(bk) if bk else None))
    result = {"header": header(), "shape": args.shape, "layers": dims["layers"], "repeats": args.repeats, "cases": []}
    for kind in args.peaks.split(","):
        name, peak = kind.split("=")
        for budget in (int(b) for b in args.budgets.split(",")):
            for reqs in (int(r) for r in args.requests.split(",")):
                trees = make_trees(budget, reqs, float(peak), seed=budget)
                case = measure(dims, trees, configs, chunk_configs, args.repeats)
                result["cases"].append({"trees": name, "budget": budget, **case})
                write(args, result, quiet=True)   # after every case: a run cut short keeps what it measured
    write(args, result)
    return result


def write(args: argparse.Namespace, result: dict, quiet: bool = False) -> None:
    result["chunk_shapes"] = best_chunk_shapes(result["cases"])
    text = table(result) + (f"\n\nbest tf32 shapes (summed over the cases of each row bucket): "
                            f"DDTREE_CHUNK_SHAPES={result['chunk_shapes']}")
    if quiet:
        with contextlib.redirect_stdout(io.StringIO()):
            write_results(Path(args.out), args.name, result, text)
    else:
        write_results(Path(args.out), args.name, result, text)


def best_chunk_shapes(cases: list[dict]) -> str:
    """DDTREE_CHUNK_SHAPES ("bn:bv:warps,...") of the tf32 launch shapes with the least time summed over each row
    bucket's cases (the engine's default precision for 16-bit inputs)."""
    totals: dict[int, dict[str, float]] = {}
    for case in cases:
        bn = max(16, 1 << max(case["rows"] - 2, 0).bit_length())   # the forest block of the case's rows
        for name, entry in case.get("chunks", {}).items():
            if name.endswith("_tf32") and entry["ms"] == entry["ms"]:
                totals.setdefault(bn, {}).setdefault(name, 0.0)
                totals[bn][name] += entry["ms"]
    picks = []
    for bn, named in sorted(totals.items()):
        bv, warps = min(named, key=named.get).split("_")[:2]
        picks.append(f"{bn}:{bv[2:]}:{warps[1:]}")
    return ",".join(picks)


if __name__ == "__main__":
    main()
