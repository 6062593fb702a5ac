"""The device tree build (ddtree.tree.device.build_tree_device) in one Triton program.

build_tree_device is ~6 small kernels a depth (a gather, an add, a sort, three slice copies) and a final sort: ~100
launches inside the tree's static program, whose ~0.4 ms on the H200 cost more than the host handover it removes
(perf/results/gpu_ratios_h200_devtree_f32.md). Here one program of one block does the same steps in order, each
depth's candidates sorted in registers (tl.sort) and handed to the next depth through a small scratch in global
memory (a barrier between a step's writes and the next step's reads):

- per depth d: the candidates (parent slot i, rank r) of the grid (candidate_grid), score prev[i] + log_probs[d, r],
  sorted descending, ties in grid order (torch.sort's stable order); the first `width` are the depth's prefixes;
- then every depth's `width` scores, sorted the same way, ties in depth-major order; the first `width` are the tree.

A sort key is the score's order-preserving 32 bits above the position's complement, so one integer sort is a
stable descending sort by score. The arithmetic is build_tree_device's (float32 sums in the same order), so the two
give the same tree, ties included (tests/unit/test_device_tree.py). -0.0 scores count as 0.0.

A second program (tree_inputs_kernel) writes what the verify reads from that tree: verify_rows' ids, positions and
parents and, for the paths form, tree_paths_device's paths; tree_program runs both (graphs.StaticTreeBuild's body
on CUDA; DDTREE_TREE_BUILD_KERNEL=0: the tensor forms instead).

Imported only where it runs (CUDA, or Triton's interpreter in a test).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.models.grid_wait import wait_for_previous_grid
from ddtree.models.kernels import pdl

INDEX_BITS = 20   # a candidate's position in the key's low bits: grids and depth x width up to 2**20 entries


@triton.jit
def _sort_key(score, index, INDEX_BITS: tl.constexpr):
    """int64 keys whose descending order is score descending, then index ascending."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)   # + 0.0: -0.0 counts as 0.0
    wide = bits.to(tl.int64)
    ordered = tl.where(bits >= 0, wide + 2147483648, (~bits).to(tl.int64))   # order-preserving, in [0, 2**32)
    return (ordered << INDEX_BITS) | ((1 << INDEX_BITS) - 1 - index.to(tl.int64))


@triton.jit
def _tree_build_kernel(lp_ptr, ids_ptr, slot_ptr, rank_ptr, cand_ptr, sorted_ptr, score_ptr, slots_ptr, ranks_ptr,
                       node_ptr, tokens_ptr, parents_ptr, depths_ptr, depth_limit, k, grid_size,
                       WIDTH: tl.constexpr, W_P: tl.constexpr, G_P: tl.constexpr, DW_P: tl.constexpr,
                       INDEX_BITS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    mask_bits = (1 << INDEX_BITS) - 1
    g = tl.arange(0, G_P)
    g_ok = g < grid_size
    slot = tl.load(slot_ptr + g, mask=g_ok, other=0)
    rank = tl.load(rank_ptr + g, mask=g_ok, other=0)
    w = tl.arange(0, W_P)
    w_ok = w < WIDTH
    # score row 0: the root (slot 0 at 0.0, the others -inf); row d + 1: depth d's prefixes
    tl.store(score_ptr + w, tl.where(w == 0, 0.0, float("-inf")), mask=w_ok)
    tl.debug_barrier()
    for d in range(depth_limit):
        prev = tl.load(score_ptr + d * WIDTH + slot, mask=g_ok, other=float("-inf"))
        lp = tl.load(lp_ptr + d * k + rank, mask=g_ok, other=float("-inf"))
        cand = tl.where(g_ok, prev + lp, float("-inf"))
        tl.store(cand_ptr + g, cand)
        tl.store(sorted_ptr + g, tl.sort(_sort_key(cand, g, INDEX_BITS), descending=True))
        tl.debug_barrier()
        pick = (mask_bits - (tl.load(sorted_ptr + w, mask=w_ok, other=0) & mask_bits)).to(tl.int32)
        row = (d + 1) * WIDTH + w
        tl.store(score_ptr + row, tl.load(cand_ptr + pick, mask=w_ok, other=float("-inf")), mask=w_ok)
        tl.store(slots_ptr + row, tl.load(slot_ptr + pick, mask=w_ok, other=0), mask=w_ok)
        tl.store(ranks_ptr + row, tl.load(rank_ptr + pick, mask=w_ok, other=0), mask=w_ok)
        tl.debug_barrier()
    # the tree: the best `width` prefixes of every depth, stable in depth-major order
    e = tl.arange(0, DW_P)
    e_ok = e < depth_limit * WIDTH
    scores = tl.load(score_ptr + WIDTH + e, mask=e_ok, other=float("-inf"))
    tl.store(node_ptr + e, tl.zeros([DW_P], dtype=tl.int32))
    tl.store(sorted_ptr + e, tl.sort(_sort_key(tl.where(e_ok, scores, float("-inf")), e, INDEX_BITS), descending=True))
    tl.debug_barrier()
    order = (mask_bits - (tl.load(sorted_ptr + w, mask=w_ok, other=0) & mask_bits)).to(tl.int32)   # flat (depth, slot)
    tl.store(node_ptr + order, w + 1, mask=w_ok)   # node numbers 1..width
    tl.debug_barrier()
    level = order // WIDTH
    parent_flat = (level - 1) * WIDTH + tl.load(slots_ptr + WIDTH + order, mask=w_ok, other=0)
    parent = tl.where(level == 0, 0, tl.load(node_ptr + tl.maximum(parent_flat, 0), mask=w_ok, other=0))
    rank_taken = tl.load(ranks_ptr + WIDTH + order, mask=w_ok, other=0)
    tl.store(tokens_ptr + w, tl.load(ids_ptr + level * k + rank_taken, mask=w_ok, other=0), mask=w_ok)
    tl.store(parents_ptr + w, parent.to(tl.int64), mask=w_ok)
    tl.store(depths_ptr + w, (level + 1).to(tl.int64), mask=w_ok)


@triton.jit
def _tree_inputs_kernel(inputs_ptr, tokens_ptr, parents_ptr, depths_ptr, head_ptr, paths_ptr, children_ptr, first_ptr,
                        WIDTH: tl.constexpr, R_P: tl.constexpr, NUM_PATHS: tl.constexpr, MAX_LEN: tl.constexpr,
                        TOK_P: tl.constexpr, B_P: tl.constexpr, PDL: tl.constexpr):
    """verify_rows' head [3, WIDTH + 1] and, with NUM_PATHS, tree_paths_device's (tokens, cu_seqlens, node_pos) from
    the build's tokens, parents and depths; children (zeros, [R_P]) and first ([R_P]) are scratch."""
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    rows = WIDTH + 1
    root = tl.load(inputs_ptr)
    start = tl.load(inputs_ptr + 1)
    num_nodes = tl.load(inputs_ptr + 2)
    r = tl.arange(0, R_P)
    r_ok = r < rows
    node = (r >= 1) & (r < num_nodes)
    below = tl.maximum(r - 1, 0)
    token = tl.load(tokens_ptr + below, mask=node, other=0)
    depth = tl.load(depths_ptr + below, mask=node, other=0)
    parent = tl.load(parents_ptr + below, mask=node, other=-1)
    tl.store(head_ptr + r, tl.where(r == 0, root, token), mask=r_ok)
    tl.store(head_ptr + rows + r, start + depth, mask=r_ok)
    tl.store(head_ptr + 2 * rows + r, parent, mask=r_ok)
    if NUM_PATHS > 0:
        num_tokens = NUM_PATHS * MAX_LEN
        valid = r < num_nodes
        has_parent = valid & (parent >= 0)
        tl.atomic_add(children_ptr + tl.maximum(parent, 0), tl.full([R_P], 1, tl.int32), mask=has_parent)
        tl.store(first_ptr + r, tl.full([R_P], num_tokens, tl.int32))
        t = tl.arange(0, TOK_P)
        tl.store(paths_ptr + t, tl.zeros([TOK_P], dtype=tl.int64), mask=t < num_tokens)
        tl.debug_barrier()
        leaf = valid & (tl.load(children_ptr + r) == 0)
        length = tl.where(leaf, depth + 1, 0)
        end = tl.cumsum(length, axis=0)
        begin = end - length
        total = tl.sum(length, axis=0)
        b = tl.arange(0, B_P)   # cu_seqlens: 0, each leaf's end in leaf order, the total for the padding paths
        tl.store(paths_ptr + num_tokens + b, tl.where(b == 0, 0, total), mask=b <= NUM_PATHS)
        tl.debug_barrier()
        ordinal = tl.cumsum(leaf.to(tl.int32), axis=0)
        tl.store(paths_ptr + num_tokens + ordinal, end, mask=leaf & (ordinal <= NUM_PATHS))
        # each leaf's path, root first: node a (the leaf, then its ancestors) at begin + depth(a)
        a = tl.where(leaf, r, -1)
        for _ in range(MAX_LEN):
            on = a >= 0
            d = tl.load(depths_ptr + tl.maximum(a - 1, 0), mask=on & (a >= 1), other=0)
            tl.store(paths_ptr + begin + d, a.to(tl.int64), mask=on)
            tl.atomic_min(first_ptr + tl.maximum(a, 0), begin.to(tl.int32), mask=on)
            up = tl.load(parents_ptr + tl.maximum(a - 1, 0), mask=on & (a >= 1), other=-1).to(tl.int32)
            a = tl.where(on & (a >= 1), up, -1)
        tl.debug_barrier()
        first = tl.load(first_ptr + r)
        tl.store(paths_ptr + num_tokens + NUM_PATHS + 1 + r, tl.where(valid, first + depth, 0).to(tl.int64), mask=r_ok)
        tl.store(children_ptr + r, tl.zeros([R_P], dtype=tl.int32))   # clean for the next call


class TreeBuildScratch:
    """The kernel's scratch and outputs for one (depth limit, width, grid) shape, made before a static program's
    capture (no allocation inside it)."""

    def __init__(self, depth_limit: int, width: int, grid_size: int, device: torch.device) -> None:
        self.g_p, self.w_p = triton.next_power_of_2(grid_size), triton.next_power_of_2(width)
        self.dw_p = triton.next_power_of_2(depth_limit * width)
        assert max(self.g_p, self.dw_p) <= 2**INDEX_BITS, (grid_size, depth_limit, width)
        sort = max(self.g_p, self.dw_p)
        self.cand = torch.empty(self.g_p, dtype=torch.float32, device=device)
        self.sorted = torch.empty(sort, dtype=torch.int64, device=device)
        self.scores = torch.empty((depth_limit + 1) * width, dtype=torch.float32, device=device)
        self.slots = torch.empty((depth_limit + 1) * width, dtype=torch.int32, device=device)
        self.ranks = torch.empty((depth_limit + 1) * width, dtype=torch.int32, device=device)
        self.node = torch.empty(self.dw_p, dtype=torch.int32, device=device)
        self.tokens, self.parents, self.depths = (torch.empty(width, dtype=torch.long, device=device) for _ in range(3))
        self.r_p = triton.next_power_of_2(width + 1)
        self.children = torch.zeros(self.r_p, dtype=torch.int32, device=device)
        self.first = torch.empty(self.r_p, dtype=torch.int32, device=device)


def build_tree_kernel(log_probs: torch.Tensor, token_ids: torch.Tensor, width: int,
                      grid: tuple[torch.Tensor, torch.Tensor], scratch: TreeBuildScratch | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """build_tree_device's (tokens, parents, depths)  # [width] long each, in one program. log_probs float32 and
    token_ids long, both [depth, k] and contiguous; grid: candidate_grid(width, k) on their device; scratch: a
    TreeBuildScratch of this shape (made here if None). The outputs are the scratch's (a later call overwrites them)."""
    depth_limit, k = log_probs.shape
    assert log_probs.dtype == torch.float32 and log_probs.is_contiguous() and token_ids.is_contiguous()
    slot_of, rank_of = grid
    if scratch is None:
        scratch = TreeBuildScratch(depth_limit, width, slot_of.shape[0], log_probs.device)
    s = scratch
    use_pdl = pdl(log_probs.device)
    _tree_build_kernel[(1,)](
        log_probs, token_ids, slot_of, rank_of, s.cand, s.sorted, s.scores, s.slots, s.ranks, s.node,
        s.tokens, s.parents, s.depths, depth_limit, k, slot_of.shape[0],
        WIDTH=width, W_P=s.w_p, G_P=s.g_p, DW_P=s.dw_p, INDEX_BITS=INDEX_BITS, PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl)
    return s.tokens, s.parents, s.depths


def tree_inputs_kernel(inputs: torch.Tensor, scratch: TreeBuildScratch, num_paths: int, max_len: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """verify_rows' head  # [3, width + 1] and tree_paths_device's paths (None without num_paths) from the tree that
    build_tree_kernel left in scratch; inputs  # [3] long on the device: root, start, num_nodes. Outputs are new
    tensors (a static program's body allocates them from its graph's pool)."""
    s = scratch
    width = s.tokens.shape[0]
    head = torch.empty(3, width + 1, dtype=torch.long, device=inputs.device)
    paths = (torch.empty(num_paths * max_len + num_paths + 1 + width + 1, dtype=torch.long, device=inputs.device)
             if num_paths else head)
    use_pdl = pdl(inputs.device)
    _tree_inputs_kernel[(1,)](inputs, s.tokens, s.parents, s.depths, head, paths, s.children, s.first,
                              WIDTH=width, R_P=s.r_p, NUM_PATHS=num_paths, MAX_LEN=max_len,
                              TOK_P=triton.next_power_of_2(max(num_paths * max_len, 1)),
                              B_P=triton.next_power_of_2(num_paths + 1), PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    return head, paths if num_paths else None


def tree_program(log_probs: torch.Tensor, token_ids: torch.Tensor, width: int, grid: tuple[torch.Tensor, torch.Tensor],
                 scratch: TreeBuildScratch, inputs: torch.Tensor, num_paths: int, max_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """graphs.StaticTreeBuild's body in two launches: the tree (build_tree_kernel), then the verify's head and paths
    (tree_inputs_kernel)."""
    build_tree_kernel(log_probs, token_ids, width, grid, scratch)
    return tree_inputs_kernel(inputs, scratch, num_paths, max_len)


@triton.jit
def _draft_top_chunk_kernel(logits_ptr, stride_l, V, keys_ptr, stats_ptr, chunks, CHUNK: tl.constexpr, K: tl.constexpr,
                            INDEX_BITS: tl.constexpr, PDL: tl.constexpr):
    """One chunk of CHUNK logits of one level: its max and sum of exp(x - max), and its K best as _sort_key keys."""
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    level, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + level.to(tl.int64) * stride_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    top = level * chunks + c
    m = tl.max(x, 0)
    tl.store(stats_ptr + 2 * top, m)
    tl.store(stats_ptr + 2 * top + 1, tl.sum(tl.exp(x - m), 0))
    tl.store(keys_ptr + top * K + tl.arange(0, K), tl.topk(_sort_key(x, offs, INDEX_BITS), K))


@triton.jit
def _draft_top_merge_kernel(logits_ptr, stride_l, keys_ptr, stats_ptr, lp_ptr, pos_ptr, chunks, top,
                            C_P: tl.constexpr, K: tl.constexpr, INDEX_BITS: tl.constexpr, PDL: tl.constexpr):
    """One level: log-sum-exp over its chunks' statistics, the K best of their K best each, and the first `top` of
    them as log-probabilities (the logit, reloaded, less the log-sum-exp) and positions."""
    wait_for_previous_grid(PDL)
    level = tl.program_id(0)
    c = tl.arange(0, C_P)
    c_ok = c < chunks
    m = tl.load(stats_ptr + 2 * (level * chunks + c), mask=c_ok, other=float("-inf"))
    s = tl.load(stats_ptr + 2 * (level * chunks + c) + 1, mask=c_ok, other=0.0)
    peak = tl.max(m, 0)
    lse = peak + tl.log(tl.sum(tl.where(c_ok, s * tl.exp(m - peak), 0.0), 0))
    e = tl.arange(0, C_P * K)
    keys = tl.load(keys_ptr + level * chunks * K + e, mask=e < chunks * K, other=0)
    index = ((1 << INDEX_BITS) - 1 - (tl.topk(keys, K) & ((1 << INDEX_BITS) - 1))).to(tl.int32)
    j = tl.arange(0, K)
    take = j < top
    x = tl.load(logits_ptr + level.to(tl.int64) * stride_l + index, mask=take, other=0.0).to(tl.float32)
    tl.store(lp_ptr + level * top + j, x - lse, mask=take)
    tl.store(pos_ptr + level * top + j, index.to(tl.int64), mask=take)


DRAFT_TOP_CHUNK = 4096   # logits a program of draft_top_k's first launch reads (int64 keys: 32 a thread at 4 warps)


def draft_top_k(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(torch.log_softmax(logits, -1, dtype=float32), top) in two launches instead of ~20 (the softmax
    and torch's radix select: ~0.16 ms of an H100 for 15 levels of a 248K vocabulary): per level and chunk its max,
    sum of exponentials and best `top` (as _sort_key keys: ties to the lower position), then per level the
    log-sum-exp and the best `top` of the chunks'. logits  # [levels, V], last dim contiguous; (log-probabilities
    [levels, top] float32, positions [levels, top] long), both descending. Outputs and scratch are new tensors."""
    levels, vocab = logits.shape
    assert logits.stride(1) == 1 and 1 <= top <= vocab and vocab < 1 << INDEX_BITS, (logits.shape, top)
    k = max(2, triton.next_power_of_2(top))   # tl.topk takes no k of 1 (a dflash chain's last levels ask for 1)
    chunk = max(k, min(DRAFT_TOP_CHUNK, triton.next_power_of_2(vocab)))
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    keys = torch.empty(levels, chunks, k, dtype=torch.int64, device=device)
    stats = torch.empty(levels, chunks, 2, dtype=torch.float32, device=device)
    log_probs = torch.empty(levels, top, dtype=torch.float32, device=device)
    positions = torch.empty(levels, top, dtype=torch.long, device=device)
    use_pdl = pdl(device)
    _draft_top_chunk_kernel[(levels, chunks)](logits, logits.stride(0), vocab, keys, stats, chunks, CHUNK=chunk, K=k,
                                              INDEX_BITS=INDEX_BITS, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    _draft_top_merge_kernel[(levels,)](logits, logits.stride(0), keys, stats, log_probs, positions, chunks, top,
                                       C_P=triton.next_power_of_2(chunks), K=k, INDEX_BITS=INDEX_BITS, PDL=use_pdl,
                                       num_warps=4, launch_pdl=use_pdl)
    return log_probs, positions


__all__ = ["TreeBuildScratch", "build_tree_kernel", "draft_top_k", "tree_inputs_kernel", "tree_program"]
