"""Target-side token choice: greedy, temperature, top-k, top-p on logits."""

from __future__ import annotations

import torch

from ddtree.sampling_params import SamplingParams


def suppress_tokens(logits: torch.Tensor, token_ids: list[int], rows: torch.Tensor | None) -> torch.Tensor:
    """Set `token_ids` to -inf in the selected rows (min_tokens keeps EOS out early on)."""
    if not token_ids or rows is None or not bool(rows.any()):
        return logits
    logits = logits.clone()
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    sub = logits[rows]
    sub[:, ids] = float("-inf")
    logits[rows] = sub
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from, after temperature, top-k and top-p.

    logits  # [rows, vocab]; returns float32 probabilities of the same shape.
    """
    scaled = logits.float() / max(params.temperature, 1e-5)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
