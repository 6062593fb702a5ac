"""DenseTarget: serving forward for Llama- and Qwen3-family HF checkpoints.

A static KV cache holds the committed prefix; a forward takes query tokens with their own
positions and an ancestor mask among themselves (a tree, a chain, or a prompt), appends their
K/V after the prefix, and returns logits and the hidden states the drafter taps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddtree.models import fused
from ddtree.models.base import TargetModel, to_device
from ddtree.models.kernels import attention_kernel, attention_kernel_rows, qkv_kernel, qkv_kernel_without_norms
from ddtree.models.layers import (
    FusedProjections,
    GatedMLP,
    NormedRows,
    RMSNorm,
    Rotary,
    apply_rotary,
    attend,
    linear,
    sdpa,
    through_gemv,
)
from ddtree.models.loader import assign_weights, load_state_dict, read_config, rope_scaling, rope_theta

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "qwen3", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict) -> "DenseConfig":
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(f"target model_type {model_type!r} is not a supported dense type {SUPPORTED_TYPES}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        return cls(
            model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta(hf),
            rope_scaling=rope_scaling(hf), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            mlp_bias=hf.get("mlp_bias", False), qk_norm=model_type == "qwen3", eos_token_ids=eos_ids,
        )


class KVPool:
    """K/V of every cache slot in one tensor each: [num_layers, slots, max_len, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(num_layers, slots, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def move_rows(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """Several slots' compactions at once: (slot, start, accepted) moves the K/V of rows start + accepted[i] to
        start + i in that slot, every layer (accepted[i] >= i; the gather completes before the scatter)."""
        moves = [(slot, start, rows) for slot, start, rows in moves if rows != list(range(len(rows)))]
        if not moves:
            return
        index = to_device(torch.tensor([[slot, start + i, start + r] for slot, start, rows in moves
                                        for i, r in enumerate(rows)], dtype=torch.long), self.k.device)
        slots, dst, src = index.unbind(1)
        self.k[:, slots, dst] = self.k[:, slots, src]
        self.v[:, slots, dst] = self.v[:, slots, src]


class KVCache:
    """Static per-layer K/V for one sequence: [num_layers, max_len, kv_heads, head_dim], a slot of a KVPool
    (its own pool of one slot unless one is given), so that packed forwards can attend for all slots at once."""

    def __init__(self, num_layers: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pool: KVPool | None = None, slot: int = 0) -> None:
        self.pool = pool or KVPool(num_layers, 1, max_len, kv_heads, head_dim, dtype, device)
        self.slot = slot
        self.k = self.pool.k[:, slot]
        self.v = self.pool.v[:, slot]
        self.max_len = max_len

    def compact(self, start: int, accepted: list[int]) -> None:
        """Move the K/V of accepted tree rows to start + 0..len-1 (accepted[i] >= i, so in place is safe)."""
        self.pool.move_rows([(self.slot, start, accepted)])


@dataclass(slots=True)
class Segment:
    """One sequence's rows in a packed forward: its cache, committed length and query mask."""
    cache: KVCache
    start: int
    length: int
    mask: torch.Tensor     # [length, start + length] bool: the prefix, then ancestors among the queries
    parents: list[int] | None = None   # parent row of each query row (-1: continues the prefix), where known

    @classmethod
    def of(cls, cache: KVCache, start: int, visibility: torch.Tensor, parents: list[int] | None = None) -> "Segment":
        n = visibility.shape[0]
        assert start + n <= cache.max_len, f"cache overflow: {start} + {n} > {cache.max_len}"
        mask = torch.ones(n, start + n, dtype=torch.bool, device=visibility.device)
        mask[:, start:] = visibility
        return cls(cache=cache, start=start, length=n, mask=mask, parents=parents)


@dataclass(slots=True)
class PackedAttention:
    """Several segments' attention as one padded call over their shared KVPool (built once per forward).

    Queries are padded to the longest segment, keys to the furthest cache end; padding is masked out (a padded
    query row sees key 0 only, so no row is fully masked). One K/V write, one gather and one attention call per
    layer, instead of three per segment.
    """
    slots: torch.Tensor        # [R] cache slot of each segment
    write_slot: torch.Tensor   # [N] slot of each packed row
    write_pos: torch.Tensor    # [N] cache position of each packed row
    q_index: torch.Tensor      # [R, Q] packed row of each padded query (padding: row 0)
    out_index: torch.Tensor    # [N] flat index into [R * Q] of each packed row
    mask: torch.Tensor         # [R, 1, Q, E] bool
    end: int                   # E: keys gathered per segment
    in_order: bool = False     # rows are R x Q in request order (a static forward): q_index, out_index are identities
    fixed_slot: int | None = None   # one request in this cache slot (a program made for it): its K/V read as views
    kernel: object = False     # our attention kernel or None (SDPA), looked up by the forward's first layer (False: not yet)

    @classmethod
    def plan(cls, caches: list[KVCache], segments: list[Segment]) -> "PackedAttention | None":
        """None unless there are several segments, all in one pool (then each is attended on its own)."""
        if len(segments) < 2 or any(c.pool is not caches[0].pool for c in caches):
            return None
        device = segments[0].mask.device
        q_len = max(seg.length for seg in segments)
        end = max(seg.start + seg.length for seg in segments)
        mask = torch.zeros(len(segments), q_len, end, dtype=torch.bool, device=device)
        mask[:, :, 0] = True
        write_slot, write_pos, q_index, out_index, row = [], [], [], [], 0
        for r, (cache, seg) in enumerate(zip(caches, segments)):
            mask[r, : seg.length, : seg.start + seg.length] = seg.mask
            write_slot.append(torch.full((seg.length,), cache.slot, dtype=torch.long))
            write_pos.append(torch.arange(seg.start, seg.start + seg.length))
            q_index.append(torch.cat([torch.arange(row, row + seg.length), torch.zeros(q_len - seg.length, dtype=torch.long)]))
            out_index.append(torch.arange(r * q_len, r * q_len + seg.length))
            row += seg.length
        host = torch.cat([torch.tensor([c.slot for c in caches]), torch.cat(write_slot), torch.cat(write_pos),
                          torch.stack(q_index).flatten(), torch.cat(out_index)]).to(device)   # one copy to the device
        n, r = row, len(segments)
        slots, write_slot, write_pos, q_index, out_index = host.split([r, n, n, r * q_len, n])
        return cls(slots=slots, write_slot=write_slot, write_pos=write_pos, q_index=q_index.view(r, q_len),
                   out_index=out_index, mask=mask[:, None], end=end)

    @classmethod
    def static(cls, slots: torch.Tensor, starts: torch.Tensor, ancestors: torch.Tensor, end: int,
               fixed_slot: int | None = None) -> "PackedAttention":
        """R segments of Q rows each from device tensors only (no host reads: a CUDA graph's static forward):
        slots, starts  # [R] long; ancestors  # [R, Q, Q] bool among each segment's queries (or [Q, Q] for R = 1);
        keys 0..end-1 of each slot, of which the prefix < its start is visible. fixed_slot: R = 1 and the program is
        made for that slot (its K/V then read as views of the pool, no gather per layer)."""
        if ancestors.dim() == 2:
            ancestors = ancestors[None]
        r, q_len, device = ancestors.shape[0], ancestors.shape[1], ancestors.device
        rows = torch.arange(q_len, device=device)
        rel = torch.arange(end, device=device)[None, :] - starts[:, None]       # [R, E] key position - start
        tree = ancestors.gather(2, rel.clamp(0, q_len - 1)[:, None, :].expand(r, q_len, end))
        mask = (rel < 0)[:, None, :] | ((rel < q_len)[:, None, :] & tree)       # [R, Q, E]
        return cls(slots=slots, write_slot=slots[:, None].expand(r, q_len).flatten(),
                   write_pos=(starts[:, None] + rows).flatten(),
                   q_index=torch.arange(r * q_len, device=device).view(r, q_len),
                   out_index=torch.arange(r * q_len, device=device), mask=mask[:, None], end=end, in_order=True,
                   fixed_slot=fixed_slot)

    def attend(self, pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """pool_k, pool_v  # [slots, max_len, kv_heads, d] of one layer; q  # [N, heads, d]; k, v  # [N, kv_heads, d],
        or None where the rows' K/V are in the pool already (prepare_and_attend)."""
        if k is not None:
            pool_k[self.write_slot, self.write_pos] = k
            pool_v[self.write_slot, self.write_pos] = v
        r, q_len = self.q_index.shape
        d = q.shape[-1]
        if self.kernel is False:   # once per forward: every layer has the same rows and head dim
            self.kernel = attention_kernel(q.device) if q_len <= attention_kernel_rows(d) and d & (d - 1) == 0 else None
        kernel = self.kernel
        if kernel is not None:   # ours: the keys read in the pool at each request's slot, split over programs
            queries = q.reshape(r, q_len, *q.shape[1:]) if self.in_order else q[self.q_index]     # [R, Q, heads, d]
            out = kernel(queries, pool_k, pool_v, self.slots, self.end, self.mask[:, 0], scale)
            return out.reshape(r * q_len, *out.shape[2:]) if self.in_order else out.flatten(0, 1)[self.out_index]
        if self.fixed_slot is not None:                                        # views: no copy of the K/V
            keys, values = (pool[self.fixed_slot, : self.end][None].transpose(1, 2) for pool in (pool_k, pool_v))
        else:
            keys = pool_k[self.slots, : self.end].transpose(1, 2)              # [R, kv_heads, E, d]
            values = pool_v[self.slots, : self.end].transpose(1, 2)
        queries = (q.reshape(r, q_len, *q.shape[1:]) if self.in_order else q[self.q_index]).transpose(1, 2)   # [R, heads, Q, d]
        out = sdpa(queries, keys, values, self.mask, scale).transpose(1, 2)
        return out.reshape(r * q_len, *out.shape[2:]) if self.in_order else out.flatten(0, 1)[self.out_index]   # [N, heads, d]


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[KVCache], segments: list[Segment],
                    layer: int, scale: float, packed: PackedAttention | None) -> torch.Tensor:
    """Write the packed rows' K/V into their segments' caches at `layer` and attend over them: one padded call when
    `packed`, else per segment. q  # [N, heads, d]; k, v  # [N, kv_heads, d] -> [N, heads, d]"""
    if packed is not None:
        pool = caches[0].pool
        return packed.attend(pool.k[layer], pool.v[layer], q, k, v, scale)
    outputs, row = [], 0
    for kv, seg in zip(caches, segments):
        rows, end = slice(row, row + seg.length), seg.start + seg.length
        kv.k[layer, seg.start : end] = k[rows]
        kv.v[layer, seg.start : end] = v[rows]
        outputs.append(attend(q[rows], kv.k[layer, :end], kv.v[layer, :end], seg.mask, scale))
        row += seg.length
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def prepare_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norms: tuple | None, rope: tuple[torch.Tensor, torch.Tensor],
                       caches: list[KVCache], layer: int, scale: float, packed: PackedAttention | None
                       ) -> torch.Tensor | None:
    """A packed forward's per-head q/k norms, rotary and K/V writes in one kernel (kernels.qkv_kernel), then its
    attention: [N, heads, d]; None where that kernel does not run (not packed, not CUDA, switched off: the caller's
    chains and attend_segments then). norms: (q_weight, k_weight, eps, zero_centered) as prepare_qkv takes them, or
    None: rotary and the K/V writes only (a Llama's heads: SmolLM2, the embedded default), where
    kernels.qkv_kernel_without_norms (DDTREE_QKV_KERNEL=all; off by default, not yet measured)."""
    kernel = qkv_kernel(q.device) if packed is not None and (norms is not None or qkv_kernel_without_norms()) else None
    if kernel is None or q.shape[-1] & (q.shape[-1] - 1):
        return None
    pool = caches[0].pool
    q_weight, k_weight, eps, zero_centered = norms if norms is not None else (None, None, 0.0, False)
    q = kernel(q, k, v, q_weight, k_weight, eps, *rope, pool.k[layer], pool.v[layer], packed.write_slot,
               packed.write_pos, zero_centered=zero_centered)
    return packed.attend(pool.k[layer], pool.v[layer], q, None, None, scale)


@dataclass(slots=True)
class ForwardPlan:
    """A forward's structure when built outside it (a static forward for CUDA graphs builds it from static buffers)."""
    packed: PackedAttention
    layouts: list | None = None    # hybrid targets: one gdn.TreeLayout per segment


class Attention(FusedProjections, nn.Module):
    PROJECTIONS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, c: DenseConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[Segment],
                layer: int, packed: PackedAttention | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Projections for all packed rows at once; attention in one padded call (packed) or per segment. The output
        [plus the residual stream, added in o_proj's epilogue]."""
        n = x.shape[0]
        q, k, v = self.project(x)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        # [norms,] rotary and the K/V writes in one kernel where it runs; else a chain each (fused on CUDA) and two
        # index writes. Without norms (Llama: SmolLM2, the embedded default) the kernel rotates and writes only, where
        # DDTREE_QKV_KERNEL=all (kernels.qkv_kernel_without_norms: off by default, its speed not yet measured).
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, False) if self.q_norm is not None else None
        out = prepare_and_attend(q, k, v, norms, rope, [seg.cache for seg in segments], layer, self.head_dim**-0.5, packed)
        if out is not None:
            return linear(out.reshape(n, -1), self.o_proj, residual)
        if self.q_norm is not None:
            q = fused.rms_norm_rotary(q, self.q_norm.weight, self.q_norm.eps, *rope)
            k = fused.rms_norm_rotary(k, self.k_norm.weight, self.k_norm.eps, *rope)
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attend_segments(q, k, v, [seg.cache for seg in segments], segments, layer, self.head_dim**-0.5, packed)
        return linear(out.reshape(n, -1), self.o_proj, residual)


class DecoderLayer(nn.Module):
    def __init__(self, c: DenseConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                segments: list[Segment], layer: int, packed: PackedAttention | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output not yet added to it): each residual add runs in the chain of
        the norm after it. pending: the previous layer's MLP output (None: x is whole)."""
        if through_gemv(x):   # rows through our kernels (an `ar` step, a few rows): each norm computed by the Linear
            # that reads it (one row: in the GEMV's prologue), each residual add in the epilogue of the Linear before it
            # (ddtree.models.gemv_kernel); pending is then None
            x = self.self_attn(NormedRows(self.input_layernorm, x), rope, segments, layer, packed, x)
            return self.mlp(NormedRows(self.post_attention_layernorm, x), x), None
        x, h = self.input_layernorm.add_norm(x, pending)
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, rope, segments, layer, packed))
        return x, self.mlp(h)


class DenseTarget(TargetModel):
    """Target model; `forward` is one prefill or one tree verify over the static cache."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one projection each (after loading: the checkpoint's names are the unfused ones)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def new_cache(self, max_len: int) -> KVCache:
        return self.new_caches(1, max_len)[0]

    def new_caches(self, slots: int, max_len: int) -> list[KVCache]:
        """One cache per slot, all in one KVPool (packed forwards attend for all of them in one call)."""
        c, p = self.config, self.embed_tokens.weight
        pool = KVPool(c.num_hidden_layers, slots, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device)
        return [KVCache(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device,
                        pool=pool, slot=i) for i in range(slots)]

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                       tap_layers: list[int] | None = None, logit_rows: torch.Tensor | None = None,
                       plan: ForwardPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences' query rows packed in one pass (continuous batching); rows follow `segments`."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        taps = {}
        wanted = set(tap_layers or ())
        packed = plan.packed if plan is not None else PackedAttention.plan([seg.cache for seg in segments], segments)
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, rope, segments, i, packed)
            if i in wanted:
                x, pending = (x if pending is None else x + pending), None
                taps[i] = x
        return self.outputs(x if pending is None else x + pending, taps, tap_layers, logit_rows)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str = "cpu") -> "DenseTarget":
        config = DenseConfig.from_hf(read_config(path))
        with torch.device("meta"):
            model = cls(config)
        state = load_state_dict(path, desc=f"loading target {Path(path).name}")
        remapped = {}
        for key, tensor in state.items():
            name = key.removeprefix("model.")
            if name.startswith("lm_head.") or key.startswith("lm_head."):
                name = key
            remapped[name] = tensor
        if config.tie_word_embeddings or "lm_head.weight" not in remapped:
            remapped["lm_head.weight"] = remapped["embed_tokens.weight"]
        assign_weights(model, remapped, path)
        model.fuse_projections()
        model.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        logger.info("target %s: %s, %d layers, hidden %d, vocab %d", Path(path).name, config.model_type,
                    config.num_hidden_layers, config.hidden_size, config.vocab_size)
        return model.to(device=device, dtype=dtype).eval()
