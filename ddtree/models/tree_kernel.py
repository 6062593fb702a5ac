"""Triton kernels for the tree part of the Gated DeltaNet recurrence: every root-to-leaf path of one or more trees,
each path from its own request's committed state, read in place, with the nodes read and written in place.

The paths form (ddtree.models.gdn.gdn_paths) runs fla's fused recurrent kernel over the tree's paths as varlen
sequences. That kernel reads one initial state per sequence, so the committed state is copied once per path
(3 MiB per layer at Qwen3.6-27B dims, padded to the path bucket: ~30 us of a layer on an H200), each input is
gathered into path order first and the outputs gathered back, and a batch of requests needs one call per request.
This kernel takes the trees as they are: each program walks one path for one value head and a block of value
columns, starting from its request's committed state (a slot of the recurrent pool, read where it lies), loads
each node's q/k/v/g/beta by its index and writes the node's output at its own row. Paths that share a prefix
compute it identically, so their writes agree. The paths of every request of a batch go in one call.

A walk recomputes every shared prefix once per leaf (a 64-node tree has ~20-60 leaves), so by default the engine
takes each tree whole instead (batched_tree_chunks: the root as one step, the rest in the ancestor-masked WY form on
tensor cores; 1.66 against 2.43 ms a 27B round at budget 64 on an H200). Also here: an `ar` step's recurrence and
conv in place in the pool (steps_in_place, conv_steps_in_place), a tree batch's conv (conv_windows_in_place) and a
commit's replay of the accepted paths in place in the pool (replay_in_place).

Per node, as gdn.gdn_sequential (the reference it is tested against, tests/gpu/test_tree_kernel.py):
q, k l2-normalised (q also scaled by dk**-0.5), S = S * exp(g); v' = beta * (v - S^T k); S = S + k v'^T;
o = S^T q. Key head h serves value heads h * HV/H .. (h + 1) * HV/H - 1.

Imported only where it runs (CUDA, or Triton's interpreter in a test): fla's trap applies to triton too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ddtree.models.gdn import L2_EPS, ReplayStash
from ddtree.models.grid_wait import wait_for_previous_grid
from ddtree.models.kernels import pdl

# Launch shape: a narrow block of value columns per program and one warp (as fla's fused recurrent kernel), so a
# tree's few paths still fill the GPU (HV x paths x dv / BLOCK_V programs). perf/tree_kernel_bench.py sweeps these:
# 16 columns, one warp, two stages was the fastest of 8 shapes in every case on an H200 (tree_kernel_h200.md).
BLOCK_V, NUM_WARPS, NUM_STAGES = 16, 1, 2
# The chunk form's launch shape per forest block (rows below the root, padded): (value columns per program, warps).
# On the H200 at 27B dims (48 layers, tf32) 64 columns and 4 warps were the fastest of the shapes tried at 17, 33
# and 65 rows, one request and eight (perf/results/tree_chunks_h200_partial.log: 0.56 / 1.94 ms at 17 rows against
# 0.91 / 5.24 through the paths kernel; tree_chunks_h200_b64.md: 1.50 / 6.54 ms at 65 rows against 64 x 8's 1.56 /
# 9.61 and the paths kernel's 3.31 / 21.0). DDTREE_CHUNK_SHAPES="64:64:4,16:32:4" overrides (bn:columns:warps;
# perf/tree_kernel_bench.py prints the best for the GPU it runs on); a fourth field sets the key columns a step of the
# passes over the key dim takes (bn:columns:warps:key_block; CHUNK_BLOCK_K otherwise). 64 columns a step (two at
# 27B's key dim 128) against 32: 0.449 / 1.625 ms against 0.573 / 1.970 at 17 rows, one request and eight, 1.308 /
# 6.447 against 1.515 / 7.095 at 65, 16 columns slower everywhere (H100, perf/results/tree_chunks_bk_gpu.md); whole
# 27B rounds 0.3-1.0% shorter (gpu_ratios_h100_fused.md, gpu_ratios_h100_glugates.md: static-chunkk64); the 32-column
# step made the new default's rounds 1.003-1.020x longer (gpu_ratios_h100_k64default.md: static-chunkk32).
CHUNK_SHAPES = {16: (64, 4), 32: (64, 4), 64: (64, 4)}
CHUNK_BLOCK_K = 64


def chunk_forest(max_rows: int, max_depth: int) -> tuple[int, int]:
    """(BN, FACTORS) of the chunk form for trees of up to max_rows rows and max_depth rows on a root-to-leaf path: the
    forest below the root padded to a power of two >= 16 rows, and the (I + L^(2^j)) factors its solve takes (paths
    below the root have max_depth - 1 rows: L^(max_depth - 1) = 0)."""
    return max(16, triton.next_power_of_2(max(max_rows - 1, 1))), max(1, (max_depth - 2).bit_length())


def chunk_shape(block_n: int) -> tuple[int, int, int]:
    """(value columns per program, warps, key columns a step) of the chunk form for a forest block of block_n rows."""
    shapes = {bn: (*shape, CHUNK_BLOCK_K) for bn, shape in CHUNK_SHAPES.items()}
    for item in os.environ.get("DDTREE_CHUNK_SHAPES", "").split(","):
        if item.strip():
            bn, bv, warps, *block_k = (int(x) for x in item.split(":"))
            shapes[bn] = (bv, warps, *(block_k or [CHUNK_BLOCK_K]))
    return shapes.get(block_n, (32, 4, CHUNK_BLOCK_K))


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) in float32 as torch's softplus computes it (x past 20: x), log1p by Goldberg's correction
    (log(u) * y / (u - 1) with u = 1 + y is accurate where u rounds: exp(x) far below 1)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    return tl.where(x > 20.0, x, tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0))))


@triton.jit
def _delta_update(state, b_k, b_v, b_g, b_beta, eps):
    """One token's update of a [BK, BV] block of the state (float32): k l2-normalised, S = S * exp(g);
    v' = beta * (v - S^T k); S = S + k v'^T."""
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + eps)
    state = state * tl.exp(b_g)
    b_v = (b_v - tl.sum(state * b_k[:, None], 0)) * b_beta
    return state + b_k[:, None] * b_v[None, :]


@triton.jit
def _paths_kernel(q, k, v, g, beta, o, states, state_stride, path_state, path_first, path_last, tokens, scale, eps,
                  qk_row, v_row, gate_row, decay, dt_bias, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, STEPS: tl.constexpr,
                  GATED: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    i_v, i_path, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    if STEPS:   # one token per sequence (row i_path), its new state written over the old one
        first = i_path.to(tl.int64)
        last = first + 1
    else:
        first = tl.load(path_first + i_path).to(tl.int64)
        last = tl.load(path_last + i_path).to(tl.int64)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_k, in_v = cols_k < K, cols_v < V
    h0 = states + tl.load(path_state + i_path).to(tl.int64) * state_stride + i_hv * K * V
    # a padding path (first == last) reads no state: a program that loads its index bounds and ends
    live = (in_k[:, None] & in_v[None, :]) & (last > first)
    state = tl.load(h0 + cols_k[:, None] * V + cols_v[None, :], mask=live, other=0.0).to(tl.float32)
    for i in tl.range(first, last, num_stages=STAGES):   # the path's own length: empty (padding) paths do nothing
        if STEPS:
            node = i
        else:
            node = tl.load(tokens + i).to(tl.int64)
        b_q = tl.load(q + node * qk_row + i_h * K + cols_k, mask=in_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + node * qk_row + i_h * K + cols_k, mask=in_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + node * v_row + i_hv * V + cols_v, mask=in_v, other=0.0).to(tl.float32)
        if GATED:   # g, beta hold the raw projections a, b: the gates as fused.gdn_gates computes them
            raw_b = tl.load(beta + node * gate_row + i_hv)
            b_beta = tl.sigmoid(raw_b.to(tl.float32)).to(raw_b.dtype).to(tl.float32)   # rounded as torch's, in b's dtype
            b_a = tl.load(g + node * gate_row + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
            b_g = tl.load(decay + i_hv) * _softplus(b_a)
        else:
            b_g = tl.load(g + node * gate_row + i_hv).to(tl.float32)
            b_beta = tl.load(beta + node * gate_row + i_hv).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + eps) * scale
        state = _delta_update(state, b_k, b_v, b_g, b_beta, eps)
        b_o = tl.sum(state * b_q[:, None], 0)
        tl.store(o + (node * HV + i_hv) * V + cols_v, b_o.to(o.dtype.element_ty), mask=in_v)
    if STEPS:
        tl.store(h0 + cols_k[:, None] * V + cols_v[None, :], state, mask=live)


def tree_paths_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          tokens: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor,
                          max_len: int | None = None) -> torch.Tensor:
    """One tree (TreePaths' tokens and cu_seqlens) from one committed state [HV, dk, dv]: see batched_tree_paths.
    max_len: unused (the kernel walks each path's own length); kept for the paths form's call signature."""
    bounds = cu_seqlens
    return batched_tree_paths(q, k, v, g, beta, tokens, bounds[:-1], bounds[1:], initial_state[None],
                              torch.zeros_like(bounds[:-1]))


def batched_tree_paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       tokens: torch.Tensor, path_first: torch.Tensor, path_last: torch.Tensor, states: torch.Tensor,
                       path_state: torch.Tensor, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                       num_stages: int = NUM_STAGES, steps: bool = False,
                       gates: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """o [N, HV, dv] in v's dtype of every node covered by a path (others 0).

    q, k # [N, H, dk] raw; v # [N, HV, dv]; g # [N, HV] log decay; beta # [N, HV]: the rows of every tree of the
    batch, each row's heads contiguous, rows any stride apart (q, k, v may be column slices of the conv's output [N,
    conv_dim], read where they lie: no copies); q and k, g and beta with one row stride each. tokens # [T] long: the
    row of each path position (paths concatenated, root first); path_first, path_last # [S] long: each path's
    tokens[first:last] (first == last: a padding path); states # [B, HV, dk, dv] float32, any stride between its B
    states (a pool's layer view); path_state # [S] long: the state each path starts from. steps: one token per path,
    row s of path s (tokens, path_first, path_last unused), its final state written over the state it started from
    (steps_in_place). gates: (decay_rate, dt_bias) # [HV] each, g and beta then being the raw projections a and b
    (fused.gdn_gates computed in the kernel).
    """
    n, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert hv % h == 0 and k.shape == q.shape and g.shape == (n, hv) and beta.shape == (n, hv), "shapes"
    assert states.dtype == torch.float32 and states.shape[1:] == (hv, dk, dv) and states[0].is_contiguous(), "states"
    q, k, v, g, beta = _node_inputs(q, k, v, g, beta)
    # steps write every row; a tree's rows outside its paths (a static forward's padding) must read as zeros
    o = (torch.empty if steps else torch.zeros)(v.shape, dtype=v.dtype, device=v.device)
    decay, dt_bias = gates if gates is not None else (g, beta)   # unread without gates
    grid = (triton.cdiv(dv, block_v), n if steps else path_first.shape[0], hv)
    use_pdl = pdl(v.device)
    _paths_kernel[grid](q, k, v, g, beta, o, states, states.stride(0), path_state, path_first, path_last, tokens,
                        dk**-0.5, L2_EPS, q.stride(0), v.stride(0), g.stride(0), decay, dt_bias,
                        H=h, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=block_v, STAGES=num_stages,
                        STEPS=steps, GATED=gates is not None, PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl)
    return o


def steps_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   decay_rate: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One committed token for each of R sequences (batched_tree_paths' q, k, v with N = R rows), sequence r from
    states[slots[r]] (a recurrent pool's layer view), its new state written there in place: o [R, HV, dv]. An `ar`
    step without the gather of the states before fla's kernel and the scatter after it (two copies of 3 MiB per
    request and GDN layer at Qwen3.6-27B dims), and with its gates computed in the kernel from the raw projections
    b, a # [R, HV] (fused.gdn_gates with decay_rate, dt_bias # [HV]: two elementwise kernels less per GDN layer).
    The slots must differ (each program owns its block of its state)."""
    return batched_tree_paths(q, k, v, a, b, slots, slots, slots, states, slots, steps=True, gates=(decay_rate, dt_bias))


@triton.jit
def _replay_kernel(qkv, g, beta, valid, states, state_stride, slots, rows, bounds, eps, qkv_layer, qkv_row, g_layer,
                   g_row, beta_layer, beta_row, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, VALID: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    i_v, i_r, i_lh = tl.program_id(0), tl.program_id(1), tl.program_id(2)   # i_lh: layer i_lh // HV, value head i_lh % HV
    layer, i_hv = i_lh // HV, i_lh % HV
    i_h = i_hv // (HV // H)
    first = tl.load(bounds + i_r).to(tl.int64)
    last = tl.load(bounds + i_r + 1).to(tl.int64)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_k, in_v = cols_k < K, cols_v < V
    h0 = states + tl.load(slots + i_r).to(tl.int64) * state_stride + i_lh.to(tl.int64) * K * V
    live = (in_k[:, None] & in_v[None, :]) & (last > first)   # an empty path: its state neither read nor written
    state = tl.load(h0 + cols_k[:, None] * V + cols_v[None, :], mask=live, other=0.0).to(tl.float32)
    key = qkv + layer.to(tl.int64) * qkv_layer + H * K + i_h * K
    value = qkv + layer.to(tl.int64) * qkv_layer + 2 * H * K + i_hv * V
    for i in range(first, last):
        row = tl.load(rows + i).to(tl.int64)
        b_k = tl.load(key + row * qkv_row + cols_k, mask=in_k, other=0.0).to(tl.float32)
        b_v = tl.load(value + row * qkv_row + cols_v, mask=in_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + layer * g_layer + row * g_row + i_hv).to(tl.float32)
        b_beta = tl.load(beta + layer * beta_layer + row * beta_row + i_hv)
        if VALID:   # a padding row: zero decay and zero beta, the state left exactly as it was (as replay_apply's valid)
            ok = tl.load(valid + i)
            b_g = b_g * ok.to(tl.float32)
            b_beta = b_beta * ok.to(b_beta.dtype)
        state = _delta_update(state, b_k, b_v, b_g, b_beta.to(tl.float32), eps)
    tl.store(h0 + cols_k[:, None] * V + cols_v[None, :], state, mask=live)


def replay_in_place(stash: ReplayStash, rows: torch.Tensor, bounds: torch.Tensor, states: torch.Tensor,
                    slots: torch.Tensor, valid: torch.Tensor | None = None, block_v: int = BLOCK_V) -> None:
    """A replay commit's recurrence (gdn.replay_apply's states) with every new state written over the committed one,
    in place: request r's accepted path, rows[bounds[r]:bounds[r + 1]] of a ReplayStash (its qkv [L, N, 2 * H * dk +
    HV * dv], the conv's outputs; g [L, N, HV] float32 log decays; beta [L, N, HV]), walked by each layer's every value head
    from states[slots[r]] (states [S, L, HV, dk, dv] float32, each slot's contiguous; the slots must differ). One
    program per request, layer, value head and block of value columns, the stash read where it lies: no gather of the
    path's rows into heads, no new states beside the committed ones and no copy of them back (at Qwen3.6-27B dims
    150 MB written and 300 MB copied a commit through fla's kernel). valid [T] (0/1): replay_apply's padding rows."""
    qkv, g, beta = stash.qkv, stash.g, stash.beta
    layers, n, width = qkv.shape
    hv, h, dk, dv = stash.value_heads, stash.key_heads, stash.key_dim, stash.value_dim
    assert width == 2 * h * dk + hv * dv and hv % h == 0 and qkv.stride(2) == 1, "qkv"
    assert g.shape == beta.shape == (layers, n, hv) and g.stride(2) == beta.stride(2) == 1, "gates"
    assert states.dtype == torch.float32 and states.shape[1:] == (layers, hv, dk, dv) and states[0].is_contiguous()
    assert bounds.shape == (slots.shape[0] + 1,) and (valid is None or valid.shape == rows.shape), "bounds, valid"
    use_pdl = pdl(qkv.device)
    _replay_kernel[(triton.cdiv(dv, block_v), slots.shape[0], layers * hv)](
        qkv, g, beta, rows if valid is None else valid, states, states.stride(0), slots, rows, bounds, L2_EPS,
        qkv.stride(0), qkv.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        H=h, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=block_v, VALID=valid is not None, PDL=use_pdl,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=use_pdl)


@triton.jit
def _chunk_kernel(q, k, v, g, beta, o, states, state_stride, tree_state, tree_row0, tree_rows, anc, anc_tree, anc_row,
                  scale, eps, qk_row, v_row, gate_row, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, FACTORS: tl.constexpr,
                  PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    row0 = tl.load(tree_row0 + i_t).to(tl.int64)
    n = tl.load(tree_rows + i_t)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_v = cols_v < V
    h0 = states + tl.load(tree_state + i_t).to(tl.int64) * state_stride + i_hv * K * V
    # rows 1 .. n - 1 of the tree as i = 0 .. BN - 1: a forest below the root (row 0, every other row's ancestor)
    i = tl.arange(0, BN)
    live = i < n - 1
    rows = row0 + 1 + i
    # pass 1 over blocks of the key dim: norms, k k^T and q k^T of the raw rows (scaled after), the root's S0^T k
    r_q2, r_k2 = 0.0, 0.0
    q2, k2 = tl.zeros([BN], dtype=tl.float32), tl.zeros([BN], dtype=tl.float32)
    kk, qk = tl.zeros([BN, BN], dtype=tl.float32), tl.zeros([BN, BN], dtype=tl.float32)
    s_k = tl.zeros([BV], dtype=tl.float32)
    for kb in tl.static_range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        in_c = cols < K
        r_q = tl.load(q + row0 * qk_row + i_h * K + cols, mask=in_c, other=0.0).to(tl.float32)
        r_k = tl.load(k + row0 * qk_row + i_h * K + cols, mask=in_c, other=0.0).to(tl.float32)
        r_q2 += tl.sum(r_q * r_q)
        r_k2 += tl.sum(r_k * r_k)
        s0 = tl.load(h0 + cols[:, None] * V + cols_v[None, :], mask=in_c[:, None] & in_v[None, :], other=0.0)
        s_k += tl.sum(s0 * r_k[:, None], 0)
        at = rows[:, None] * qk_row + i_h * K + cols[None, :]
        b_q = tl.load(q + at, mask=live[:, None] & in_c[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(k + at, mask=live[:, None] & in_c[None, :], other=0.0).to(tl.float32)
        q2 += tl.sum(b_q * b_q, 1)
        k2 += tl.sum(b_k * b_k, 1)
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        qk += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
    r_qs = scale / tl.sqrt(r_q2 + eps)
    r_ks = 1.0 / tl.sqrt(r_k2 + eps)
    qs = scale / tl.sqrt(q2 + eps)
    ks = 1.0 / tl.sqrt(k2 + eps)
    # the root as one step of the recurrence: S1 = e^g0 S0 + k0 v0'^T, v0' = beta0 (v0 - e^g0 S0^T k0)
    r_decay = tl.exp(tl.load(g + row0 * gate_row + i_hv).to(tl.float32))
    r_v = tl.load(v + row0 * v_row + i_hv * V + cols_v, mask=in_v, other=0.0).to(tl.float32)
    r_v = (r_v - r_decay * s_k * r_ks) * tl.load(beta + row0 * gate_row + i_hv).to(tl.float32)
    # the forest from S1 in the ancestor-masked WY form (gdn.gdn_tree)
    b_g = tl.load(g + rows * gate_row + i_hv, mask=live, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + rows * gate_row + i_hv, mask=live, other=0.0).to(tl.float32)
    a = anc + i_t.to(tl.int64) * anc_tree + (1 + i[:, None]) * anc_row + 1 + i[None, :]
    seen = tl.load(a, mask=live[:, None] & live[None, :], other=0) != 0                           # anc-or-self
    c = tl.sum(tl.where(seen, b_g[None, :], 0.0), 1)                                              # path sums of g
    gamma = tl.exp(tl.where(seen, c[:, None] - c[None, :], float("-inf")))                       # 0 off the paths
    lower = tl.where(seen & (i[:, None] != i[None, :]), kk * (ks[:, None] * ks[None, :]) * gamma * b_beta[:, None], 0.0)
    att = qk * (qs[:, None] * ks[None, :]) * gamma
    # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...: L is nilpotent (L^d = 0 past the deepest path), FACTORS terms
    inverse = tl.where(i[:, None] == i[None, :], 1.0, 0.0) - lower
    power = lower
    for _ in tl.static_range(FACTORS - 1):
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse = inverse + tl.dot(inverse, power, input_precision=PRECISION)
    ec = tl.exp(c)
    b_v = tl.load(v + rows[:, None] * v_row + i_hv * V + cols_v[None, :], mask=live[:, None] & in_v[None, :],
                  other=0.0).to(tl.float32)
    v_new = tl.dot(inverse, b_v * b_beta[:, None], input_precision=PRECISION)                      # U, then U - W S1
    out = tl.zeros([BN, BV], dtype=tl.float32)
    r_o = tl.zeros([BV], dtype=tl.float32)
    # pass 2: S1 block by block, W = T^-1 (K beta e^c) and the state's share of every output
    for kb in tl.static_range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        in_c = cols < K
        r_q = tl.load(q + row0 * qk_row + i_h * K + cols, mask=in_c, other=0.0).to(tl.float32) * r_qs
        r_k = tl.load(k + row0 * qk_row + i_h * K + cols, mask=in_c, other=0.0).to(tl.float32) * r_ks
        s1 = r_decay * tl.load(h0 + cols[:, None] * V + cols_v[None, :], mask=in_c[:, None] & in_v[None, :],
                               other=0.0) + r_k[:, None] * r_v[None, :]                          # [BK, BV]
        r_o += tl.sum(s1 * r_q[:, None], 0)
        at = rows[:, None] * qk_row + i_h * K + cols[None, :]
        b_k = tl.load(k + at, mask=live[:, None] & in_c[None, :], other=0.0).to(tl.float32)
        w = tl.dot(inverse, b_k * (ks * b_beta * ec)[:, None], input_precision=PRECISION)          # [BN, BK]
        v_new -= tl.dot(w, s1, input_precision=PRECISION)
        b_q = tl.load(q + at, mask=live[:, None] & in_c[None, :], other=0.0).to(tl.float32)
        out += tl.dot(b_q * (qs * ec)[:, None], s1, input_precision=PRECISION)
    out += tl.dot(att, v_new, input_precision=PRECISION)
    tl.store(o + (row0 * HV + i_hv) * V + cols_v, r_o.to(o.dtype.element_ty), mask=in_v)
    tl.store(o + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], out.to(o.dtype.element_ty),
             mask=live[:, None] & in_v[None, :])


def batched_tree_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        tree_row0: torch.Tensor, tree_rows: torch.Tensor, ancestors: torch.Tensor, states: torch.Tensor,
                        tree_state: torch.Tensor, max_rows: int, max_depth: int, block_v: int | None = None,
                        num_warps: int | None = None, block_k: int | None = None, precision: str | None = None) -> torch.Tensor:
    """o [N, HV, dv] in v's dtype of every row of every tree: batched_tree_paths' values without walking paths.

    Each program takes one tree, one value head and a block of value columns: the root (a tree's first row, every
    other row's ancestor) as one step of the recurrence from the tree's committed state, then the rest of the tree as
    a forest from the state after the root, in the ancestor-masked WY form (gdn.gdn_tree) on tensor cores: the
    triangular solve as a product of (I + L^(2^j)) factors, L being nilpotent (FACTORS = ceil(log2(depth)) of them,
    where depth bounds the rows on any path below the root). A tree's rows past a path shared with no one cost one
    row of a matrix product, not a walk from the root; shared prefixes are computed once.

    q, k, v, g, beta as batched_tree_paths (not gated). tree_row0, tree_rows # [B] long: each tree's first row and
    row count (row 0 of a tree is its root; rows of a tree not below its root, a static forward's padding, get
    unspecified finite values); ancestors # [B, >= max_rows, >= max_rows] bool or int8, tree b's anc-or-self matrix
    in ancestors[b, :rows, :rows] (last dim contiguous); states # [S, HV, dk, dv] float32; tree_state # [B] long.
    max_rows: the largest tree's rows (its forest pads to a power of two >= 16 of max_rows - 1); max_depth: the most
    rows on a root-to-leaf path (root included). block_k: key columns per step of the passes over the key dim
    (chunk_shape's by default).
    precision: the matrix products' (triton's input_precision): by default tf32 for inputs in 16 bits (its error,
    ~5e-4 absolute at 27B dims, under a bf16 output's rounding), tf32x3 for float32 ones."""
    n, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert hv % h == 0 and k.shape == q.shape and g.shape == (n, hv) and beta.shape == (n, hv), "shapes"
    assert states.dtype == torch.float32 and states.shape[1:] == (hv, dk, dv) and states[0].is_contiguous(), "states"
    assert ancestors.stride(2) == 1 and ancestors.shape[1] >= max_rows and max_depth >= 1, "ancestors"
    q, k, v, g, beta = _node_inputs(q, k, v, g, beta)
    if ancestors.dtype == torch.bool:
        ancestors = ancestors.view(torch.int8)
    bn, factors = chunk_forest(max_rows, max_depth)
    shape = chunk_shape(bn)
    block_v, num_warps, block_k = block_v or shape[0], num_warps or shape[1], block_k or shape[2]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    precision = precision or ("tf32x3" if v.dtype == torch.float32 else "tf32")
    grid = (triton.cdiv(dv, block_v), tree_row0.shape[0], hv)
    use_pdl = pdl(v.device)
    _chunk_kernel[grid](q, k, v, g, beta, o, states, states.stride(0), tree_state, tree_row0, tree_rows, ancestors,
                        ancestors.stride(0), ancestors.stride(1), dk**-0.5, L2_EPS, q.stride(0), v.stride(0), g.stride(0),
                        H=h, HV=hv, K=dk, V=dv, BK=min(block_k, max(16, triton.next_power_of_2(dk))), BN=bn, BV=block_v,
                        FACTORS=factors, PRECISION=precision, PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl)
    return o


@triton.jit
def _conv_steps_kernel(x, pool, slots, weight, out, C, x_row, pool_slot, pool_channel, weight_row,
                       KW: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: the conv weights' loads sit among the window's (kernels.pdl)
    i_c, r = tl.program_id(0), tl.program_id(1)
    c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    window = pool + tl.load(slots + r).to(tl.int64) * pool_slot + c.to(tl.int64) * pool_channel
    x_c = tl.load(x + r * x_row + c, mask=ok, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW - 1):   # the last KW - 1 committed inputs, each moved one place down as it is read
        w_j = tl.load(window + j + 1, mask=ok, other=0.0)
        acc += w_j.to(tl.float32) * tl.load(weight + c * weight_row + j, mask=ok, other=0.0).to(tl.float32)
        tl.store(window + j, w_j, mask=ok)
    acc += x_c.to(tl.float32) * tl.load(weight + c * weight_row + KW - 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(window + KW - 1, x_c.to(pool.dtype.element_ty), mask=ok)
    tl.store(out + r * C + c, (acc / (1.0 + tl.exp(-acc))).to(out.dtype.element_ty), mask=ok)


def conv_steps_in_place(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                        block_c: int = 256) -> torch.Tensor:
    """The causal conv + SiLU of one committed input per sequence, its window read from and shifted in place in a
    recurrent pool's layer view: fused.conv_steps_pooled and the copy of its shifted windows back into the pool, as
    one kernel. x # [R, C] (rows any stride apart); conv_pool # [S, C, K] (the pool dtype); slots # [R] long, all
    different; weight # [C, K]. Returns the conv output [R, C] in x's dtype, summed in float32."""
    r, c = x.shape
    kw = conv_pool.shape[2]
    assert conv_pool.shape[1] == c and conv_pool.stride(2) == 1 and weight.shape == (c, kw) and weight.stride(1) == 1
    x = _rows_apart(x)
    out = torch.empty(r, c, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x.device)
    _conv_steps_kernel[(triton.cdiv(c, block_c), r)](x, conv_pool, slots, weight, out, c, x.stride(0),
                                                     conv_pool.stride(0), conv_pool.stride(1), weight.stride(0),
                                                     KW=kw, BLOCK_C=block_c, PDL=use_pdl, launch_pdl=use_pdl)
    return out


@triton.jit
def _conv_windows_kernel(x, pool, slots, weight, window, out, x_out, C, x_row, pool_slot, pool_channel, weight_row,
                         out_row, x_out_row, committed, b, a, decay, dt_bias, beta_out, g_out, gate_row, beta_row,
                         g_row, KW: tl.constexpr, BLOCK_C: tl.constexpr, HV: tl.constexpr, BLOCK_HV: tl.constexpr,
                         GATES: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: the conv weights' loads sit among the window's (kernels.pdl)
    i_c, n = tl.program_id(0), tl.program_id(1)
    if GATES:   # row n's gates from the raw projections b, a, as fused.gdn_gates_into writes them (its first program)
        if i_c == 0:
            h = tl.arange(0, BLOCK_HV)
            h_ok = h < HV
            raw_b = tl.load(b + n * gate_row + h, mask=h_ok, other=0.0)
            beta = tl.sigmoid(raw_b.to(tl.float32)).to(raw_b.dtype)   # rounded as torch's, in b's dtype
            tl.store(beta_out + n * beta_row + h, beta.to(beta_out.dtype.element_ty), mask=h_ok)
            raw_a = (tl.load(a + n * gate_row + h, mask=h_ok, other=0.0).to(tl.float32)
                     + tl.load(dt_bias + h, mask=h_ok, other=0.0).to(tl.float32))
            g = tl.load(decay + h, mask=h_ok, other=0.0) * _softplus(raw_a)
            tl.store(g_out + n * g_row + h, g.to(g_out.dtype.element_ty), mask=h_ok)
    c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW):   # window entry j: a committed input (slot r's column i) or a row of x
        idx = tl.load(window + n * KW + j)
        in_pool = idx < committed
        column = tl.minimum(idx, committed - 1)   # clamped: the unused branch's address stays in bounds
        slot = tl.load(slots + column // KW).to(tl.int64)
        from_pool = tl.load(pool + slot * pool_slot + c.to(tl.int64) * pool_channel + column % KW, mask=ok & in_pool,
                            other=0.0)
        row = tl.maximum(idx - committed, 0).to(tl.int64)
        from_x = tl.load(x + row * x_row + c, mask=ok & (idx >= committed), other=0.0)
        value = tl.where(in_pool, from_pool.to(tl.float32), from_x.to(tl.float32))
        acc += value * tl.load(weight + c * weight_row + j, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + n * out_row + c, (acc / (1.0 + tl.exp(-acc))).to(out.dtype.element_ty), mask=ok)
    tl.store(x_out + n * x_out_row + c, tl.load(x + n * x_row + c, mask=ok, other=0.0), mask=ok)


def conv_windows_in_place(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                          window: torch.Tensor, out: torch.Tensor, x_out: torch.Tensor, block_c: int = 256,
                          gates: tuple[torch.Tensor, ...] | None = None) -> None:
    """fused.conv_windows_pooled_into as one kernel: each row's causal conv + SiLU over its window (a tree node's
    ancestors, then the committed inputs), the committed inputs read where they lie in the recurrent pool (slot r's
    window at slots[r]), written into out [N, C] and x copied into x_out [N, C] (a tree batch's commit stash).
    x # [N, C] (rows any stride apart); conv_pool # [S, C, K]; slots # [R] long; weight # [C, K]; window # [N, K]
    long, entry i < R * K: slot i // K's committed input i % K, else row i - R * K of x. Sums in float32.
    gates: (b, a, decay_rate, dt_bias, beta_out, g_out): the rows' GDN gates as well, fused.gdn_gates_into's (b, a
    [N, HV] with one row stride, each row contiguous: the raw projections; decay_rate, dt_bias [HV]; written into
    beta_out, g_out [N, HV]), a kernel less a layer (kernels.tree_gates)."""
    n, c = x.shape
    kw = conv_pool.shape[2]
    assert conv_pool.shape[1] == c and conv_pool.stride(2) == 1 and weight.shape == (c, kw) and weight.stride(1) == 1
    assert window.shape == (n, kw) and window.is_contiguous() and out.shape == x_out.shape == (n, c), "shapes"
    assert out.stride(1) == 1 and x_out.stride(1) == 1, "rows of out, x_out contiguous"
    x = _rows_apart(x)
    b, a, decay, dt_bias, beta_out, g_out = gates if gates is not None else (x,) * 6   # unread without gates
    hv = b.shape[1] if gates is not None else 1
    if gates is not None:
        assert b.shape == a.shape == beta_out.shape == g_out.shape == (n, hv) and b.stride() == a.stride(), "gates"
        assert b.stride(1) == beta_out.stride(1) == g_out.stride(1) == 1 and decay.shape == dt_bias.shape == (hv,)
    use_pdl = pdl(x.device)
    _conv_windows_kernel[(triton.cdiv(c, block_c), n)](x, conv_pool, slots, weight, window, out, x_out, c, x.stride(0),
                                                       conv_pool.stride(0), conv_pool.stride(1), weight.stride(0),
                                                       out.stride(0), x_out.stride(0), slots.shape[0] * kw, b, a, decay,
                                                       dt_bias, beta_out, g_out, b.stride(0), beta_out.stride(0),
                                                       g_out.stride(0), KW=kw, BLOCK_C=block_c, HV=hv,
                                                       BLOCK_HV=triton.next_power_of_2(hv), GATES=gates is not None,
                                                       PDL=use_pdl, launch_pdl=use_pdl)


def _node_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """The nodes' inputs as the kernels read them: each row's elements contiguous (rows any stride apart), q and k
    with one row stride, g and beta with one (copies only where they differ)."""
    q, k, v, g, beta = (_rows_apart(t) for t in (q, k, v, g, beta))
    if k.stride(0) != q.stride(0):
        k, q = k.contiguous(), q.contiguous()
    if beta.stride(0) != g.stride(0):
        g, beta = g.contiguous(), beta.contiguous()
    return q, k, v, g, beta


def _rows_apart(t: torch.Tensor) -> torch.Tensor:
    """t itself where each row's elements are contiguous (rows any stride apart), else a contiguous copy."""
    inner = t[0] if t.shape[0] else t
    return t if inner.is_contiguous() else t.contiguous()


__all__ = ["batched_tree_chunks", "batched_tree_paths", "conv_steps_in_place", "conv_windows_in_place", "steps_in_place",
           "tree_paths_recurrence"]
