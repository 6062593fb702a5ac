"""The DFlash training objective: many blocks per sequence predicted in one non-causal pass.

For an anchor at position a, the block holds [x_a, MASK, ..., MASK] at positions a..a+B-1; its
queries see the context K/V of every position before a (target taps through fc -> hidden_norm)
and the block's own K/V in both directions; slot k (1..B-1) predicts x_{a+k}. This is the
drafter's serving forward (`DFlashDrafter.forward_packed`) with all blocks of a batch side by
side under one attention mask; tests check the two agree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.dflash import DFlashDrafter
from ddtree.models.layers import apply_rotary


def block_mask(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None) -> torch.Tensor:
    """Visibility [B, K*bs, T + K*bs] (True = visible) for anchors  # [B, K]."""
    b, k = anchors.shape
    device = anchors.device
    q_pos = (anchors[:, :, None] + torch.arange(block_size, device=device)).reshape(b, k * block_size)
    q_block = torch.arange(k, device=device).repeat_interleave(block_size)
    ctx_pos = torch.arange(context_len, device=device)
    sees_ctx = ctx_pos[None, None, :] < anchors.repeat_interleave(block_size, dim=1)[:, :, None]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)
    if window is not None:
        sees_ctx = sees_ctx & ((q_pos[:, :, None] - ctx_pos[None, None, :]) < window)
        sees_block = sees_block & ((q_pos[:, :, None] - q_pos[:, None, :]) < window)
    return torch.cat([sees_ctx, sees_block], dim=2)


class BlockDiffusionModel(nn.Module):
    """Wraps a DFlashDrafter for training (the unit DistributedDataParallel wraps)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, taps: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """taps  # [B, T, n_taps*H]; block_embeds  # [B, K, bs, H]; anchors  # [B, K] -> [B, K, bs, H]."""
        d = self.drafter
        b, k, bs, hidden = block_embeds.shape
        t = taps.shape[1]
        ctx = d.hidden_norm(d.fc(taps))
        ctx_rope = d.rotary(torch.arange(t, device=taps.device), ctx.dtype)
        q_pos = (anchors[:, :, None] + torch.arange(bs, device=taps.device)).reshape(-1)
        cos, sin = d.rotary(q_pos, ctx.dtype)
        block_rope = (cos.view(b, k * bs, -1), sin.view(b, k * bs, -1))
        masks = {w: block_mask(anchors, bs, t, w)[:, None] for w in set(d.config.sliding_windows)}
        h = block_embeds.reshape(b, k * bs, hidden)
        for layer in d.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rotary(attn.q_norm(attn.q_proj(x).view(b, k * bs, attn.num_heads, attn.head_dim)), *block_rope)
            k_ctx, v_ctx = self._kv(attn, ctx, ctx_rope)
            k_blk, v_blk = self._kv(attn, x, block_rope)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat([k_ctx, k_blk], 1).transpose(1, 2),
                torch.cat([v_ctx, v_blk], 1).transpose(1, 2), attn_mask=masks[attn.window],
                scale=attn.head_dim**-0.5, enable_gqa=attn.num_heads != attn.num_kv_heads)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, k * bs, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return d.norm(h).view(b, k, bs, hidden)

    @staticmethod
    def _kv(attn, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        key = attn.k_norm(attn.k_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim))
        return apply_rotary(key, *rope), attn.v_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim)


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..B-1: early slots decide acceptance, so they weigh most."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if math.isfinite(gamma) else torch.ones_like(k)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """logits  # [B, K, bs-1, V]; labels  # [B, K, bs-1] (-100 = past the sequence's end).

    Returns the weighted cross-entropy and, for logging, slot-1 accuracy and the greedy
    acceptance length a chain draft of this block would get (1 + the run of correct slots).
    """
    valid = labels >= 0
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.clamp(min=0).flatten(), reduction="none")
    w = weights.view(1, 1, -1) * valid
    loss = (ce.view_as(labels) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        run = torch.cumprod(correct.int(), dim=-1).sum(-1)      # leading correct slots per block
        stats = {"acc1": correct[..., 0].float().sum().item() / max(valid[..., 0].sum().item(), 1),
                 "tau_chain": 1.0 + run.float().mean().item()}
    return loss, stats
