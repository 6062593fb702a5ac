"""What our matrix-product kernels take of an SM on Hopper (or Blackwell, --arch 120), compiled offline (no GPU
needed): shared memory, registers, spills, and the programs an SM holds at once, per 27B weight shape and form.

The GEMV (`_gemv_kernel`, one row) and the few-rows kernel (`_rows_kernel`: 16 rows rows-first, 17 in the swapped
form; "glu": its GLU form on the MLPs' gate/up products; "norm out" / "norm in": a hybrid's norms across products)
are compiled for sm90 (or sm120) exactly as a launch compiles them (the configuration linear_rows picks, its
pipeline's stages cut to fit the architecture's block, the 16-byte alignment a launch on these shapes specializes),
then ptxas -v (Triton's own) reports registers and spills; so are the tree chunk kernel and the split-KV attention
kernel (other_cases). Forms: `loop` (the default), `peel` (DDTREE_PDL=1: the first weight tile loaded before the
wait, its step out of the loop), `wait` (DDTREE_PDL=1 with DDTREE_PDL_PEEL=0: the wait first, the one loop). An
SM's programs: the fewest its shared memory (sm90 228 KB, sm120 100 KB; 1 KB reserved a program), its registers
(64K), its threads (2048, 1536) and its cap (32, 24) allow; 0: more shared memory than a block may take.

    python perf/kernel_resources.py                     # kernel_resources_sm90
    python perf/kernel_resources.py --arch 120 --forms loop
    python perf/kernel_resources.py --arch 120 --budget-of 90 --forms loop --name kernel_resources_sm120_hopper_cuts

Writes perf/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402

# per architecture (CUDA's "technical specifications per compute capability"; CCCL's cuda/__device/arch_traits.h):
# shared memory an SM gives its programs, threads and programs an SM holds; a block may opt in to the SM's shared
# memory less SHARED_RESERVED (sm90: 227 KB; sm120, the RTX PRO 6000 Blackwell's: 99 KB)
# (ptxas: the -arch and Triton's own binary that assembles its PTX for it: Blackwell's is the newer one it ships)
ARCHS = {90: {"sm_shared": 228 * 1024, "sm_threads": 2048, "sm_programs": 32, "ptxas": ("sm_90a", "ptxas")},
         120: {"sm_shared": 100 * 1024, "sm_threads": 1536, "sm_programs": 24, "ptxas": ("sm_120a", "ptxas-blackwell")}}
SHARED_RESERVED = 1024    # ... less this much the system keeps per program
SM_REGISTERS = 65536      # both architectures'
FORMS = {"loop": (False, False), "peel": (True, True), "wait": (False, True)}   # name: (PEEL, PDL)
INTS_ALIGNED = ("N", "K", "stride_xm", "stride_wn", "stride_om", "stride_am", "stride_addm", "stride_hm")   # multiples of 16 here


def programs_per_sm(shared: int, registers: int, warps: int, arch: int = 90) -> dict[str, int]:
    """How many programs of a kernel an SM of this architecture holds at once, and what each resource alone would
    allow (registers are allocated per warp in units of 256); 0 where one program's shared memory exceeds what a
    block may take (it does not launch)."""
    a = ARCHS[arch]
    threads = 32 * warps
    per_warp = math.ceil(registers * 32 / 256) * 256
    limits = {"shared": a["sm_shared"] // (shared + SHARED_RESERVED), "registers": SM_REGISTERS // (per_warp * warps),
              "threads": a["sm_threads"] // threads, "cap": a["sm_programs"]}
    return {"programs": min(limits.values()), **limits}


# the other kernels with matrix products on tensor cores (the ones whose pipelines take shared memory), their
# pointers' element types as the engine passes them and their scalars'; the rest are i32 (strides, sizes)
POINTERS = {"tree chunk": {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16", "o": "*bf16",
                           "states": "*fp32", "tree_state": "*i64", "tree_row0": "*i64", "tree_rows": "*i64", "anc": "*i8",
                           "scale": "fp32", "eps": "fp32"},
            "attention split": {"q": "*bf16", "k": "*bf16", "v": "*bf16", "mask": "*u8", "slots": "*i64",
                                "o_part": "*fp32", "lse_part": "*fp32", "scale": "fp32"}}


def compile_resources(kernel, constexprs: dict, warps: int, stages: int | None, arch: int = 90,
                      pointers: dict[str, str] | None = None) -> dict:
    """The kernel compiled for this architecture (sm90, sm120) with these constexprs (every pointer and the strides
    and sizes in INTS_ALIGNED 16-byte aligned, as a launch on the 27B shapes specializes them): shared bytes,
    registers, spill bytes. pointers: the types of its pointers and float scalars by name (default: the GEMV's and the
    few-rows kernel's, *_ptr in bf16 but p_ptr and s_ptr); stages None: Triton's default."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in kernel.params if not p.is_constexpr]
    if pointers is None:
        signature = {n: "*fp32" if n in ("p_ptr", "s_ptr") else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps"
                     else "i32" for n in names}
    else:
        signature = {n: pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*") or n in INTS_ALIGNED}
    options = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    target, binary = ARCHS[arch]["ptxas"]
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin" / binary
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        report = subprocess.run([str(ptxas), "-v", f"-arch={target}", f.name, "-o", "/dev/null"], capture_output=True,
                                text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"shared": compiled.metadata.shared, "registers": registers, "spill_bytes": int(spills.group(1)) if spills else 0,
            "async_copies": len(re.findall("async_copy_global_to_local", compiled.asm["ttgir"]))}


def cases(budget_arch: int = 90) -> list[dict]:
    """Every 27B shape the default configurations name: the GEMV per (N, K, prologue), the few-rows kernel per (N, K)
    at 16 rows rows-first and 17 in the swapped form, its stages cut as a launch on that architecture cuts them
    (gemv_kernel.shared_budget: what a block may take less its spare)."""
    import triton

    from ddtree.models import gemv_kernel as g

    out = []
    for n, k, prologue in g.CONFIGS:
        mode = g.PROLOGUES[prologue]
        block_n, block_k, warps, stages = g.gemv_config(n, k, prologue, 128)   # Qwen3.6's value heads: groups of 128
        out.append({"kernel": "gemv", "shape": f"{n}x{k}", "prologue": prologue or "-", "rows": 1, "warps": warps,
                    "stages": stages, "config": (block_n, block_k, warps, stages), "constexprs": {
                        "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRO": mode, "ADD": False, "GROUP": 128,
                        "NORM_K": min(triton.next_power_of_2(k), max(block_k, g.NORM_ELEMENTS)), "NORM_FIRST": False}})
    for rows, swap, table in ((16, False, g.ROWS_CONFIGS), (17, True, g.SWAP_CONFIGS)):
        shapes = sorted({(n, k) for n, k, _ in g.CONFIGS} | set(table))
        for n, k in shapes:
            block_m = g.rows_block(rows)
            budget = g.budget_of(ARCHS[budget_arch]["sm_shared"] - SHARED_RESERVED)
            block_n, block_k, warps, stages = g.rows_config(n, k, block_m, swap, 2, budget=budget)
            glu = (k, n // 2) in shapes   # a gated MLP's gate and up: the down projection reads N // 2 columns
            # a hybrid's norms across products (kernels.norm_parts): the products writing the stream (N = hidden)
            # gather its norm's partial sums in their epilogue, those reading it (K = hidden) apply them
            # (the final norm stays a kernel of its own: the lm_head takes no norm in)
            hidden, vocab = 5120, 248320
            for silu_up, norm in [(False, "")] + [(True, "")] * glu + [(False, " norm out")] * (n == hidden and k != hidden) \
                    + [(glu, " norm in")] * (k == hidden and n != vocab):
                name = ("rows swapped" if swap else "rows") + (" glu" if silu_up else "") + norm
                out.append({"kernel": name, "shape": f"{n}x{k}", "prologue": "-", "rows": rows, "warps": warps,
                            "stages": stages, "config": (block_n, block_k, warps, stages), "constexprs": {
                                "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                # the add: as before for the plain forms; with a norm, only the stream's writers add
                                "ADD": not silu_up if not norm else norm == " norm out", "IEEE": False, "SWAP": swap,
                                "GLU": silu_up, "NORM_OUT": norm == " norm out", "NORM_IN": norm == " norm in",
                                "BLOCK_P": g.NORM_PARTS_BLOCK}})
    out += other_cases()
    return out


def other_cases() -> list[dict]:
    """The tree chunk kernel (a hybrid's tree GDN: 17, 33 and 65 rows, chunk_shape's defaults) and the split-KV
    attention kernel (the 27B target's 24 query and 4 K/V heads of 256 at 1, 17 and 65 rows; the drafter's 32 and 8
    of 128 at a block of 16), at the 27B dims, as their launches configure them."""
    from ddtree.models import attention_kernel as a
    from ddtree.models import tree_kernel as t

    out = []
    for rows in (17, 33, 65):   # a chain's depth: as many rows as the tree (the most WY factors)
        bn, factors = t.chunk_forest(rows, rows)
        bv, warps, bk = t.chunk_shape(bn)
        out.append({"kernel": "tree chunk", "shape": "48 heads x 128x128", "prologue": "-", "rows": rows, "warps": warps,
                    "stages": None, "config": (bv, bk, warps), "constexprs": {
                        "H": 16, "HV": 48, "K": 128, "V": 128, "BK": bk, "BN": bn, "BV": bv,
                        "FACTORS": factors, "PRECISION": "tf32", "PDL": False}})
    for heads, kvh, d, rows in ((24, 4, 256, 1), (24, 4, 256, 17), (24, 4, 256, 65), (32, 8, 128, 16)):
        group = heads // kvh
        block_m, block_n, m_blocks, warps = a.split_tiles(group, rows, d)
        out.append({"kernel": "attention split", "shape": f"{heads}/{kvh} heads of {d}", "prologue": "-", "rows": rows,
                    "warps": warps, "stages": None, "config": (block_m, block_n, warps), "constexprs": {
                        "KVH": kvh, "G": group, "D": d, "BLOCK_M": block_m, "BLOCK_N": block_n,
                        "M_BLOCKS": m_blocks, "PRECISION": "tf32", "PDL": False}})
    return out


def table(rows: list[dict], forms: list[str]) -> str:
    head = ("| kernel | N x K | prologue | rows | config | "
            + " | ".join(f"{f}: shared KB / registers / spills / programs an SM" for f in forms) + " |")
    lines = [head, "|" + "---|" * (5 + len(forms))]
    for r in rows:
        cells = []
        for f in forms:
            x = r["forms"][f]
            cells.append(f"{x['shared'] / 1024:.0f} / {x['registers']} / {x['spill_bytes']} / {x['occupancy']['programs']}"
                         if "error" not in x else f"error: {x['error'][:60]}")
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['prologue']} | {r['rows']} | {tuple(r['config'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--kernels", default="gemv,rows,rows swapped,rows glu,rows swapped glu,rows norm out,"
                        "rows swapped norm out,rows norm in,rows swapped norm in,rows glu norm in,rows swapped glu norm in,"
                        "tree chunk,attention split")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--arch", type=int, default=90, choices=sorted(ARCHS),
                        help="compile for sm<arch> (90: H100/H200; 120: the RTX PRO 6000 Blackwell)")
    parser.add_argument("--budget-of", type=int, choices=sorted(ARCHS),
                        help="cut the few-rows kernel's stages to this architecture's shared memory a block (default: "
                             "--arch's, as a launch there cuts them; 90 with --arch 120: Hopper's cuts on a Blackwell)")
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    from tqdm import tqdm

    from ddtree.models import attention_kernel as a
    from ddtree.models import gemv_kernel as g
    from ddtree.models import tree_kernel as t

    arch, budget_arch = args.arch, args.budget_of or args.arch
    name = args.name or f"kernel_resources_sm{arch}"
    block_limit = ARCHS[arch]["sm_shared"] - SHARED_RESERVED
    forms, kernels = args.forms.split(","), args.kernels.split(",")
    todo = [c for c in cases(budget_arch) if c["kernel"] in kernels]
    results = []
    for case in tqdm(todo, desc=f"compiling for sm{arch}"):
        kernel = {"gemv": g._gemv_kernel, "tree chunk": t._chunk_kernel, "attention split": a._split_kernel}.get(
            case["kernel"], g._rows_kernel)
        pointers = POINTERS.get(case["kernel"])
        entry = {k: v for k, v in case.items() if k != "constexprs"} | {"forms": {}}
        for form in forms:
            peel, pdl = FORMS[form]
            # the others have no peeled form: PDL's wait alone (their own form's is the loop's resources)
            extra = {"PEEL": peel, "PDL": pdl} if pointers is None else {"PDL": pdl}
            try:
                found = compile_resources(kernel, {**case["constexprs"], **extra}, case["warps"], case["stages"], arch,
                                          pointers)
                found["occupancy"] = programs_per_sm(found["shared"], found["registers"], case["warps"], arch)
                found["fits_a_block"] = found["shared"] <= block_limit
            except Exception as e:   # one configuration that does not compile is a row of the table, not the end of the run
                found = {"error": f"{type(e).__name__}: {e}"}
            entry["forms"][form] = found
        results.append(entry)
    a = ARCHS[arch]
    too_big = sorted({f"{r['kernel']} {r['shape']}" for r in results for f in r["forms"].values() if not f.get("fits_a_block", True)})
    text = (f"Compiled offline for sm{arch} (Triton's compiler and ptxas -v, no GPU), the few-rows kernel's stages cut to "
            f"sm{budget_arch}'s shared memory a block; an SM's programs: the fewest its shared memory "
            f"({a['sm_shared'] // 1024} KB, {SHARED_RESERVED} bytes reserved a program), registers ({SM_REGISTERS}), "
            f"threads ({a['sm_threads']}) and its cap ({a['sm_programs']}) allow; 0 where a program takes more shared "
            f"memory than a block may ({block_limit // 1024} KB): it does not launch.\n\n"
            f"Programs over a block's shared memory: {', '.join(too_big) if too_big else 'none'}.\n\n" + table(results, forms))
    write_results(Path(args.out), name, {"header": header(), "arch": arch, "budget_arch": budget_arch,
                                         "block_shared_limit": block_limit, "forms": forms, "cases": results,
                                         "over_block_limit": too_big}, text)


if __name__ == "__main__":
    main()
