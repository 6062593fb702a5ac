"""TargetModel: what the engine needs from a target, shared by the dense and the hybrid forward."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.layers import linear


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the device's queued work: on CUDA through pinned memory
    (its block is reused only after the copy), where a pageable copy synchronizes the stream, so that the host would
    sit idle until every kernel before it finished instead of preparing the next ones."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TargetModel(nn.Module):
    """Subclasses set config (with eos_token_ids), embed_tokens, norm, lm_head and define
    forward_packed(input_ids, positions, segments, tap_layers, logit_rows) and new_cache(max_len)."""

    def new_caches(self, slots: int, max_len: int) -> list:
        """One cache per slot (subclasses pool them so that packed forwards batch their attention)."""
        return [self.new_cache(max_len) for _ in range(slots)]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden  # [n, hidden] after the final norm -> [n, vocab]"""
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, start: int,
                visibility: torch.Tensor, tap_layers: list[int] | None = None,
                logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run n query tokens after `start` committed cache entries.

        input_ids, positions  # [n]; visibility  # [n, n] bool among the queries (causal for a prompt)
        Returns logits  # [rows, vocab] and taps  # [n, len(tap_layers) * hidden] (outputs of
        decoder layers `tap_layers`, i.e. HF hidden_states[L + 1]).
        """
        from ddtree.models.dense import Segment

        return self.forward_packed(input_ids, positions, [Segment.of(cache, start, visibility)], tap_layers,
                                   logit_rows)

    def outputs(self, x: torch.Tensor, taps: dict[int, torch.Tensor], tap_layers: list[int] | None,
                logit_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the wanted rows and the concatenated taps, in the order of tap_layers."""
        tapped = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        h = x if logit_rows is None else x[logit_rows]
        return linear(self.norm(h), self.lm_head), tapped
