"""The token ids a drafter may propose (EngineConfig.draft_vocab), as FR-Spec and SGLang's speculative token maps do.

A DFlash drafter has no output matrix of its own: its logits come from the target's lm_head, which at Qwen3.6's
248,320 rows is 2.5 GB at 27B dims, read once per drafting round (0.6 ms of the H200, 3% of a `ddtree-16` round:
perf/results/gpu_ratios_h200_swap17.md). BPE vocabularies number their tokens in merge order, the frequent ones
first, so a prefix of the ids keeps most of what a model writes while the draft reads a fraction of those rows. The
target's EOS ids are kept whatever their number, so the drafter can still propose the end of a turn.

Lossless whatever the subset: the target verifies every proposal, and neither greedy nor sampled acceptance reads
draft probabilities (ddtree.verify). A token outside the subset is still written, as a round's bonus token; what the
subset costs is acceptance where the target's next token lies outside it (perf/draft_vocab.py measures both).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class DraftVocab:
    """size 0 (or at least the lm_head's rows): the whole vocabulary; else ids [0, size) and the EOS ids above them.
    Draft logits are over this subset ([..., width]); token_ids maps a position in it back to the target's id."""

    def __init__(self, rows: int, size: int, eos_ids: set[int] | list[int], device: torch.device) -> None:
        # size >= 0: EngineConfig checks it
        self.full = size == 0 or size >= rows
        self.size = rows if self.full else size
        extra = [] if self.full else sorted({t for t in eos_ids if size <= t < rows})
        self.width = self.size + len(extra)
        self.extra = torch.tensor(extra, dtype=torch.long, device=device)
        ids = torch.cat([torch.arange(self.size, dtype=torch.long), torch.tensor(extra, dtype=torch.long)])
        self.ids = None if self.full else ids.to(device)
        self.ids_host = None if self.full else ids.numpy()

    def logits(self, lm_head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> the subset's logits [..., width] (the lm_head's first `size` rows, then the EOS
        rows above them)."""
        if self.full:
            return lm_head(hidden)
        weight, bias = lm_head.weight, lm_head.bias
        out = F.linear(hidden, weight[: self.size], None if bias is None else bias[: self.size])
        if self.extra.numel():
            tail = F.linear(hidden, weight[self.extra], None if bias is None else bias[self.extra])
            out = torch.cat([out, tail], dim=-1)
        return out

    def token_ids(self, index: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """Positions in the subset (a top-k's indices, on the device or the host) -> the target's token ids."""
        if self.full:
            return index
        return self.ids[index] if isinstance(index, torch.Tensor) else self.ids_host[index]


__all__ = ["DraftVocab"]
