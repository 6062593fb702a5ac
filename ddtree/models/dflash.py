"""DFlash drafter: loads z-lab DFlash checkpoints as published and drafts one block per call.

The drafter has no embedding and no lm_head: it reads the target's embedding of
[root, MASK, ..., MASK] and the target's lm_head turns its outputs into draft logits.
Context K/V come from the target's tapped hidden states (fc -> hidden_norm, shared by every
layer) and persist in the drafter's cache; block K/V are never stored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ddtree.models import fused
from ddtree.models.dense import KVPool
from ddtree.models.kernels import draft_attention_kernel, draft_qkv_kernel
from ddtree.models.layers import FusedProjections, GatedMLP, NormedRows, RMSNorm, Rotary, attend, linear, sdpa
from ddtree.models.loader import assign_weights, load_state_dict, read_config, rope_scaling, rope_theta

logger = logging.getLogger(__name__)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default taps: evenly spaced between layer 1 and num_target_layers - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_windows: tuple[int | None, ...]   # per layer; None = full attention

    @classmethod
    def from_hf(cls, hf: dict) -> "DFlashConfig":
        dflash = hf.get("dflash_config") or {}
        if "block_size" not in hf:
            raise ValueError("DFlash config.json lacks block_size")
        if dflash.get("mask_token_id") is None:
            raise ValueError("DFlash config.json lacks dflash_config.mask_token_id")
        layers = hf["num_hidden_layers"]
        ids = dflash.get("target_layer_ids") or default_target_layer_ids(hf["num_target_layers"], layers)
        types = hf.get("layer_types") or ["full_attention"] * layers
        windows = tuple(hf.get("sliding_window") if t == "sliding_attention" else None for t in types)
        heads = hf["num_attention_heads"]
        return cls(
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(hf), rope_scaling=rope_scaling(hf),
            attention_bias=hf.get("attention_bias", False), block_size=int(hf["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]), target_layer_ids=tuple(int(i) for i in ids),
            sliding_windows=windows,
        )


class DraftAttention(FusedProjections, nn.Module):
    PROJECTIONS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, c: DFlashConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = window
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows' k (normed, rotated) and v; fused (serving): one GEMM over the k/v rows of the q/k/v weight."""
        proj = getattr(self, "fused_proj", None)
        if proj is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:
            q_out = self.fused_sizes[0]
            k, v = F.linear(x, proj.weight[q_out:], None if proj.bias is None else proj.bias[q_out:]).split(
                self.fused_sizes[1:], dim=-1)
        return self._key(k, rope), v.view(x.shape[0], self.num_kv_heads, self.head_dim)

    def project_qkv(self, x: torch.Tensor | NormedRows, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block rows' q and k (normed, rotated) and v (one GEMM where fused)."""
        n = x.shape[0]
        q, k, v = self.project(x)
        q = fused.rms_norm_rotary(q.view(n, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps, *rope)
        return q, self._key(k, rope), v.view(n, self.num_kv_heads, self.head_dim)

    def prepare_block(self, x: torch.Tensor | NormedRows, rope: tuple[torch.Tensor, torch.Tensor], prepare,
                      pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
                      ) -> torch.Tensor:
        """Block rows' q (normed, rotated) [n, heads, d], their k (normed, rotated) and v written into a pool layer
        (pool_k, pool_v [S, E, KVH, d]) at (slots, positions) [n]: project_qkv and the writes, the chains and writes in
        one kernel after the GEMM (prepare: kernels.draft_qkv_kernel's)."""
        n = x.shape[0]
        q, k, v = self.project(x)
        return prepare(q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                       v.view(n, self.num_kv_heads, self.head_dim), self.q_norm.weight, self.k_norm.weight,
                       self.q_norm.eps, *rope, pool_k, pool_v, slots, positions, zero_centered=False)

    def _key(self, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return fused.rms_norm_rotary(k.view(k.shape[0], self.num_kv_heads, self.head_dim), self.k_norm.weight,
                                     self.k_norm.eps, *rope)


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)


class DraftCache:
    """Context K/V per draft layer: [num_layers, max_len, kv_heads, head_dim]; length = context tokens.

    A slot of a KVPool (its own pool of one slot unless one is given): packed drafter passes attend for every
    slot of the pool in one call."""

    def __init__(self, c: DFlashConfig, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 pool: KVPool | None = None, slot: int = 0) -> None:
        self.pool = pool or KVPool(c.num_hidden_layers, 1, max_len, c.num_key_value_heads, c.head_dim, dtype, device)
        self.slot = slot
        self.k = self.pool.k[:, slot]
        self.v = self.pool.v[:, slot]
        self.length = 0


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config, w) for w in config.sliding_windows)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)

    def fuse_projections(self) -> None:
        """Serve each layer's q/k/v as one GEMM and gate/up as one (from_pretrained; training keeps the published
        modules): at a block's 16 rows each projection is a weight-streaming GEMM, and k/v (~10 MB each at 27B dims)
        ran at half the bus's speed alone."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_cache(self, max_len: int) -> DraftCache:
        return self.new_caches(1, max_len)[0]

    def new_caches(self, slots: int, max_len: int) -> list[DraftCache]:
        c, p = self.config, self.fc.weight
        pool = KVPool(c.num_hidden_layers, slots, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device)
        return [DraftCache(c, max_len, p.dtype, p.device, pool=pool, slot=i) for i in range(slots)]

    def add_context(self, cache: DraftCache, taps: torch.Tensor) -> None:
        """Append context tokens at positions cache.length ...: taps  # [m, len(target_layer_ids) * hidden]."""
        self.add_contexts([cache], [taps])

    def add_contexts(self, caches: list[DraftCache], taps: list[torch.Tensor]) -> None:
        """Append each cache's new context tokens (taps[j]  # [m_j, len(target_layer_ids) * hidden], at positions
        cache.length ...) with one fc / norm / K-V projection and one write per layer for all of them (the caches
        are slots of one pool, as new_caches makes them)."""
        pool = caches[0].pool
        if any(c.pool is not pool for c in caches):
            raise ValueError("add_contexts needs caches of one pool (DFlashDrafter.new_caches)")
        device = taps[0].device
        lengths = [t.shape[0] for t in taps]
        positions = torch.cat([torch.arange(c.length, c.length + m) for c, m in zip(caches, lengths)]).to(device)
        slots = torch.cat([torch.full((m,), c.slot, dtype=torch.long) for c, m in zip(caches, lengths)]).to(device)
        self.write_context(pool, slots, positions, torch.cat(taps))
        for cache, m in zip(caches, lengths):
            cache.length += m

    def write_context(self, pool: KVPool, slots: torch.Tensor, positions: torch.Tensor, taps: torch.Tensor) -> None:
        """Context K/V of target features taps  # [m, len(target_layer_ids) * hidden] into pool rows (slots, positions)."""
        ctx = self.hidden_norm(self.fc(taps))
        rope = self.rotary(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, rope)
            pool.k[i, slots, positions] = k
            pool.v[i, slots, positions] = v

    def forward(self, cache: DraftCache, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        """Hidden states of the block after the final norm.

        block_embeds  # [block_size, hidden] = target embedding of [root, MASK, ...]; the root sits
        at position `start` and every context token before it is in `cache`. Attention is
        bidirectional within the block and unrestricted over the context (except sliding windows).
        """
        return self.forward_packed([cache], block_embeds[None], [start])[0]

    def forward_packed(self, caches: list[DraftCache], block_embeds: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Blocks of several requests at once: block_embeds  # [R, block_size, hidden] -> same shape."""
        r, b, _ = block_embeds.shape
        device = block_embeds.device
        positions = torch.stack([torch.arange(s, s + b) for s in starts]).to(device)     # [R, b]
        if r > 1 and all(c.pool is caches[0].pool for c in caches):
            # all blocks in one attention call per layer: contexts padded to the longest, padding masked
            host = torch.tensor([[c.slot for c in caches], [c.length for c in caches]]).to(device)
            return self.forward_pooled(caches[0].pool, host[0], host[1], positions, max(c.length for c in caches),
                                       block_embeds)
        return self._forward_layers(block_embeds, positions, caches=caches)

    def forward_pooled(self, pool: KVPool, slots: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                       context: int, block_embeds: torch.Tensor) -> torch.Tensor:
        """Blocks whose contexts are pool rows: slots, lengths  # [R] long (device); positions  # [R, b]; keys
        0..context-1 of each slot are gathered and those >= its length masked. No host reads (static forwards).

        Where our split-KV attention kernel runs (CUDA; draft_attention_kernel) and the pool has room for a block past
        the context bucket, each layer writes the blocks' K/V into the pool after their contexts (rows lengths ..
        lengths + b - 1, free until the next context write, which overwrites them) and the kernel reads everything in
        place: no gather of the contexts, no concatenation, one program per (request, K/V head, key slice)."""
        b = positions.shape[1]
        kernel = draft_attention_kernel(block_embeds.device)
        if kernel is not None and context + b <= pool.k.shape[2]:
            keys = context + b
            key_pos = torch.arange(keys, device=positions.device)
            seen = (key_pos[None, None, :] < (lengths[:, None, None] + b)).expand(positions.shape[0], b, keys)   # [R, b, E]
            masks = {w: seen if w is None else seen & ((positions[:, :, None] - key_pos) < w)
                     for w in set(self.config.sliding_windows)}
            return self._forward_layers(block_embeds, positions, in_place=(kernel, pool, slots, keys, masks))
        masks = {w: self._packed_mask(w, lengths, positions, context) for w in set(self.config.sliding_windows)}
        return self._forward_layers(block_embeds, positions, pooled=(pool, slots, context, masks))

    def _forward_layers(self, block_embeds: torch.Tensor, positions: torch.Tensor, caches: list[DraftCache] | None = None,
                        pooled: tuple | None = None, in_place: tuple | None = None) -> torch.Tensor:
        r, b, _ = block_embeds.shape
        rope = self.rotary(positions.flatten(), block_embeds.dtype)
        h = block_embeds.reshape(r * b, -1)
        prepare = None
        if in_place is not None:
            kernel, pool, slots, keys, masks = in_place
            write_slots, write_pos = slots[:, None].expand(r, b).flatten(), positions.flatten()
            prepare = draft_qkv_kernel(block_embeds.device)
        # each norm computed by the Linear that reads it and each residual added by the Linear before it
        # (ddtree.models.layers.linear: in our kernels' prologue and epilogue where a static pass goes through them)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = NormedRows(layer.input_layernorm, h)
            if prepare is not None:   # the chains and the blocks' K/V writes in one kernel
                q = attn.prepare_block(x, rope, prepare, pool.k[i], pool.v[i], write_slots, write_pos)
            else:
                q, k_block, v_block = attn.project_qkv(x, rope)
            if in_place is not None:   # the blocks' K/V after their contexts, all read where they lie
                if prepare is None:
                    pool.k[i, write_slots, write_pos] = k_block
                    pool.v[i, write_slots, write_pos] = v_block
                out = kernel(q.view(r, b, attn.num_heads, attn.head_dim), pool.k[i], pool.v[i], slots, keys,
                             masks[attn.window], attn.head_dim**-0.5)                                # [R, b, heads, d]
                h = linear(out.reshape(r * b, -1), attn.o_proj, h)
            elif pooled is not None:
                pool, slots, context, masks = pooled
                keys = torch.cat([pool.k[i, slots, :context], k_block.view(r, b, *k_block.shape[1:])], dim=1)
                values = torch.cat([pool.v[i, slots, :context], v_block.view(r, b, *v_block.shape[1:])], dim=1)
                out = sdpa(q.view(r, b, attn.num_heads, attn.head_dim).transpose(1, 2), keys.transpose(1, 2),
                           values.transpose(1, 2), masks[attn.window], attn.head_dim**-0.5).transpose(1, 2)  # [R, b, heads, d]
                h = linear(out.reshape(r * b, -1), attn.o_proj, h)
            else:
                outputs = []
                for j, cache in enumerate(caches):
                    rows = slice(j * b, (j + 1) * b)
                    keys = torch.cat([cache.k[i, : cache.length], k_block[rows]])
                    values = torch.cat([cache.v[i, : cache.length], v_block[rows]])
                    outputs.append(attend(q[rows], keys, values, self._window_mask(attn, cache, positions[j]),
                                          attn.head_dim**-0.5))
                h = linear(torch.cat(outputs).reshape(r * b, -1), attn.o_proj, h)
            h = layer.mlp(NormedRows(layer.post_attention_layernorm, h), h)
        return self.norm(h).reshape(r, b, -1)

    @staticmethod
    def _packed_mask(window: int | None, lengths: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
        """[R, 1, b, context + b] bool: each block sees its own context (padding hidden) and all of its block;
        a sliding-window layer also hides keys `window` or more positions behind the query. lengths  # [R] long"""
        r, b = positions.shape
        device = positions.device
        ctx_pos = torch.arange(context, device=device)
        visible = (ctx_pos[None, None, :] < lengths[:, None, None]).expand(r, b, context)          # [R, b, context]
        if window is not None:
            visible = visible & ((positions[:, :, None] - ctx_pos[None, None, :]) < window)
        if window is None:
            block = torch.ones(r, b, b, dtype=torch.bool, device=device)
        else:
            block = (positions[:, :, None] - positions[:, None, :]) < window
        return torch.cat([visible, block], dim=-1)[:, None]

    @staticmethod
    def _window_mask(attn: DraftAttention, cache: DraftCache, positions: torch.Tensor) -> torch.Tensor | None:
        if attn.window is None:
            return None
        # Sliding-window layer (Qwen3.6 drafters): a key is visible when it lies less than `window`
        # positions behind the query, as in HF's sliding-window rule; the block's own keys stay
        # visible in both directions. (Assumed from the published description; only a trained
        # Qwen3.6 drafter's acceptance can confirm it.)
        key_pos = torch.cat([torch.arange(cache.length, device=positions.device), positions])
        return (positions[:, None] - key_pos[None, :]) < attn.window

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str = "cpu") -> "DFlashDrafter":
        config = DFlashConfig.from_hf(read_config(path))
        with torch.device("meta"):
            model = cls(config)
        state = {k.removeprefix("model."): v for k, v in load_state_dict(path, desc="loading drafter").items()}
        assign_weights(model, state, path)
        model.fuse_projections()
        model.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        logger.info("drafter %s: %d layers, block %d, taps %s, mask id %d", Path(path).name,
                    config.num_hidden_layers, config.block_size, list(config.target_layer_ids), config.mask_token_id)
        return model.to(device=device, dtype=dtype).eval()


def dflash_hf_config(target_hf: dict, num_layers: int, block_size: int, mask_token_id: int,
                     target_layer_ids: list[int] | None = None, layer_types: list[str] | None = None,
                     sliding_window: int | None = None) -> dict:
    """A config.json in the published z-lab layout for a drafter of `target_hf`."""
    heads = target_hf["num_attention_heads"]
    ids = target_layer_ids or default_target_layer_ids(target_hf["num_hidden_layers"], num_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": target_hf["hidden_size"],
        "intermediate_size": target_hf["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target_hf.get("num_key_value_heads", heads),
        "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // heads,
        "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(target_hf),
        "max_position_embeddings": target_hf.get("max_position_embeddings", 8192),
        "vocab_size": target_hf["vocab_size"],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": target_hf["num_hidden_layers"],
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
        "layer_types": layer_types or ["full_attention"] * num_layers,
        "sliding_window": sliding_window,
        "torch_dtype": "float32",
    }


def init_random_drafter(hf_config: dict, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights keyed as the published checkpoint (layers.N.*, fc, hidden_norm, norm)."""
    config = DFlashConfig.from_hf(hf_config)
    generator = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(config)
    state = {}
    for key, tensor in model.state_dict().items():
        if key.endswith("norm.weight"):
            state[key] = torch.ones_like(tensor)
        elif key.endswith(".bias"):
            state[key] = torch.zeros_like(tensor)
        else:
            state[key] = torch.randn(tensor.shape, generator=generator) * std
    return state


def save_drafter(path: str | Path, hf_config: dict, state: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
