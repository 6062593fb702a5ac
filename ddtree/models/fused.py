"""The elementwise chains between a layer's matrix products, each one function: compiled on CUDA, plain torch elsewhere.

At batch 1 a 27B step is weight-streaming GEMVs plus ~42 small kernels per layer (norms with their casts,
rotary halves, gates, the conv window, silu * up), measured on an H200 at ~5 ms of a 19.7 ms step
(perf/results/gpu_ratios_h200.md). Each function here is one such chain; on CUDA tensors it runs through
torch.compile (inductor), which fuses the chain into one or two kernels that the CUDA graphs of the static
forwards then capture like any other. Off CUDA (the CPU tests, the fp32 lossless checks) the same function
runs eagerly, so the math the tests check is the math the GPU compiles.

Only a static forward's body compiles them (`with fused.static():`, ddtree.models.graphs.GraphPool.run): a
compiled function checks its guards on every call (~20 us of host time each, ~20 ms for a 27B forward), which a
CUDA graph pays once at capture and a dynamic forward (a prompt's prefill) would pay every time.

`emulate_precision_casts` keeps inductor's numerics those of eager (it rounds where eager rounds to bf16),
so a compiled forward decodes what the eager one does up to kernel-order effects, as any kernel change.
`DDTREE_COMPILE=0` turns compilation off (perf/gpu_ratios.py measures both); with `DDTREE_PDL=1` on Hopper
(kernels.pdl) the chains compile with inductor's triton.enable_pdl (chain_pdl), a second compiled form beside the
first. The first call of each chain for a new shape compiles it (a few seconds, cached on disk by inductor): the
static forwards' first run, which is their warm-up before capture, pays that.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64   # shapes per chain: row counts (automatic dynamic after the second), model widths, eps values


_here = threading.local()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64, everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def enabled() -> bool:
    return os.environ.get("DDTREE_COMPILE", "1") not in ("0", "", "off")


def in_static() -> bool:
    """Whether a static forward's body is running (its kernels go into a CUDA graph: launches cost nothing per call)."""
    return getattr(_here, "on", False)


@contextlib.contextmanager
def static():
    """Within: the chains compile (for CUDA tensors); a static forward's body runs in here."""
    before = getattr(_here, "on", False)
    _here.on = True
    try:
        yield
    finally:
        _here.on = before


@functools.cache
def _inductor_pdl() -> bool:
    """Whether this torch's inductor takes the option triton.enable_pdl (its kernels launched with PDL, each waiting
    on the grid before it where it reads what that grid wrote); logged once where it does not."""
    from torch._inductor import config as inductor_config

    if "triton.enable_pdl" in inductor_config.get_config_copy():
        return True
    logger.warning("DDTREE_PDL: torch %s's inductor has no triton.enable_pdl: the compiled chains launch without PDL",
                   torch.__version__)
    return False


def chain_pdl(device: torch.device) -> bool:
    """Whether the chains compiled for `device` launch with PDL: where our kernels do (kernels.pdl, DDTREE_PDL read at
    each call), inductor can, and DDTREE_PDL_CHAINS is not 0 (our kernels with PDL, the chains without: gpu_ratios'
    variant static-pdlours)."""
    from ddtree.models import kernels

    return (kernels.pdl(device) and os.environ.get("DDTREE_PDL_CHAINS", "1") not in ("", "0")
            and _inductor_pdl())


def fused(fn: Callable) -> Callable:
    """fn compiled for CUDA tensors (its first argument decides) within `static()`, fn itself otherwise; compiled
    once per PDL setting (chain_pdl, chosen at each call: a graph captured under DDTREE_PDL=1 holds PDL launches)."""
    compiled: dict[bool, Callable] = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if not (args[0].is_cuda and getattr(_here, "on", False) and enabled()) or torch.is_grad_enabled():
            return fn(*args)   # off CUDA, outside static forwards, or training (eager autograd)
        use_pdl = chain_pdl(args[0].device)
        if use_pdl not in compiled:
            from torch._dynamo import config as dynamo_config
            from torch._inductor import config as inductor_config

            inductor_config.emulate_precision_casts = True
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            compiled[use_pdl] = (torch.compile(fn, fullgraph=True, options={"triton.enable_pdl": True}) if use_pdl
                                 else torch.compile(fn, fullgraph=True))
            logger.info("compiling %s for CUDA (torch.compile, inductor%s)", fn.__name__, ", PDL" if use_pdl else "")
        return compiled[use_pdl](*args)

    wrapper.eager = fn
    return wrapper


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x), normalised in float32 and rounded to x's dtype before the scale (HF's order)."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


@fused
def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding h, and its rms_norm (the add fused into the next layer's norm)."""
    x = x + h
    return x, weight * F.rms_norm(x, (x.shape[-1],), None, eps)


@fused
def add_zero_centered_rms_norm(x: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + h
    return x, F.rms_norm(x.float(), (x.shape[-1],), scale, eps).type_as(x)


@fused
def zero_centered_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * scale in float32, rounded to x's dtype (Qwen3.5: scale = 1 + weight, in float32)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).type_as(x)


@fused
def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(o) * weight * silu(z), in o's dtype (Qwen3.5's Gated DeltaNet output norm, per value head)."""
    return ((weight * F.rms_norm(o, (o.shape[-1],), None, eps)) * F.silu(z.float())).to(o.dtype)


@fused
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@fused
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over x's last dim. x  # [..., n, heads, d]; cos, sin  # [..., n, d]"""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


@fused
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos, sin)


@fused
def rms_norm_rotary(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head q/k norm, then rotary (Qwen3's attention)."""
    return _rotate(weight * F.rms_norm(x, (x.shape[-1],), None, eps), cos, sin)


@fused
def zero_centered_norm_partial_rotary(x: torch.Tensor, scale: torch.Tensor, eps: float, cos: torch.Tensor,
                                      sin: torch.Tensor) -> torch.Tensor:
    """Per-head zero-centered q/k norm, then rotary over the first cos.shape[-1] dims of each head (Qwen3.5)."""
    x = F.rms_norm(x.float(), (x.shape[-1],), scale, eps).type_as(x)
    r = cos.shape[-1]
    return torch.cat([_rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)


@fused
def gdn_gates(b: torch.Tensor, a: torch.Tensor, decay_rate: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) [n, hv]; g = decay_rate * softplus(a + dt_bias) in float32 (log decay, decay_rate = -exp(A_log))."""
    return torch.sigmoid(b), decay_rate * F.softplus(a.float() + dt_bias)


@fused
def gdn_gates_into(b: torch.Tensor, a: torch.Tensor, decay_rate: torch.Tensor, dt_bias: torch.Tensor,
                   beta_out: torch.Tensor, g_out: torch.Tensor) -> None:
    """gdn_gates written into beta_out and g_out (a tree batch's commit stash, as conv_windows_into)."""
    beta, g = gdn_gates.eager(b, a, decay_rate, dt_bias)
    beta_out.copy_(beta)
    g_out.copy_(g)


@fused
def conv_windows(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over each node's window (ddtree.models.gdn.conv_tree, which checks the shapes):
    x  # [N, C]; conv_state, weight  # [C, K]; window  # [N, K] indices into cat(conv_state.T, x)."""
    dtype = compute_dtype(x)
    src = torch.cat([conv_state.transpose(0, 1).to(dtype), x.to(dtype)])
    return _conv_silu(src[window], weight, x.dtype)


@fused
def conv_windows_into(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                      out: torch.Tensor, x_out: torch.Tensor) -> None:
    """conv_windows written into out [N, C'] (C' = C), and x copied into x_out [N, C]: a tree batch's commit stash
    (ddtree.models.gdn.ReplayStash) filled by the conv's own kernel instead of copies after it."""
    out.copy_(conv_windows.eager(x, conv_state, weight, window))
    x_out.copy_(x)


@fused
def conv_windows_pooled_into(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                             window: torch.Tensor, out: torch.Tensor, x_out: torch.Tensor) -> None:
    """conv_windows_into with the committed windows read from a recurrent pool's layer view conv_pool [S, C, K] at
    slots [R] (window index r * K + i < R * K: slot r's i-th committed input): the gather and the transpose happen in
    the conv's own kernel (two copy kernels per GDN layer less in a tree batch's verify)."""
    committed = conv_pool[slots].permute(1, 0, 2).reshape(conv_pool.shape[1], -1)   # [C, R * K]
    conv_windows_into.eager(x, committed, weight, window, out, x_out)


@fused
def conv_steps(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One committed token per sequence: the conv + SiLU output [R, C] and the shifted windows [R, C, K].
    x  # [R, C]; conv_states  # [R, C, K]; weight  # [C, K]. Each window is conv_windows' for a root node (the last
    K - 1 committed inputs, then x), summed in the same layout and order."""
    dtype = compute_dtype(x)
    shifted = torch.cat([conv_states[:, :, 1:], x[:, :, None].to(conv_states.dtype)], dim=2)       # [R, C, K]
    windows = torch.cat([conv_states[:, :, 1:].to(dtype), x[:, :, None].to(dtype)], dim=2).transpose(1, 2)
    return _conv_silu(windows, weight, x.dtype), shifted


@fused
def conv_steps_pooled(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_steps with the committed windows read from a recurrent pool's layer view conv_pool [S, C, K] at slots [R]
    (the gather in the conv's own kernel)."""
    return conv_steps.eager(x, conv_pool[slots], weight)


def _conv_silu(windows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SiLU of each window [..., K, C] weighted by weight [C, K] and summed over K (in the windows' dtype), in dtype."""
    return F.silu((windows * weight.to(windows.dtype).transpose(0, 1)).sum(dim=-2)).to(dtype)


@fused
def shifted_window(conv_state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """conv_state [C, K] after one committed input x [1, C]."""
    return torch.cat([conv_state[:, 1:], x.transpose(0, 1).to(conv_state.dtype)], dim=1)


__all__ = ["add_rms_norm", "add_zero_centered_rms_norm", "chain_pdl", "compute_dtype", "conv_steps", "conv_steps_pooled",
           "conv_windows", "conv_windows_into", "conv_windows_pooled_into", "enabled", "fused", "gated_rms_norm",
           "gdn_gates", "gdn_gates_into", "in_static", "rms_norm", "rms_norm_rotary", "rotary", "shifted_window", "sigmoid_gate",
           "silu_mul", "static", "zero_centered_norm_partial_rotary", "zero_centered_rms_norm"]
