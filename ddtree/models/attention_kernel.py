"""A Triton kernel for the verify's masked attention: a few query rows per request (an `ar` step's one, a tree's
nodes) against the keys of its cache slot, each row seeing what its boolean mask says (the committed prefix and its
tree ancestors), with the keys split over programs (split-KV, as flash-decoding).

PyTorch's scaled_dot_product_attention gives such a call one program per (request, query head, 64 query rows): at
Qwen3.6-27B dims (24 query heads, 4 K/V heads of 256) that is 24 programs for a 17-row tree, each walking every key
alone; with the mask the call costs 65 us a layer for 1,024 keys on an H200, 2.2x the same call unmasked
(perf/results/attention_h200.md). Here each program takes one K/V head's query heads together (their rows stacked:
6 heads x 17 rows) and one slice of the keys, reads the keys where they lie in the K/V pool (the request's slot, no
gather), and writes its partial output and log-sum-exp; a second kernel joins the slices.

Imported only where it runs (CUDA, or Triton's interpreter in a test): fla's trap applies to triton too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ddtree.models.grid_wait import wait_for_previous_grid
from ddtree.models.kernels import pdl

TARGET_PROGRAMS = 264   # about two programs per SM on an H200 (132 SMs): keys are split until the grid has this many


def split_target(rows_q: int) -> int:
    """The programs masked_attention splits the keys for, a call of rows_q query rows: TARGET_PROGRAMS, or for several
    rows (trees, drafts' blocks) DDTREE_ATTENTION_TREE_PROGRAMS=N (N programs) or N,M (N up to 32 rows, M above);
    by default 132,66, "0" (or empty) TARGET_PROGRAMS for every call. Each split writes float32 partials of every row
    (at 17 rows, 19 splits over 593 keys: 7.9 MB written and read again by the join, 3x the K/V the call reads), so
    trees want fewer: 16 layers at 1,024 keys between their GEMMs took 0.852 ms split for ~132 programs against 0.952
    for 264 at 17 rows, 1.063 for ~66 against 1.105 at 65 rows (H200, perf/results/attention_h200_between.md); whole
    27B rounds on an H100 0.998 / 0.996 / 0.990x and 0.989 / 0.992 / 0.996x (`dflash` / `ddtree-16` / `ddtree-64`)
    the rounds with 264 in two runs of 3 turns (perf/results/gpu_ratios_h100_attnnorm.md, gpu_ratios_h100_draftqkv.md,
    e35526a)."""
    spec = os.environ.get("DDTREE_ATTENTION_TREE_PROGRAMS", "132,66")
    if rows_q == 1 or spec in ("", "0"):
        return TARGET_PROGRAMS
    few, _, many = spec.partition(",")
    return int(many) if many and rows_q > 32 else int(few)


@triton.jit
def _split_kernel(q, k, v, mask, slots, o_part, lse_part,
                  sq_r, sq_q, sq_h, sk_s, sk_n, sk_h, sv_s, sv_n, sv_h, sm_r, sm_q,
                  reqs, rows_q, keys, split, scale,
                  KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  M_BLOCKS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    i_split, i_b = tl.program_id(0), tl.program_id(1)
    r = i_b // (KVH * M_BLOCKS)
    i_kvh = (i_b // M_BLOCKS) % KVH
    i_m = i_b % M_BLOCKS
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)          # stacked rows of the K/V head's query heads: g * Q + qi
    row_ok = rows < G * rows_q
    g, qi = rows // rows_q, rows % rows_q
    h = i_kvh * G + g
    cols_d = tl.arange(0, D)
    slot = tl.load(slots + r).to(tl.int64)
    q_tile = tl.load(q + r * sq_r + qi[:, None] * sq_q + h[:, None] * sq_h + cols_d[None, :], mask=row_ok[:, None],
                     other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    start = i_split * split
    end = tl.minimum(start + split, keys)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k_tile = tl.load(k + slot * sk_s + cols[None, :] * sk_n + i_kvh * sk_h + cols_d[:, None], mask=col_ok[None, :],
                         other=0.0)                                                           # [D, BLOCK_N]
        s = tl.dot(q_tile, k_tile, input_precision=PRECISION) * scale
        seen = tl.load(mask + r * sm_r + qi[:, None] * sm_q + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                       other=0)
        s = tl.where(seen != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v_tile = tl.load(v + slot * sv_s + cols[:, None] * sv_n + i_kvh * sv_h + cols_d[None, :], mask=col_ok[:, None],
                         other=0.0)                                                           # [BLOCK_N, D]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    seen_any = l_i > 0
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    # partials [splits, R, Q, H, D] and [splits, R, Q, H]
    heads = KVH * G
    at = ((i_split * reqs + r) * rows_q + qi) * heads + h
    tl.store(o_part + at[:, None] * D + cols_d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_part + at, lse, mask=row_ok)


@triton.jit
def _join_kernel(o_part, lse_part, out, splits, rows, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: nothing here is a weight worth loading early (kernels.pdl)
    i = tl.program_id(0)                                  # one (request, query row, head) of rows of them
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_part + s * rows + i, mask=s < splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    cols = tl.arange(0, D)
    parts = tl.load(o_part + (s[:, None] * rows + i) * D + cols[None, :], mask=(s < splits)[:, None], other=0.0)
    joined = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + i * D + cols, joined.to(out.dtype.element_ty))


def split_tiles(group: int, rows_q: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, M_BLOCKS, warps) of _split_kernel for a K/V head's group query heads of rows_q rows each and
    heads of d: the group's query rows stacked in blocks of up to 64, keys 64 a step (32 for heads of 256 or more)."""
    block_m = min(64, max(16, triton.next_power_of_2(group * rows_q)))
    return block_m, 32 if d >= 256 else 64, triton.cdiv(group * rows_q, block_m), 8 if d * block_m >= 16384 else 4


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, keys: int,
                     mask: torch.Tensor, scale: float, target_programs: int | None = None) -> torch.Tensor:
    """out [R, Q, H, D] in q's dtype: softmax(q k^T * scale, where mask) v per request and query head.

    q  # [R, Q, H, D]; k, v  # [S, E', KVH, D] (a K/V pool's layer: S slots of E' >= keys positions), read for
    request r at slot slots[r]  # [R] long, positions 0..keys-1; mask  # [R, Q, keys] (bool or uint8, True/1 = seen;
    every row must see a key). Each tensor's last dim contiguous, other strides free (q may be a view). Query head h
    reads K/V head h // (H / KVH). target_programs: the keys split until the grid has about this many programs
    (None: split_target(Q)).
    """
    r, rows_q, heads, d = q.shape
    kvh = k.shape[2]
    assert heads % kvh == 0 and k.shape[3] == d and v.shape == k.shape and keys <= k.shape[1], "shapes"
    assert mask.shape == (r, rows_q, keys), f"mask {tuple(mask.shape)} != {(r, rows_q, keys)}"
    assert q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1 and mask.stride(2) == 1, "last dims contiguous"
    assert d == triton.next_power_of_2(d), "head dim a power of two"
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    group = heads // kvh
    block_m, block_n, m_blocks, warps = split_tiles(group, rows_q, d)
    programs = r * kvh * m_blocks
    target = split_target(rows_q) if target_programs is None else target_programs
    splits = max(1, min(triton.cdiv(target, programs), triton.cdiv(keys, block_n)))
    split = triton.cdiv(triton.cdiv(keys, splits), block_n) * block_n
    splits = triton.cdiv(keys, split)
    o_part = torch.empty(splits, r, rows_q, heads, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(splits, r, rows_q, heads, dtype=torch.float32, device=q.device)
    use_pdl = pdl(q.device)
    _split_kernel[(splits, programs)](
        q, k, v, mask, slots, o_part, lse_part, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(1), r, rows_q, keys, split, scale,
        KVH=kvh, G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, M_BLOCKS=m_blocks,
        # float32 inputs multiply in float32 (tl.dot's default rounds them to TF32: ~1e-3 off SDPA, which a float32
        # engine's static forward, tested against its dynamic one, must not be); bf16 and fp16 are unaffected
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=use_pdl, num_warps=warps,
        launch_pdl=use_pdl)
    out = torch.empty(r, rows_q, heads, d, dtype=q.dtype, device=q.device)
    _join_kernel[(r * rows_q * heads,)](o_part, lse_part, out, splits, r * rows_q * heads, D=d,
                                        BLOCK_S=max(2, triton.next_power_of_2(splits)), PDL=use_pdl, num_warps=4,
                                        launch_pdl=use_pdl)
    return out


@triton.jit
def _norm_rotary(src, w, cos_row, sin_row, eps, dtype, D: tl.constexpr, R: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                 NORM: tl.constexpr):
    """One head [D] normalized (rounded to dtype as the eager chain rounds; NORM False: as loaded, no norm, a Llama's
    heads) and rotated over its first R dims (rotate-half): float32 [D], rounded to dtype by the caller's store. With
    the norms the rotation is in float32, rounded once at that store (the eager chain rounds each product: within an
    ulp of it). Without them each product is rounded to dtype first, as the eager rotary chain and the compiled one
    (fused: emulate_precision_casts) round them, so a Llama's heads get the chains' values."""
    d = tl.arange(0, D)
    partner = tl.where(d < R // 2, d + R // 2, d - R // 2)      # the rotate-half partner inside the first R dims
    x = tl.load(src + d).to(tl.float32)
    x_p = tl.load(src + partner).to(tl.float32)
    rot = d < R
    c = tl.load(cos_row + d, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=rot, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x) / D + eps)
        w_d, w_p = tl.load(w + d).to(tl.float32), tl.load(w + partner).to(tl.float32)
        if ZERO_CENTERED:   # Qwen3.5: rmsnorm(x) * (1 + weight) in float32, rounded once
            y = (x * rstd * w_d).to(dtype).to(tl.float32)
            y_p = (x_p * rstd * w_p).to(dtype).to(tl.float32)
        else:               # Qwen3: rmsnorm(x) rounded, times the weight, rounded
            y = ((x * rstd).to(dtype).to(tl.float32) * w_d).to(dtype).to(tl.float32)
            y_p = ((x_p * rstd).to(dtype).to(tl.float32) * w_p).to(dtype).to(tl.float32)
        rotated = y * c + tl.where(d < R // 2, -y_p, y_p) * s
    else:               # Llama (SmolLM2): rotary only, x * cos and rotate_half(x) * sin each rounded as the chain
        y = x           # rounds them, their sum rounded at the store
        rotated = (x * c).to(dtype).to(tl.float32) + (tl.where(d < R // 2, -x_p, x_p) * s).to(dtype).to(tl.float32)
    return tl.where(rot, rotated, y)


@triton.jit
def _prepare_kernel(q, k, v, q_out, q_w, k_w, cos, sin, pool_k, pool_v, write_slot, write_pos,
                    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sc_n, sk_s, sk_p, sk_kh, sv_s, sv_p, sv_kh, eps, slots, positions,
                    s_slot, s_pos, HQ: tl.constexpr, D: tl.constexpr, R: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    NORM: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)   # before any load or store: the norms' weights are loaded beside the heads' (kernels.pdl)
    n, h = tl.program_id(0), tl.program_id(1)
    dtype = q_out.dtype.element_ty
    d = tl.arange(0, D)
    cos_row, sin_row = cos + n * sc_n, sin + n * sc_n
    if h < HQ:
        out = _norm_rotary(q + n * sq_n + h * sq_h, q_w, cos_row, sin_row, eps, dtype, D, R, ZERO_CENTERED, NORM)
        tl.store(q_out + (n * HQ + h) * D + d, out.to(dtype))
    else:
        kh = h - HQ
        out = _norm_rotary(k + n * sk_n + kh * sk_h, k_w, cos_row, sin_row, eps, dtype, D, R, ZERO_CENTERED, NORM)
        slot, pos = tl.load(write_slot + n * s_slot).to(tl.int64), tl.load(write_pos + n * s_pos).to(tl.int64)
        # checked only where Triton's debug mode is on (TRITON_DEBUG=1): a row written outside the pool
        tl.device_assert((slot >= 0) & (slot < slots) & (pos >= 0) & (pos < positions), "K/V write outside the pool")
        tl.store(pool_k + slot * sk_s + pos * sk_p + kh * sk_kh + d, out.to(pool_k.dtype.element_ty))
        value = tl.load(v + n * sv_n + kh * sv_h + d)
        tl.store(pool_v + slot * sv_s + pos * sv_p + kh * sv_kh + d, value.to(pool_v.dtype.element_ty))


def prepare_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, pool_k: torch.Tensor,
                pool_v: torch.Tensor, write_slot: torch.Tensor, write_pos: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """An attention layer's per-head q and k norms, their rotary and the rows' K/V writes into the K/V pool, in one
    kernel (the compiled chains are three kernels per tensor and the writes two index kernels; without norms, a
    rotary chain per tensor and the two writes): q [N, H, D] out.

    q  # [N, H, D], k, v  # [N, KVH, D] (views: last dim contiguous, other strides free); q_weight, k_weight  # [D]
    (zero_centered: Qwen3.5's float32 scale 1 + weight, rmsnorm * scale rounded once; else Qwen3's weight, rmsnorm
    rounded then times the weight), or both None: no norms, rotary only (Llama: SmolLM2, the embedded default);
    cos, sin  # [N, R]: rotary over each head's first R dims (R <= D, even);
    pool_k, pool_v  # [S, E, KVH, D] (one layer of the pool); row n written at [write_slot[n], write_pos[n]] (any
    strides: a static forward's one request has its slot broadcast, stride 0)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    r = cos.shape[-1]
    assert k.shape == v.shape == (n, kvh, d) and pool_k.shape[2:] == (kvh, d) and pool_v.shape == pool_k.shape, "shapes"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and pool_k.stride(3) == pool_v.stride(3) == 1, "last dims"
    assert cos.shape == sin.shape == (n, r) and cos.stride() == sin.stride() and cos.stride(1) == 1, "cos, sin"
    assert d == triton.next_power_of_2(d) and r % 2 == 0 and r <= d, (d, r)
    assert (q_weight is None) == (k_weight is None), "norms: both or none"
    norm = q_weight is not None
    q_out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    use_pdl = pdl(q.device)
    _prepare_kernel[(n, heads + kvh)](
        # without norms the weights' pointers are cos's, never read
        q, k, v, q_out, q_weight if norm else cos, k_weight if norm else cos, cos, sin, pool_k, pool_v, write_slot, write_pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), pool_v.stride(0), pool_v.stride(1), pool_v.stride(2), eps,
        pool_k.shape[0], pool_k.shape[1], write_slot.stride(0), write_pos.stride(0), HQ=heads, D=d, R=r,
        ZERO_CENTERED=zero_centered, NORM=norm, PDL=use_pdl, num_warps=2 if d <= 256 else 4, launch_pdl=use_pdl)
    return q_out


__all__ = ["TARGET_PROGRAMS", "masked_attention", "prepare_qkv", "split_target"]
