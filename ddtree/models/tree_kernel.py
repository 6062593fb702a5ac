"""A Triton kernel for the tree part of the Gated DeltaNet recurrence: every root-to-leaf path of a tree from one
shared committed state, reading the nodes in place.

The paths form (ddtree.models.gdn.gdn_paths) runs fla's fused recurrent kernel over the tree's paths as varlen
sequences. That kernel reads one initial state per sequence, so the committed state is copied once per path
(3 MiB per layer at Qwen3.6-27B dims, ~10 paths for a 16-node tree: 1.5 ms of a 25 ms verify on an H200), and
each input is gathered into path order first and the outputs gathered back. This kernel takes the tree as it
is: each program walks one path for one value head and a block of value columns, starting from the single
committed state (read by every path: it stays in L2), loads each node's q/k/v/g/beta by its index and writes the
node's output at its own row. Paths that share a prefix compute it identically, so their writes agree.

Per node, as gdn.gdn_sequential (the reference it is tested against, tests/gpu/test_tree_kernel.py):
q, k l2-normalised (q also scaled by dk**-0.5), S = S * exp(g); v' = beta * (v - S^T k); S = S + k v'^T;
o = S^T q. Key head h serves value heads h * HV/H .. (h + 1) * HV/H - 1.

Imported only where it runs (CUDA, or Triton's interpreter in a test): fla's trap applies to triton too.
Off by default until measured on a GPU: DDTREE_TREE_KERNEL=1 turns it on (ddtree.models.kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.models.gdn import L2_EPS


@triton.jit
def _paths_kernel(q, k, v, g, beta, o, h0, tokens, cu_seqlens, scale, eps,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, MAX_LEN: tl.constexpr):
    i_v, i_path, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    first = tl.load(cu_seqlens + i_path)
    last = tl.load(cu_seqlens + i_path + 1)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_k, in_v = cols_k < K, cols_v < V
    state = tl.load(h0 + i_hv * K * V + cols_k[:, None] * V + cols_v[None, :],
                    mask=in_k[:, None] & in_v[None, :], other=0.0).to(tl.float32)      # [BK, BV]
    # a fixed trip count (the longest path the paths form takes), steps past the path's end masked: no loop bound
    # read from memory, and nothing loaded or stored for them
    for i in range(MAX_LEN):
        on = first + i < last
        node = tl.load(tokens + first + i, mask=on, other=0).to(tl.int64)
        b_q = tl.load(q + (node * H + i_h) * K + cols_k, mask=in_k & on, other=0.0).to(tl.float32)
        b_k = tl.load(k + (node * H + i_h) * K + cols_k, mask=in_k & on, other=0.0).to(tl.float32)
        b_v = tl.load(v + (node * HV + i_hv) * V + cols_v, mask=in_v & on, other=0.0).to(tl.float32)
        b_g = tl.load(g + node * HV + i_hv, mask=on, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + node * HV + i_hv, mask=on, other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + eps) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + eps)
        decayed = state * tl.exp(b_g)
        b_v = (b_v - tl.sum(decayed * b_k[:, None], 0)) * b_beta
        state = tl.where(on, decayed + b_k[:, None] * b_v[None, :], state)
        b_o = tl.sum(state * b_q[:, None], 0)
        tl.store(o + (node * HV + i_hv) * V + cols_v, b_o.to(o.dtype.element_ty), mask=in_v & on)


def tree_paths_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          tokens: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor,
                          max_len: int = 16) -> torch.Tensor:
    """o [N, HV, dv] in v's dtype of every tree node covered by the paths (others 0).

    q, k  # [N, H, dk] raw; v  # [N, HV, dv]; g  # [N, HV] log decay; beta  # [N, HV]; tokens  # [T] long, the node
    of each path position (paths concatenated, root first); cu_seqlens  # [S + 1] long path bounds (empty paths:
    padding); initial_state  # [HV, dk, dv], shared by every path; max_len >= the longest path (the paths form's
    PATHS_MAX_LEN).
    """
    n, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert hv % h == 0 and k.shape == q.shape and g.shape == (n, hv) and beta.shape == (n, hv), "shapes"
    o = torch.zeros_like(v)
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), 32)
    grid = (triton.cdiv(dv, block_v), cu_seqlens.shape[0] - 1, hv)
    _paths_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), o,
                        initial_state.float().contiguous(), tokens, cu_seqlens, dk**-0.5, L2_EPS,
                        H=h, HV=hv, K=dk, V=dv, BK=block_k, BV=block_v, MAX_LEN=max_len)
    return o


__all__ = ["tree_paths_recurrence"]
