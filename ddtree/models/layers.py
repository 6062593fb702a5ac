"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, gated MLP, attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 and rounded to x's dtype, then scaled (HF's order); one fused kernel on CUDA
        return fused.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)) in one chain; h None: (x, norm(x))."""
        return (x, self(x)) if h is None else fused.add_rms_norm(x, h, self.weight, self.eps)


class Derived:
    """A tensor computed from a parameter and kept until the parameter changes (new storage or an in-place write):
    a serving-time constant such as 1 + weight in float32 costs no kernel per call (nor a node per graph)."""

    def __init__(self, fn) -> None:
        self.fn, self.key, self.value = fn, None, None

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        key = (param.data_ptr(), param._version, param.device, param.dtype)
        if key != self.key:
            self.value, self.key = self.fn(param), key
        return self.value


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose outputs are the given Linears' outputs side by side (one GEMM instead of several: at batch 1
    each projection is a launch-bound GEMV). Same weights, concatenated; the inputs must agree."""
    first = linears[0]
    bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if bias:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused.requires_grad_(first.weight.requires_grad)


class FusedProjections:
    """Mixin for an nn.Module whose Linears named in PROJECTIONS all read the same input: fuse() serves them as one
    GEMM (targets, after loading the checkpoint's names; the drafter keeps its published layout for training);
    project(x) returns their outputs either way, in PROJECTIONS order."""
    PROJECTIONS: tuple[str, ...] = ()

    def fuse(self) -> None:
        linears = [getattr(self, name) for name in self.PROJECTIONS]
        self.fused_proj = fuse_linears(*linears)
        self.fused_sizes = [m.out_features for m in linears]
        for name in self.PROJECTIONS:
            delattr(self, name)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fused = getattr(self, "fused_proj", None)
        if fused is None:
            return tuple(getattr(self, name)(x) for name in self.PROJECTIONS)
        return fused(x).split(self.fused_sizes, dim=-1)


class GatedMLP(FusedProjections, nn.Module):
    PROJECTIONS = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down_proj(fused.silu_mul(gate, up))


class Rotary(nn.Module):
    """Rotary embedding (rotate-half layout) with default, linear and llama3 frequency rules."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.position_scale = 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "linear":
                self.position_scale = 1.0 / float(scaling["factor"])
            elif kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            else:
                raise NotImplementedError(f"rope scaling {kind!r} is not supported")
        # A plain attribute, not a buffer: .to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin  # [n, head_dim]"""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = (positions.float() * self.position_scale)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x  # [..., n, heads, head_dim]; cos, sin  # [..., n, head_dim]"""
    return fused.rotary(x, cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q  # [n, heads, d]; k, v  # [m, kv_heads, d]; mask  # [n, m] bool (True = visible)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=None if mask is None else mask[None, None], scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)  # [n, heads, d]
