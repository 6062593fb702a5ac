"""A few rows times a weight matrix on the GPU (Triton): the decode step's matrix-vector products.

At batch 1 a decode step is weight streaming: each Linear reads its whole weight once for one row of input. cuBLAS
picks a GEMM kernel for these (nvjet on the H200) that streams at ~4.0 TB/s on the big projections and ~3.4 TB/s on
the 6144 x 5120 output projections (perf/results/gpu_ratios_h200_draftkernel.md). This kernel is the plain form:
each program owns BLOCK_N output columns, walks the reduction dimension in BLOCK_K steps, multiplies in float32
and rounds once (as cuBLAS does for bf16); the launch configuration is chosen per weight shape by
perf/gemv_bench.py's measurements (CONFIGS).

    linear_rows(x, weight)   # x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4

# (BLOCK_N, BLOCK_K, num_warps, num_stages) by (N, K); others use DEFAULT
DEFAULT = (8, 512, 4, 3)
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    for m in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N], M <= MAX_ROWS; weight contiguous in K."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    block_n, block_k, warps, stages = config or CONFIGS.get((n, k), DEFAULT)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
                                              ROWS=m, BLOCK_N=block_n, BLOCK_K=block_k,
                                              num_warps=warps, num_stages=stages)
    return out
