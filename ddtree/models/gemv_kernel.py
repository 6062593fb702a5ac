"""One row times a weight matrix on the GPU (Triton): the decode step's matrix-vector products, each with the small
elementwise chain before it done in its prologue.

At batch 1 a decode step is weight streaming: each Linear reads its whole weight once for one row of input. cuBLAS
picks GEMM kernels for these (nvjet on the H200) that stream at 3.1-4.2 TB/s; this kernel streams them at 3.7-4.6
(a 27B step's Linears 12.08 ms against 13.02, the floor at copy bandwidth 12.09: perf/results/gemv_h200.md). Each
program owns BLOCK_N output columns, walks the reduction dimension in BLOCK_K steps, multiplies in float32 and
rounds once (as cuBLAS does for bf16). The launch configuration is chosen per weight shape from those measurements
(CONFIGS).

Every program also computes the Linear's input from what the layer had before it (PROLOGUES), so the chain's own
kernel (and its write and read of the input) goes away; the input is a few KB, read from L2 by each program:
- "norm": rmsnorm(x) * p, p the float32 scale of Qwen3.5's zero-centered norm (1 + weight);
- "norm_plain": rmsnorm(x) rounded, times the weight p (Qwen3's RMSNorm);
- "silu_mul": silu(x) * a (a gated MLP's gate and up);
- "sigmoid_gate": x * sigmoid(a), a [groups, group] with its own group stride (gated attention's output gate);
- "gated_norm": per group of `group` columns rmsnorm(x) * p (p [group]), times silu(a) (Gated DeltaNet's output).
Each rounds where the eager chain (ddtree.models.fused) rounds to the model's dtype, so a bf16 forward through
them reads the inputs the unfused forward computes; except the norms by default (norm_first() False): their
rstd, one number per row, is applied to the product's sum instead of to each input, so the statistic is
gathered in the product's own loop rather than in a pass before it, and the normalized input is never rounded (a
bf16 ulp of the input's scale).
And `add` adds the residual stream to the product in the epilogue (rounded as `add + F.linear(...)`), so a layer's
residual add needs no kernel either: the next norm's prologue reads the stream whole.

    linear_rows(x, weight)                                   # x [1, K], weight [N, K] -> [1, N] in x's dtype
    linear_rows(x, weight, prologue="silu_mul", a=up, add=residual)
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from ddtree.models.grid_wait import wait_for_previous_grid
from ddtree.models.kernels import pdl

# (BLOCK_N, BLOCK_K, num_warps, num_stages) by (N, K, prologue), the best measured on the H200 for the 27B shapes
# (perf/results/gemv_h200.md, gemv_h200_prologues_partial.log); others use (N, K, None)'s, else DEFAULT (within 2% of the
# best plain configuration on every 27B shape)
DEFAULT = (8, 512, 4, 3)
CONFIGS: dict[tuple[int, int, str | None], tuple[int, int, int, int]] = {
    (5120, 6144, None): (8, 512, 8, 3), (16480, 5120, None): (32, 512, 4, 3), (5120, 17408, None): (8, 512, 8, 4),
    (34816, 5120, None): (32, 256, 8, 3), (14336, 5120, None): (16, 256, 4, 3), (248320, 5120, None): (8, 1024, 8, 3),
    (5120, 6144, "gated_norm"): (16, 512, 4, 3), (5120, 6144, "sigmoid_gate"): (8, 512, 8, 3),
    (16480, 5120, "norm"): (32, 512, 4, 3), (34816, 5120, "norm"): (32, 256, 8, 4),
    (14336, 5120, "norm"): (32, 512, 4, 4), (5120, 17408, "silu_mul"): (8, 512, 4, 3),
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the few-rows kernel by (N, K), the best measured on the H200 for 16 rows
# of the 27B shapes (perf/results/gemv_rows_h200_4_16.md: the step's products 12.86 ms against cuBLASLt's 13.56 at 16
# rows, 12.66 against 13.46 at 4); others ROWS_DEFAULT
ROWS_DEFAULT = (64, 128, 4, 4)
ROWS_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (5120, 6144): (64, 256, 4, 4), (5120, 17408): (64, 256, 4, 4), (34816, 5120): (32, 256, 4, 4),
    (14336, 5120): (128, 128, 4, 4), (248320, 5120): (128, 128, 4, 4)}
# the same for its swapped form (SWAP: the weight's columns the tile's long side), the best measured on the H200 for
# 17 rows (programs of 32) of the 27B shapes (perf/results/gemv_rows_h200_17.md: the step's products 13.14 ms against
# cuBLASLt's 13.26 and the rows-first form's 13.73)
SWAP_DEFAULT = (64, 128, 4, 4)
SWAP_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (5120, 6144): (64, 128, 4, 4), (16480, 5120): (64, 128, 4, 4), (5120, 17408): (64, 128, 4, 4),
    (34816, 5120): (64, 64, 4, 3), (14336, 5120): (128, 128, 4, 4), (248320, 5120): (128, 128, 4, 4)}
SHARED_BYTES = 160 * 1024   # shared memory a few-rows program's pipeline may take (the H200 has 227 KB a block)
SHARED_SPARE = 4 * 1024     # kept free of the pipeline below a device's own limit a block (shared_budget)
MAX_ROWS = 128   # the most rows linear_rows takes (one program holds them all: rows_block)
NORM_ELEMENTS = 8192   # the norms' first pass loads up to this many elements of x at once (a 27B row: one load)
NORM_PARTS_BLOCK = 64   # partial sums of squares a step of _rows_kernel's NORM_IN loop reads (per row)
PROLOGUES = {None: 0, "norm": 1, "norm_plain": 2, "silu_mul": 3, "sigmoid_gate": 4, "gated_norm": 5}


def norm_first() -> bool:
    """Whether the norms' prologue computes each row's statistic in a pass of its own before the product
    (DDTREE_GEMV_NORM_FIRST=1: the normalized input rounded to the model's dtype, as the eager chain rounds it) or,
    the default, in the product's own loop (x * p multiplied unrounded and the row's rstd applied to the sum, so no
    program waits on a pass over x before streaming its weights). On the H200 the default made the 27B `ar` step's
    GEMVs 0.35 ms shorter (12.70 vs 13.04 ms of device time: perf/results/gpu_ratios_h200_optin.md)."""
    return os.environ.get("DDTREE_GEMV_NORM_FIRST", "0") not in ("", "0")


def peel_first(swapped: bool = False) -> bool:
    """Whether a PDL launch (kernels.pdl) loads the weight's first tile before its wait (the step peeled off the loop)
    or waits first and keeps the one loop: the GEMV and the rows-first few-rows kernel peel, the swapped form does not
    (DDTREE_PDL_PEEL=0: none peels; =all: every form). On an H100 at 27B dims with every form peeled, PDL made the
    `ar` round 0.986x and `dflash`'s 0.967x, but `ddtree-16`'s 1.075x (perf/results/gpu_ratios_h100_pdl.md), whose 17
    rows go through the swapped form: there the peeled tile is a pipeline buffer more, 96 -> 120 KB of shared memory
    on the 27B shapes, one program an SM where the loop holds two (perf/results/kernel_resources_sm90.md, compiled
    offline); the rows-first form and the GEMV keep theirs."""
    env = os.environ.get("DDTREE_PDL_PEEL", "1")
    return env == "all" or (env not in ("", "0") and not swapped)


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def _weight_tile(w_ptr, offs_n, n_ok, stride_wn, k, K):
    """The weight's [BLOCK_N, BLOCK_K] tile at columns k (zeros past N and K)."""
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _gemv_step(acc, squares, w_first, k0, x_rows, a_rows, p_ptr, w_ptr, offs_n, n_ok, stride_wn, offs_k, m_ok, K,
               stride_ag, rstd, eps, dtype, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
               GROUP: tl.constexpr, NORM_FIRST: tl.constexpr, FIRST: tl.constexpr):
    """One BLOCK_K step of _gemv_kernel's loop from k0: the prologue's input tile times the weight's, into acc (and
    the norms' squares): (acc, squares). FIRST: the weight's tile is w_first, loaded already (the peeled first step)."""
    k = k0 + offs_k
    k_ok = k < K
    ok = m_ok[:, None] & k_ok[None, :]
    v = tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)       # [BLOCK_M, BLOCK_K]
    if (PRO == 1 or PRO == 2) and not NORM_FIRST:   # x * p now, times the row's rstd after the sum
        squares += v * v
        v = v * tl.load(p_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    elif PRO == 1 or PRO == 2:
        p = tl.load(p_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if PRO == 1:
            v = (v * rstd * p).to(dtype).to(tl.float32)
        else:
            v = ((v * rstd).to(dtype).to(tl.float32) * p).to(dtype).to(tl.float32)
    elif PRO == 3:
        u = tl.load(a_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
        v = (_silu(v).to(dtype).to(tl.float32) * u).to(dtype).to(tl.float32)
    elif PRO == 4:
        g = tl.load(a_rows + ((k // GROUP) * stride_ag + k % GROUP)[None, :], mask=ok, other=0.0).to(tl.float32)
        v = (v * tl.sigmoid(g).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    elif PRO == 5:   # BLOCK_K is a multiple of GROUP: each step holds whole groups
        z = tl.load(a_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
        v3 = tl.reshape(v, [BLOCK_M, BLOCK_K // GROUP, GROUP])
        r = 1.0 / tl.sqrt(tl.sum(v3 * v3, axis=2, keep_dims=True) / GROUP + eps)
        v = tl.reshape((v3 * r).to(dtype).to(tl.float32), [BLOCK_M, BLOCK_K])
        p = tl.load(p_ptr + k % GROUP).to(tl.float32)[None, :]
        v = ((v * p).to(dtype).to(tl.float32) * _silu(z)).to(dtype).to(tl.float32)
    if FIRST:
        w = w_first
    else:
        w = _weight_tile(w_ptr, offs_n, n_ok, stride_wn, k, K)
    acc += w.to(tl.float32) * v
    return acc, squares


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 a_ptr, stride_am, stride_ag, p_ptr, add_ptr, stride_addm, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
                 ADD: tl.constexpr, GROUP: tl.constexpr, NORM_K: tl.constexpr, NORM_FIRST: tl.constexpr,
                 PEEL: tl.constexpr, PDL: tl.constexpr):
    """out[1, N] = prologue(x, a, p)[1, K] @ w[N, K].T: the row (BLOCK_M 1, kept two-dimensional) multiplied
    elementwise into a [BLOCK_N, BLOCK_K] accumulator summed at the end. PEEL: the weight's first tile loaded before
    anything else and its step taken out of the loop; PDL: the wait for the grid before (kernels.pdl), after that load
    where PEEL, else first."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if PEEL:   # the weight is read-only: its first tile may stream in while the kernel before finishes
        w_first = _weight_tile(w_ptr, offs_n, n_ok, stride_wn, offs_k, K)
    wait_for_previous_grid(PDL)   # after the early tile where PEEL, else before any load
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    a_rows = a_ptr + offs_m[:, None] * stride_am
    rstd = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if (PRO == 1 or PRO == 2) and NORM_FIRST:   # the norm's statistic over each whole row first (one load at a row's usual widths)
        sq = tl.zeros([BLOCK_M, NORM_K], dtype=tl.float32)
        for k0 in range(0, K, NORM_K):
            k = k0 + tl.arange(0, NORM_K)
            s = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            sq += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1, keep_dims=True) / K + eps)
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)   # the statistic gathered in the main loop instead
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PEEL:
        acc, squares = _gemv_step(acc, squares, w_first, 0, x_rows, a_rows, p_ptr, w_ptr, offs_n, n_ok, stride_wn, offs_k,
                                  m_ok, K, stride_ag, rstd, eps, dtype, BLOCK_M, BLOCK_K, PRO, GROUP, NORM_FIRST, True)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            acc, squares = _gemv_step(acc, squares, acc, k0, x_rows, a_rows, p_ptr, w_ptr, offs_n, n_ok, stride_wn,
                                      offs_k, m_ok, K, stride_ag, rstd, eps, dtype, BLOCK_M, BLOCK_K, PRO, GROUP,
                                      NORM_FIRST, False)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, squares = _gemv_step(acc, squares, acc, k0, x_rows, a_rows, p_ptr, w_ptr, offs_n, n_ok, stride_wn,
                                      offs_k, m_ok, K, stride_ag, rstd, eps, dtype, BLOCK_M, BLOCK_K, PRO, GROUP,
                                      NORM_FIRST, False)
    y = tl.sum(acc, axis=1)
    if (PRO == 1 or PRO == 2) and not NORM_FIRST:   # rstd is one number per row: out of the sum, applied once
        y = y / tl.sqrt(tl.sum(squares) / K + eps)
    if ADD:   # the residual stream plus the product rounded, as `add + F.linear(...)` rounds
        y = tl.load(add_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) + y.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(dtype), mask=n_ok)


@triton.jit
def _rows_step(acc, w_first, k0, x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, offs_k, K, stride_xm, stride_wn,
               IEEE: tl.constexpr, SWAP: tl.constexpr, FIRST: tl.constexpr):
    """One BLOCK_K step of _rows_kernel's loop from k0 into acc ([BLOCK_N, BLOCK_M] with SWAP, else [BLOCK_M,
    BLOCK_N]). FIRST: the weight's tile is w_first, loaded already (the peeled first step)."""
    k = k0 + offs_k
    k_ok = k < K
    v = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if FIRST:
        w = w_first
    else:
        w = _weight_tile(w_ptr, offs_n, n_ok, stride_wn, k, K)
    if SWAP:
        if IEEE:
            acc = tl.dot(w.to(tl.float32), tl.trans(v.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(v), acc)
    elif IEEE:
        acc = tl.dot(v.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(v, tl.trans(w), acc)
    return acc


@triton.jit
def _rows_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, add_ptr, stride_addm,
                 y_ptr, p_ptr, parts_out_ptr, parts_in_ptr, P, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr,
                 IEEE: tl.constexpr, SWAP: tl.constexpr, GLU: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr,
                 NORM_OUT: tl.constexpr, NORM_IN: tl.constexpr, BLOCK_P: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T for a few rows (M <= BLOCK_M): each program streams its BLOCK_N columns of the
    weight once for all the rows, multiplying on the tensor cores (float32: IEEE products, no TF32). SWAP: the
    product taken as (w @ x.T).T, the weight's columns the tile's long side and the rows its short one (as cuBLAS
    tiles skinny products: 384x24 for 17 rows), instead of the rows as the tile's first dimension. GLU: w
    is a gated MLP's gate and up side by side ([2N, K]) and out [M, N] = silu(x @ gate.T) * (x @ up.T), rounded as
    fused.silu_mul rounds: each program's tile holds BLOCK_N // 2 columns of each, interleaved (linear_rows' glu).
    PEEL, PDL: as _gemv_kernel's. NORM_OUT (a product whose output is the residual stream h that a zero-centered
    RMSNorm reads next): also y = h * p (p [N] float32, the norm's scale) rounded, and each row's sum of h^2 over
    this program's columns into parts_out [programs, M] float32 (norm_parts). NORM_IN (a product over such a y,
    x = y): each row's product times 1 / rms(h), h's squares summed from parts_in ([P, M]) in a fixed order, before
    the epilogue (the norm applied after the product instead of on its input: norm_parts)."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if GLU:   # the tile's column c is gate row j or up row N + j, j = pid * BLOCK_N // 2 + c // 2, by c's parity
        c = tl.arange(0, BLOCK_N)
        n_ok = pid * (BLOCK_N // 2) + c // 2 < N
        offs_n = (c % 2) * N + pid * (BLOCK_N // 2) + c // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PEEL:   # the weight's first tile before the wait (PDL)
        w_first = _weight_tile(w_ptr, offs_n, n_ok, stride_wn, offs_k, K)
    if NORM_OUT:   # the next norm's scale (a weight: before the wait too) for the epilogue
        scale = tl.load(p_ptr + offs_n, mask=n_ok, other=0.0)
    wait_for_previous_grid(PDL)   # after the early tile where PEEL, else before any load
    if NORM_IN:   # 1 / rms(h) of each row from the product before's partial sums of squares, in program order: read
        # before the loop, so that their latency hides under the weight's first tiles rather than lengthen the tail
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        offs_p = tl.arange(0, BLOCK_P)
        for p0 in range(0, P, BLOCK_P):
            part = tl.load(parts_in_ptr + (p0 + offs_p)[:, None] * M + offs_m[None, :],
                           mask=((p0 + offs_p) < P)[:, None] & m_ok[None, :], other=0.0)
            squares += tl.sum(part, 0)
        inv_rms = 1.0 / tl.sqrt(squares / K + eps)
    if PEEL:   # the first tile's step out of the loop
        acc = _rows_step(acc, w_first, 0, x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, offs_k, K, stride_xm, stride_wn,
                         IEEE, SWAP, True)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            acc = _rows_step(acc, acc, k0, x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, offs_k, K, stride_xm, stride_wn,
                             IEEE, SWAP, False)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc = _rows_step(acc, acc, k0, x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, offs_k, K, stride_xm, stride_wn,
                             IEEE, SWAP, False)
    if SWAP:
        acc = tl.trans(acc)
    if NORM_IN:
        acc = acc * inv_rms[:, None]
    if GLU:   # gate and up each rounded as the product's output, silu rounded, the product rounded (fused.silu_mul)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        acc = _silu(gate.to(dtype).to(tl.float32)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_ok = offs_n < N
    out_ok = m_ok[:, None] & n_ok[None, :]
    if ADD:   # the residual stream plus the product rounded, as `add + F.linear(...)` rounds
        acc = (tl.load(add_ptr + offs_m[:, None] * stride_addm + offs_n[None, :], mask=out_ok, other=0.0).to(tl.float32)
               + acc.to(dtype).to(tl.float32))
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(dtype), mask=out_ok)
    if NORM_OUT:   # the next norm's input scaled (rounded as the product's output is) and this tile's squares of h
        h = acc.to(dtype).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], (h * scale[None, :]).to(dtype), mask=out_ok)
        tl.store(parts_out_ptr + pid * M + offs_m, tl.sum(tl.where(out_ok, h * h, 0.0), 1), mask=m_ok)


@functools.cache
def tuned_configs(spec: str) -> dict[tuple[int, int, bool, int], tuple[int, int, int, int]]:
    """The few-rows configurations a perf/gemv_bench.py result chose, by (N, K, swapped, rows_block(rows)):
    DDTREE_GEMV_TUNED=<its json>:<rows> (a benchmark's run measuring a search's choices before they are written into
    ROWS_CONFIGS or SWAP_CONFIGS; only for programs of that many rows); empty when unset."""
    if not spec:
        return {}
    path, rows = spec.rsplit(":", 1)
    with open(path) as f:
        shapes = json.load(f)["shapes"][rows]
    out = {}
    for key, entry in shapes.items():
        n, k = (int(d) for d in key.split(" ", 1)[0].split("x"))
        for variant, swapped in (("plain", False), ("swap", True)):
            if variant in entry:
                out.setdefault((n, k, swapped, rows_block(int(rows))), tuple(entry[variant]["config"]))
    return out


def swap_ab(block_m: int) -> bool:
    """Whether the few-rows kernel's program of block_m rows takes its product as (w @ x.T).T (_rows_kernel's SWAP).
    By default programs of 32 rows (17 to 32: a budget-16 tree's 17; more reach the kernel only with DDTREE_GEMV_ROWS
    above its default 17: kernels.gemv_max_rows): on the H200 the 27B step's products at 17 rows took 13.14 ms that way
    against 13.73 rows first and cuBLASLt's 13.26 (perf/results/gemv_rows_h200_17.md); inside the engine's budget-16
    verify they first tied cuBLAS (15.20 against 15.23 ms of device time: gpu_ratios_h200_swap17.md), then made its
    whole round 0.981x in 3 turns (gpu_ratios_h200_rowpro.md). At 16 rows
    the rows-first form was as fast (12.83 against 12.91, two runs: gemv_rows_h200_extra.md, gemv_rows_h200_swap.md)
    and at 65 the swapped one lost to cuBLAS (19.48 against 13.86). DDTREE_GEMV_SWAP=1 swaps every program, 0 none."""
    env = os.environ.get("DDTREE_GEMV_SWAP", "")
    return block_m == 32 if env == "" else env != "0"


def rows_block(m: int) -> int:
    """The rows a program of the few-rows kernel holds (tl.dot's smallest tile is 16)."""
    return max(16, triton.next_power_of_2(m))


@functools.cache
def shared_budget(device: torch.device) -> int:
    """Shared memory a few-rows program's pipeline may take on this device: SHARED_BYTES, or less on a device that
    gives a block less (its opt-in limit less SHARED_SPARE). Hopper gives 227 KB; an RTX PRO 6000 Blackwell (sm_120)
    99 KB, where the H200's configurations (up to 160 KB: perf/results/kernel_resources_sm90.md) would not launch
    (perf/results/kernel_resources_sm120.md). Off CUDA (Triton's interpreter) SHARED_BYTES."""
    if device.type != "cuda":
        return SHARED_BYTES
    return budget_of(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def budget_of(optin: int) -> int:
    """shared_budget of a device whose blocks may opt in to `optin` bytes of shared memory."""
    return min(SHARED_BYTES, optin - SHARED_SPARE)


def fit_shared(block_m: int, block_n: int, block_k: int, stages: int, itemsize: int,
               budget: int = SHARED_BYTES) -> tuple[int, int]:
    """(BLOCK_K, stages) of a few-rows configuration cut until its pipelined tiles fit budget bytes (shared_budget):
    fewer stages first (down to 2), then shorter steps."""
    while stages * (block_m + block_n) * block_k * itemsize > budget and (stages > 2 or block_k > 32):
        if stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return block_k, stages


def rows_config(n: int, k: int, block_m: int, swap: bool, itemsize: int,
                config: tuple[int, int, int, int] | None = None, budget: int = SHARED_BYTES) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the few-rows kernel's programs of block_m rows over an [n, k] weight: the
    given config as it is, else a DDTREE_GEMV_TUNED choice or the form's table (SWAP_CONFIGS, ROWS_CONFIGS), its
    pipeline's stages cut to fit budget bytes of shared memory (fit_shared; the device's: shared_budget)."""
    if config is not None:
        return config
    block_n, block_k, warps, stages = (tuned_configs(os.environ.get("DDTREE_GEMV_TUNED", "")).get((n, k, swap, block_m))
                                       or (SWAP_CONFIGS.get((n, k), SWAP_DEFAULT) if swap
                                           else ROWS_CONFIGS.get((n, k), ROWS_DEFAULT)))
    block_k, stages = fit_shared(block_m, block_n, block_k, stages, itemsize, budget)
    return block_n, block_k, warps, stages


def gemv_config(n: int, k: int, prologue: str | None, group: int = 1,
                config: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the GEMV over an [n, k] weight with this prologue: the given config, else
    CONFIGS' for the shape and prologue, else the shape's plain one, else DEFAULT; "gated_norm" steps hold whole
    groups (BLOCK_K at least group)."""
    block_n, block_k, warps, stages = config or CONFIGS.get((n, k, prologue), CONFIGS.get((n, k, None), DEFAULT))
    return block_n, max(block_k, group) if PROLOGUES[prologue] == 5 else block_k, warps, stages


def linear_rows(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None, *,
                prologue: str | None = None, a: torch.Tensor | None = None, p: torch.Tensor | None = None,
                eps: float = 0.0, group: int = 1, add: torch.Tensor | None = None, swap: bool | None = None,
                glu: bool = False, norm_out: torch.Tensor | None = None, norm_in: torch.Tensor | None = None,
                _peel: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[add +] prologue(x, a, p) [M, K] @ weight[N, K].T -> [M, N] in x's dtype (module docstring): one row through
    the GEMV, with its prologue; a few (M <= MAX_ROWS) through the few-rows kernel, without one (a prologue's chain
    computed per program for 16 rows made the step's products 2.6x slower on the H200: perf/results/gemv_rows_h200.md);
    weight, x, a and add contiguous in their last dim (sigmoid_gate: a [1, K // group, group]). swap: the few-rows
    kernel's form (None: swap_ab's). glu (more than one row): weight is a
    gated MLP's gate and up projections side by side [2N, K], and the output silu(gate) * up [M, N], in the product's
    epilogue (_rows_kernel's GLU: the chain's kernel and the [M, 2N] product's write and read saved). Launched
    with PDL where kernels.pdl says (the first weight tile loaded before the wait, its step peeled off the loop, where
    peel_first() says); _peel (tests): the form, peeled or not, whatever PDL (None: peeled where PDL and
    peel_first()). norm_out, norm_in (more than one row; kernels.norm_parts): a zero-centered RMSNorm between two
    products taken in their epilogues. norm_out (the norm's float32 scale [N]): this product's output is the
    residual stream h the norm reads; returns (out, y = h * scale rounded, parts: each program's sums of h^2 per row).
    norm_in (those parts): x is such a y, and each row's product is divided by rms(h) (eps the norm's)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1, (x.shape, x.stride())
    assert m == 1 or prologue is None, "the few-rows kernel takes no prologue"
    assert not glu or (m > 1 and add is None and weight.shape[0] == 2 * n), "glu: rows > 1, no add"
    if add is not None:
        assert add.shape == (m, n) and add.stride(-1) == 1, (add.shape, add.stride())
    assert m > 1 or (norm_out is None and norm_in is None), "norm_out, norm_in: the few-rows kernel's"
    assert norm_out is None or (not glu and norm_out.shape == (n,) and norm_out.dtype == torch.float32), "norm_out"
    assert norm_in is None or (norm_in.dtype == torch.float32 and norm_in.shape[1] == m), "norm_in"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    use_pdl = pdl(x.device)
    if m > 1:
        block_m = rows_block(m)
        swap = swap_ab(block_m) if swap is None else swap
        block_n, block_k, warps, stages = rows_config(weight.shape[0], k, block_m, swap, x.element_size(), config,
                                                      shared_budget(x.device))
        peel = (use_pdl and peel_first(swap)) if _peel is None else _peel
        programs = triton.cdiv(n, block_n // 2 if glu else block_n)
        y, parts = out, out
        if norm_out is not None:
            y = torch.empty_like(out)
            parts = torch.empty(programs, m, device=x.device, dtype=torch.float32)
        _rows_kernel[(programs,)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), x if add is None else add,
            0 if add is None else add.stride(0), y, out if norm_out is None else norm_out, parts,
            out if norm_in is None else norm_in, 0 if norm_in is None else norm_in.shape[0], eps,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ADD=add is not None, IEEE=weight.dtype == torch.float32,
            SWAP=swap, GLU=glu, PEEL=peel, PDL=use_pdl, NORM_OUT=norm_out is not None, NORM_IN=norm_in is not None,
            BLOCK_P=NORM_PARTS_BLOCK, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
        return out if norm_out is None else (out, y, parts)
    mode = PROLOGUES[prologue]
    peel = (use_pdl and peel_first()) if _peel is None else _peel
    if mode == 5:
        assert k % group == 0 and group & (group - 1) == 0, (k, group)
    block_n, block_k, warps, stages = gemv_config(n, k, prologue, group, config)
    if a is not None:
        assert a.shape[0] == m and a.stride(-1) == 1, (a.shape, a.stride())
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        x if a is None else a, 0 if a is None else a.stride(0), a.stride(1) if mode == 4 else 0,
        x if p is None else p, x if add is None else add, 0 if add is None else add.stride(0), eps,
        BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, PRO=mode, ADD=add is not None, GROUP=group,
        NORM_K=min(triton.next_power_of_2(k), max(block_k, NORM_ELEMENTS)), NORM_FIRST=norm_first(), PEEL=peel,
        PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return out
