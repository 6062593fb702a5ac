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

from ddtree.models.base import TargetModel
from ddtree.models.layers import GatedMLP, RMSNorm, Rotary, apply_rotary, attend
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


class KVCache:
    """Static per-layer K/V for one sequence: [num_layers, max_len, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(num_layers, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len

    def compact(self, start: int, accepted: list[int]) -> None:
        """Move the K/V of accepted tree rows to start + 0..len-1 (accepted[i] >= i, so in place is safe)."""
        if accepted == list(range(len(accepted))):
            return
        src = torch.tensor(accepted, dtype=torch.long, device=self.k.device) + start
        self.k[:, start : start + len(accepted)] = self.k[:, src]
        self.v[:, start : start + len(accepted)] = self.v[:, src]


@dataclass(slots=True)
class Segment:
    """One sequence's rows in a packed forward: its cache, committed length and query mask."""
    cache: KVCache
    start: int
    length: int
    mask: torch.Tensor     # [length, start + length] bool: the prefix, then ancestors among the queries

    @classmethod
    def of(cls, cache: KVCache, start: int, visibility: torch.Tensor) -> "Segment":
        n = visibility.shape[0]
        assert start + n <= cache.max_len, f"cache overflow: {start} + {n} > {cache.max_len}"
        mask = torch.ones(n, start + n, dtype=torch.bool, device=visibility.device)
        mask[:, start:] = visibility
        return cls(cache=cache, start=start, length=n, mask=mask)


class Attention(nn.Module):
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
                layer: int) -> torch.Tensor:
        """Projections for all packed rows at once; attention per segment over its own cache."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        outputs, row = [], 0
        for seg in segments:
            rows = slice(row, row + seg.length)
            end = seg.start + seg.length
            seg.cache.k[layer, seg.start : end] = k[rows]
            seg.cache.v[layer, seg.start : end] = v[rows]
            outputs.append(attend(q[rows], seg.cache.k[layer, :end], seg.cache.v[layer, :end], seg.mask,
                                  self.head_dim**-0.5))
            row += seg.length
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return self.o_proj(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: DenseConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[Segment],
                layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, segments, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def new_cache(self, max_len: int) -> KVCache:
        c, p = self.config, self.embed_tokens.weight
        return KVCache(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                       tap_layers: list[int] | None = None,
                       logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences' query rows packed in one pass (continuous batching); rows follow `segments`."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        taps = {}
        wanted = set(tap_layers or ())
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, segments, i)
            if i in wanted:
                taps[i] = x
        return self.outputs(x, taps, tap_layers, logit_rows)

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
        model.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        logger.info("target %s: %s, %d layers, hidden %d, vocab %d", Path(path).name, config.model_type,
                    config.num_hidden_layers, config.hidden_size, config.vocab_size)
        return model.to(device=device, dtype=dtype).eval()
