"""A test drafter that knows the target's greedy continuation, so trees are partly accepted.

Random-weight drafters almost never match a random target, which would leave the acceptance
walk, KV compaction and tap gathering untested. This engine keeps the real DFlash drafter call
(so its code runs) but replaces its logits by noisy ones whose top ranks hold the target's own
greedy continuation at a random rank, computed by the transformers reference model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.engine import Engine
from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter

VOCAB = 96   # tiny hybrid checkpoints (make_tiny_hybrid)


def serve_together(engine: Engine, requests: list) -> list[list[int]]:
    """The requests added at once (admitted in one step where slots allow), stepped to the end: their output ids."""
    for request in requests:
        engine.add(request)
    while engine.has_work:
        engine.step()
    return [request.output_ids for request in requests]


def make_tiny_hybrid(root: Path):
    """A 4-layer Qwen3.5 hybrid (3 GDN + 1 gated attention) saved by transformers, and a 1-layer random DFlash
    drafter for it: returns (root, transformers reference model in float32). Norms and gates are perturbed
    (they start at 0 / 1) and logits sharpened, so every part of the layer matters."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(root / "target")
    hf = json.loads((root / "target" / "config.json").read_text())
    drafter_hf = dflash_hf_config(hf, num_layers=1, block_size=8, mask_token_id=VOCAB - 1)
    save_drafter(root / "dflash", drafter_hf, init_random_drafter(drafter_hf, seed=1))
    return root, AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()


class OracleDraftEngine(Engine):
    def __init__(self, *args, reference=None, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.noise = torch.Generator().manual_seed(seed)

    def draft_logits(self, hidden: torch.Tensor, requests) -> torch.Tensor:
        real = super().draft_logits(hidden, requests)   # keep the drafter's own computation in the path
        return torch.stack([self._noisy_continuation(real[j], request) for j, request in enumerate(requests)])

    def _noisy_continuation(self, real: torch.Tensor, request) -> torch.Tensor:
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
        return logits.to(device=real.device, dtype=real.dtype)
