"""Engine behaviour around the loop: limits, stop tokens, compaction, prompt checks."""

from __future__ import annotations

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine import Engine, StageTimes
from ddtree.errors import InvalidRequest
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, compile_tree, top_log_probs


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                               drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=64))


def test_prompt_limits(engine):
    with pytest.raises(InvalidRequest, match="shorter than the context"):
        engine.generate_ids(list(range(64)), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.generate_ids([], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="token ids must be in"):
        engine.generate_ids([1, 10**6], SamplingParams(max_tokens=4))


def test_length_is_capped_by_context(engine):
    request = engine.generate_ids(list(range(5, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert request.num_output_tokens == 64 - 55 and request.finish_reason == "length"


@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree"])
def test_stop_token_ends_the_request(engine, mode):
    prompt = [5, 6, 7, 8]
    free = engine.generate_ids(prompt, SamplingParams(max_tokens=20, ignore_eos=True, mode=mode)).output_ids
    stop = free[6]
    first = free.index(stop)
    request = engine.generate_ids(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop], mode=mode))
    assert request.output_ids == free[: first + 1] and request.finish_reason == "stop"


def test_stage_times_split_each_round(engine):
    """Draft, tree build, verify and commit are disjoint parts of a round; host time is the round outside the passes."""
    engine.stage_times = StageTimes()
    request = engine.generate_ids([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, mode="ddtree", tree_budget=8))
    t = engine.stage_times
    assert t.batch_rounds == t.rounds == len(request.acceptance_lengths) > 0
    # the histogram counts drafting rounds; the others verified the root alone (the last, with room for one token)
    drafted = sum(t.acceptance_histogram.values())
    assert 0 < drafted <= t.rounds
    with_ones = {**t.acceptance_histogram, 1: t.acceptance_histogram.get(1, 0) + t.rounds - drafted}
    assert {k: n for k, n in with_ones.items() if n} == {k: request.acceptance_lengths.count(k) for k in set(request.acceptance_lengths)}
    assert min(t.draft, t.tree_build, t.verify, t.commit) > 0
    assert t.host >= t.tree_build + t.commit - 1e-9 and t.draft + t.verify + t.host == pytest.approx(t.decode)


def test_min_tokens_suppresses_eos(engine):
    eos = engine.target.eos_token_ids[0]
    params = SamplingParams(max_tokens=12, min_tokens=12, stop_token_ids=[], temperature=1.0, seed=3)
    for seed in range(5):
        params.seed = seed
        assert eos not in engine.generate_ids([5, 6, 7], params).output_ids


def test_compacted_kv_equals_recomputed(engine):
    """After compaction to an accepted path, the cache equals a fresh prefill of that sequence."""
    model = engine.target
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, model.config.vocab_size, (9,), generator=gen)
    log_probs, token_ids = top_log_probs(torch.randn(6, model.config.vocab_size, generator=gen), 20)
    tree = build_tree(log_probs, token_ids, 20)
    leaf = max(range(tree.num_nodes + 1), key=lambda i: tree.depths[i])
    path = [leaf]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    accepted = path[::-1]
    batch = compile_tree(tree, root_token=int(prefix[-1]), start=8)
    cache = model.new_cache(64)
    with torch.no_grad():
        model(prefix[:8], torch.arange(8), cache, 0, torch.ones(8, 8, dtype=torch.bool).tril())
        model(batch.input_ids, batch.positions, cache, 8, batch.visibility)
        cache.compact(8, accepted)
        fresh = model.new_cache(64)
        seq = torch.cat([prefix[:8], batch.input_ids[accepted]])
        n = seq.shape[0]
        model(seq, torch.arange(n), fresh, 0, torch.ones(n, n, dtype=torch.bool).tril())
    torch.testing.assert_close(cache.k[:, :n], fresh.k[:, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :n], fresh.v[:, :n], rtol=1e-5, atol=1e-5)
