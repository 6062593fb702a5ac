"""A test drafter that knows the target's greedy continuation, so trees are partly accepted.

Random-weight drafters almost never match a random target, which would leave the acceptance
walk, KV compaction and tap gathering untested. This engine keeps the real DFlash drafter call
(so its code runs) but replaces its logits by noisy ones whose top ranks hold the target's own
greedy continuation at a random rank, computed by the transformers reference model.
"""

from __future__ import annotations

import torch

from ddtree.engine import Engine


class OracleDraftEngine(Engine):
    def __init__(self, *args, reference=None, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.noise = torch.Generator().manual_seed(seed)

    def draft_logits(self, hidden: torch.Tensor, request) -> torch.Tensor:
        real = super().draft_logits(hidden, request)   # keep the drafter's own computation in the path
        depth, vocab = real.shape
        ids = torch.tensor([request.prompt_ids + request.output_ids])
        continuation = []
        with torch.no_grad():
            for _ in range(depth):
                token = int(self.reference(ids).logits[0, -1].argmax())
                continuation.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        logits = torch.randn(depth, vocab, generator=self.noise)
        for d, token in enumerate(continuation):
            u = float(torch.rand((), generator=self.noise))
            if u < 0.6:      # the drafter is right: rank 0
                logits[d, token] = logits[d].max() + 3.0
            elif u < 0.85:   # right but not first: rank 1 or 2, only a tree finds it
                logits[d, token] = torch.topk(logits[d], 3).values[-1] + 0.01
            # else: the drafter is wrong at this depth
        return logits.to(real.dtype)
