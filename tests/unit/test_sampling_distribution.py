"""Sampling with ddtree / dflash draws from the target's own distribution (tiny vocabulary).

The exact probability of every 4-token continuation is computed by enumeration with the
transformers reference model; continuations sampled through each mode must fit it under a
chi-square test at significance 1e-3 (outcomes with expected count < 5 are pooled).
The samples are requests decoded BATCH at a time in one engine (continuous batching: each one's
rounds packed with the others', each drawing from its own seeded generator), arriving as others
finish. Seeds are fixed, so the test is deterministic. A plausible acceptance bug (the target's
most likely token taken without sampling where the tree holds it) fails it.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ddtree import verify
from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter
from ddtree.request import Request
from ddtree.sampling import probabilities, sample
from ddtree.sampling_params import SamplingParams

VOCAB, LENGTH, SAMPLES = 6, 4, 2500
BATCH = 16   # requests decoded together
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyvocab")
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)   # a skewed but not degenerate distribution
    model.save_pretrained(root / "target")
    hf = dflash_hf_config(model.config.to_dict(), num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    save_drafter(root / "dflash", hf, init_random_drafter(hf, seed=5))
    reference = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    engine = Engine(EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"),
                                 max_model_len=64, max_tree_budget=64, max_num_seqs=BATCH))
    return engine, reference


def exact_distribution(reference, params: SamplingParams) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(LENGTH):
            nxt = {}
            for seq, p in probs.items():
                logits = reference(torch.tensor([PROMPT + list(seq)])).logits[0, -1]
                q = probabilities(logits[None], params)[0].double()
                for token in range(VOCAB):
                    if q[token] > 0:
                        nxt[seq + (token,)] = p * float(q[token])
            probs = nxt
    return probs


def chi_square_critical(dof: int, alpha_z: float = 3.09) -> float:
    """Upper 1e-3 quantile of chi-square(dof) by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3


def sampled(engine, mode: str, budget: int, knobs: dict) -> list[Request]:
    """SAMPLES requests of PROMPT, BATCH decoding together, each next one arriving as one finishes."""
    requests = [Request(request_id=f"s{i}", prompt_ids=list(PROMPT),
                        params=SamplingParams(max_tokens=LENGTH, mode=mode, tree_budget=budget, seed=1000 + i, **knobs))
                for i in range(SAMPLES)]
    pending, batches = requests[::-1], set()
    while pending or engine.has_work:
        while pending and len(engine.waiting) + len(engine.running) < BATCH:
            engine.add(pending.pop())
        engine.step()
        batches.add(len(engine.running))   # after the step: those it did not finish
    assert max(batches) >= BATCH // 2, batches   # decoded together, not one at a time
    return requests


def chi_square(requests: list[Request], exact: dict[tuple[int, ...], float]) -> tuple[float, float, int]:
    """The samples' chi-square statistic against the exact distribution, its 1e-3 critical value, its cells."""
    counts: dict[tuple[int, ...], int] = {}
    for request in requests:
        key = tuple(request.output_ids)
        counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == SAMPLES and set(counts) <= set(exact), "sampled a token outside the support"
    big = {k for k, p in exact.items() if p * SAMPLES >= 5}
    cells = [(counts.get(k, 0), exact[k] * SAMPLES) for k in big]
    rest_obs = SAMPLES - sum(o for o, _ in cells)
    rest_exp = SAMPLES - sum(e for _, e in cells)
    if rest_exp >= 5:
        cells.append((rest_obs, rest_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, chi_square_critical(len(cells) - 1), len(cells)


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["t1", "t07-topk4-topp09"])
@pytest.mark.parametrize("mode,budget", [("ar", 1), ("dflash", 1), ("ddtree", 16)])
def test_sampled_continuations_follow_target(tiny_vocab, knobs, mode, budget):
    engine, reference = tiny_vocab
    requests = sampled(engine, mode, budget, knobs)
    stat, critical, cells = chi_square(requests, exact_distribution(reference, SamplingParams(**knobs)))
    assert stat < critical, f"{mode} budget {budget} {knobs}: chi2 {stat:.1f} >= {critical:.1f} ({cells} cells)"
    if mode != "ar":
        # speculation really happened: fewer rounds than tokens after the first
        rounds = sum(len(request.acceptance_lengths) for request in requests)
        assert rounds < SAMPLES * (LENGTH - 1), f"{mode}: no draft token was ever accepted"


def test_a_biased_acceptance_rule_fails_the_test(tiny_vocab, monkeypatch):
    """The test's power: an acceptance walk that takes the target's most likely token without sampling wherever the
    tree holds it (a greedy shortcut inside sampling) skews the continuations, and the chi-square sees it."""
    def biased(tree, logits, params, generator):
        node, accepted = 0, [0]
        while True:
            probs = probabilities(logits[node : node + 1], params)[0]
            child = tree.children[node].get(int(probs.argmax()))
            if child is None:
                token = sample(probs, generator)
                child = tree.children[node].get(token)
                if child is None:
                    return verify.Acceptance(accepted=accepted, bonus_token=token)
            node = child
            accepted.append(node)

    engine, reference = tiny_vocab
    monkeypatch.setattr(verify, "accept_sampled", biased)
    knobs = dict(temperature=1.0)
    stat, critical, cells = chi_square(sampled(engine, "ddtree", 16, knobs),
                                       exact_distribution(reference, SamplingParams(**knobs)))
    assert stat >= critical, f"the biased rule passed: chi2 {stat:.1f} < {critical:.1f} ({cells} cells)"
