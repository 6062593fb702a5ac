"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, gated MLP, attention."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ddtree.models import fused, kernels


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

    def prologue(self) -> tuple[str, torch.Tensor]:
        """This norm as a GEMV prologue (ddtree.models.gemv_kernel) and its parameter."""
        return "norm_plain", self.weight


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


def through_gemv(x: torch.Tensor) -> bool:
    """Whether a Linear over x goes through our kernels: one row (an `ar` step at batch 1) or a few (a small tree's,
    a drafter's block; kernels.gemv_max_rows) in a static forward (captured in a CUDA graph), where the kernels run
    (CUDA; ddtree.models.kernels.gemv_kernel)."""
    return (len(x.shape) == 2 and 1 <= x.shape[0] <= kernels.gemv_max_rows() and fused.in_static()
            and kernels.gemv_kernel(x.device) is not None)


class Prologue:
    """A Linear's input not computed yet: the elementwise chain before it (KIND, a ddtree.models.gemv_kernel
    prologue) over x and its operands. linear() computes it in the GEMV's prologue where the row goes through our
    kernel, else eagerly (eager(): the fused.* chain the unfused forward runs)."""
    KIND = ""

    def __init__(self, x: torch.Tensor, a: torch.Tensor | None = None, p: torch.Tensor | None = None,
                 eps: float = 0.0, group: int = 1) -> None:
        self.x, self.a, self.p, self.eps, self.group = x, a, p, eps, group
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device

    def eager(self) -> torch.Tensor:
        raise NotImplementedError

    def kernel_args(self) -> dict:
        return {"prologue": self.KIND, "a": self.a, "p": self.p, "eps": self.eps, "group": self.group}


class NormFeed:
    """The residual stream `add` a product adds its output to, where a zero-centered RMSNorm (`norm`) reads the sum
    next (kernels.norm_parts): linear() passes it as the product's add and, where the rows go through the few-rows
    kernel, has the kernel's epilogue also write y (the sum times the norm's scale) and its partial sums of squares
    (parts), which the NormedRows of that norm then hands to the product reading it (gemv_kernel.linear_rows'
    norm_out, norm_in)."""

    def __init__(self, add: torch.Tensor, norm: nn.Module) -> None:
        assert norm.prologue()[0] == "norm", "a zero-centered RMSNorm (its output rounded once, after the scale)"
        self.add, self.norm = add, norm
        self.y: torch.Tensor | None = None
        self.parts: torch.Tensor | None = None


class NormedRows(Prologue):
    """norm(x) of a layer's residual stream x (RMSNorm or Qwen3.5's zero-centered form: norm.prologue()); feed: the
    NormFeed x was written through, if any (its y and parts, where the product before computed them)."""

    def __init__(self, norm: nn.Module, x: torch.Tensor, feed: NormFeed | None = None) -> None:
        kind, p = norm.prologue()
        super().__init__(x, None, p, norm.eps)
        self.KIND, self.norm = kind, norm
        self.fed = feed if feed is not None and feed.parts is not None else None

    def eager(self) -> torch.Tensor:
        return self.norm(self.x)


class SiluMul(Prologue):
    KIND = "silu_mul"

    def eager(self) -> torch.Tensor:
        return fused.silu_mul(self.x, self.a)


class SigmoidGated(Prologue):
    """x [n, K] * sigmoid(gate), gate [n, K // d, d] (a strided view)."""
    KIND = "sigmoid_gate"

    def __init__(self, x: torch.Tensor, gate: torch.Tensor) -> None:
        super().__init__(x, gate, group=gate.shape[-1])

    def eager(self) -> torch.Tensor:
        if kernels.prologue_views():   # the gate read where it lies, x viewed as its [n, K // d, d]
            return fused.sigmoid_gate(self.x.reshape(self.a.shape), self.a).reshape(self.x.shape[0], -1)
        return fused.sigmoid_gate(self.x, self.a.reshape(self.x.shape[0], -1))


class GatedNormed(Prologue):
    """norm(o, z) over each group of `group` columns (a GatedRMSNorm with .weight and .eps): o, z  # [n, K]."""
    KIND = "gated_norm"

    def __init__(self, norm: nn.Module, o: torch.Tensor, z: torch.Tensor, group: int) -> None:
        super().__init__(o, z, norm.weight, norm.eps, group)
        self.norm = norm

    def eager(self) -> torch.Tensor:
        n = self.x.shape[0]
        if kernels.prologue_views():   # [n, K // group, group] views: z (a column slice) read where it lies
            return self.norm(self.x.unflatten(1, (-1, self.group)), self.a.unflatten(1, (-1, self.group))).reshape(n, -1)
        return self.norm(self.x.reshape(-1, self.group), self.a.reshape(-1, self.group)).reshape(n, -1)


def linear(x: torch.Tensor | Prologue, module: nn.Linear, add: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """[add +] module(x), x a tensor or a Prologue; in a static forward on CUDA (through_gemv) one row through our
    GEMV kernel with the prologue and the add in it (ddtree.models.gemv_kernel: cuBLAS streams these weights ~8%
    slower on the H200, and each prologue or add is a kernel less), a few through its few-rows kernel with the add in
    it (the prologue's chain before it). glu (a few rows through the few-rows kernel only; kernels.rows_glu): module is a
    gated MLP's fused gate/up and the output silu(gate) * up, from the kernel's epilogue. add a NormFeed, or x a
    NormedRows fed by one (kernels.norm_parts): a few rows take the norm across the two products' epilogues."""
    feed = add if isinstance(add, NormFeed) else None
    add = feed.add if feed is not None else add
    if module.bias is None and through_gemv(x):
        kernel = kernels.gemv_kernel(x.device)
        if isinstance(x, Prologue) and x.shape[0] == 1:
            return kernel(x.x.contiguous(), module.weight, **x.kernel_args(), add=add)
        fed = x.fed if isinstance(x, NormedRows) else None
        extra = {} if fed is None else {"norm_in": fed.parts, "eps": x.eps}
        rows = fed.y if fed is not None else materialize(x).contiguous()
        if feed is None or x.shape[0] == 1:   # one row: the norm in the GEMV's prologue after all
            return kernel(rows, module.weight, add=add, glu=glu, **extra)
        out, feed.y, feed.parts = kernel(rows, module.weight, add=add, glu=glu, norm_out=feed.norm.prologue()[1], **extra)
        return out
    assert not glu, "glu: only through the few-rows kernel"
    out = module(materialize(x))
    return out if add is None else add + out


def materialize(x: torch.Tensor | Prologue) -> torch.Tensor:
    """x itself, or a Prologue's input computed eagerly (its fused.* chain)."""
    return x.eager() if isinstance(x, Prologue) else x


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
            x = materialize(x)
            return tuple(getattr(self, name)(x) for name in self.PROJECTIONS)
        return linear(x, fused).split(self.fused_sizes, dim=-1)


class GatedMLP(FusedProjections, nn.Module):
    PROJECTIONS = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor | Prologue, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output [plus the residual stream, added in the down projection's epilogue]."""
        fused_proj = getattr(self, "fused_proj", None)
        if (fused_proj is not None and fused_proj.bias is None and x.shape[0] > 1 and kernels.rows_glu()
                and through_gemv(x)):   # silu(gate) * up in the few-rows kernel's epilogue (kernels.rows_glu)
            return linear(linear(x, fused_proj, glu=True), self.down_proj, residual)
        gate, up = self.project(x)
        return linear(SiluMul(gate, up), self.down_proj, residual)


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


# Masked eager attention on CUDA goes without cuDNN's backend, which PyTorch picks for a masked GQA call in bf16 on
# the H200: it builds a plan for every new shape, 57-85 ms and up to 1.7 s at a new length against 0.3-0.5 ms for the
# call after (perf/results/sdpa_probe_h200.md), so every prompt of a length not seen before paid that in its prefill;
# the form here paid 0.24 ms (sdpa_probe_h200_forms.md). A static forward's calls keep PyTorch's choice: their shapes
# are a bucket's (a plan built once, at capture), and cuDNN ran the embedded default's verify rows 0.4 ms a round
# faster than the repeated form (humaneval_h200_sdparep.md vs _sdpacudnn.md). In fp32 cuDNN never runs, so a static
# forward still computes what the dynamic one does there. DDTREE_SDPA_CUDNN=1 (a diagnostic) leaves every choice to
# PyTorch.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def repeats_kv(cuda: bool) -> bool:
    """Whether a masked call takes the repeated form: eager on CUDA (outside a static forward's body), unless
    DDTREE_SDPA_CUDNN is set."""
    return cuda and not fused.in_static() and os.environ.get("DDTREE_SDPA_CUDNN", "0") in ("", "0")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         repeat_kv: bool | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention with K/V heads shared by groups of query heads (GQA); q  # [B, heads, Q, d];
    k, v  # [B, kv_heads, K, d]; mask broadcastable to [B, heads, Q, K], bool (True = visible). repeat_kv (None:
    a masked eager call on CUDA, DDTREE_SDPA_CUDNN unset): the K/V heads repeated for the fused kernels (they take no
    GQA broadcast), through SDPA_BACKENDS (no cuDNN). Eager calls (prefills, the dynamic forward) meet a new shape at
    every prompt length, and cuDNN builds a plan per shape (57 ms-1.7 s on the H200: perf/sdpa_probe.py); a static
    forward's shapes are its bucket's, so its calls keep PyTorch's choice (cuDNN, its plan built once at capture,
    the faster kernel for a tree's rows: humaneval_h200_sdparep.md against _sdpacudnn.md)."""
    if repeat_kv is None:
        repeat_kv = mask is not None and repeats_kv(q.is_cuda)
    gqa = q.shape[1] != k.shape[1]
    if not repeat_kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q  # [n, heads, d]; k, v  # [m, kv_heads, d]; mask  # [n, m] bool (True = visible)."""
    out = sdpa(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
               None if mask is None else mask[None, None], scale)
    return out[0].transpose(0, 1)  # [n, heads, d]
