"""Continuous batching: many requests decoded together give exactly what each gives alone."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from ddtree.config import EngineConfig
from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter
from ddtree.request import Request
from ddtree.sampling_params import SamplingParams
from tests.triton_interpreter import AVAILABLE, tree_kernel_module
from tests.unit.oracle import OracleDraftEngine

MODES = [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]


def make_hybrid(root):
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(root / "target")
    hf = dflash_hf_config(json.loads((root / "target" / "config.json").read_text()), num_layers=1, block_size=8,
                          mask_token_id=95)
    save_drafter(root / "dflash", hf, init_random_drafter(hf, seed=1))
    return root / "target", root / "dflash"


@pytest.fixture(scope="module", params=["dense", "hybrid", "dense-static", "hybrid-static"])
def engines(request, tiny_models, tmp_path_factory):
    """(kind, a 16-slot engine, a 1-slot engine, vocab); "-static": both run static forwards (what CUDA serves
    with: batched target and drafter passes padded to buckets, padding requests in a scratch slot)."""
    static = "on" if request.param.endswith("-static") else "off"
    if request.param.startswith("dense"):
        target, drafter = tiny_models / "qwen3-target", tiny_models / "qwen3-dflash"
    else:
        target, drafter = make_hybrid(tmp_path_factory.mktemp("hybrid-batch"))
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size

    def make(max_num_seqs):
        config = EngineConfig(target_path=str(target), drafter_path=str(drafter), max_model_len=192,
                              max_tree_budget=64, max_num_seqs=max_num_seqs, static_forward=static)
        return OracleDraftEngine(config, reference=reference)

    return request.param, make(16), make(1), vocab


def static_cpu_config(kind: str, tiny_models, tmp_path, max_num_seqs: int) -> EngineConfig:
    """A float32 engine config with static forwards (run eagerly on the CPU) of the tiny dense qwen3 target ("dense"),
    the tiny llama one ("llama": no q/k norms, as SmolLM2) or a tiny hybrid one (made under tmp_path), with its drafter."""
    if kind in ("dense", "llama"):
        family = "qwen3" if kind == "dense" else "llama"
        target, drafter = tiny_models / f"{family}-target", tiny_models / f"{family}-dflash"
    else:
        target, drafter = make_hybrid(tmp_path)
    return EngineConfig(target_path=str(target), drafter_path=str(drafter), dtype="float32", max_model_len=128,
                        max_num_seqs=max_num_seqs, static_forward="on")


def workload(vocab: int, count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(3, 40))]   # mixed prompt lengths
        mode, budget = MODES[i % len(MODES)]
        jobs.append((prompt, SamplingParams(max_tokens=rng.randint(8, 20), mode=mode, tree_budget=budget,
                                            ignore_eos=True)))
    return jobs


def run_together(engine, jobs, arrive_every: int = 2) -> dict[str, list[int]]:
    """Requests arrive while others decode (one new request every `arrive_every` steps)."""
    requests = [Request(request_id=f"r{i}", prompt_ids=p, params=params) for i, (p, params) in enumerate(jobs)]
    pending, step = list(requests), 0
    while pending or engine.has_work:
        if pending and step % arrive_every == 0:
            engine.add(pending.pop(0))
        engine.step()
        step += 1
        assert len(engine.running) <= engine.config.max_num_seqs
    return {r.request_id: r.output_ids for r in requests}


def test_sixteen_concurrent_greedy_requests_equal_alone(engines):
    kind, batched, single, vocab = engines
    jobs = workload(vocab, 16, seed=1)
    together = run_together(batched, jobs, arrive_every=1)
    assert max(len(batched.running), 0) == 0 and sorted(batched.free_slots) == list(range(16))
    for i, (prompt, params) in enumerate(jobs):
        alone = single.generate_ids(prompt, params).output_ids
        assert together[f"r{i}"] == alone, f"{kind} request {i} mode {params.mode} budget {params.tree_budget}"
    if kind.endswith("-static"):   # the batches went through static passes of several (padded) requests
        counts = {key[1] for key in batched.graphs.programs if key[0] in ("batch", "draft")}
        assert max(counts) >= 8, counts
        if kind == "hybrid-static":   # a hybrid target's batches too, in programs that name the slots in their inputs
            assert max(key[1] for key in batched.graphs.programs if key[0] == "target") >= 8


def test_mixed_sampling_parameters_in_one_batch(engines):
    kind, batched, single, vocab = engines
    jobs = workload(vocab, 10, seed=2)
    for i, (_, params) in enumerate(jobs):
        if i % 2:
            params.temperature, params.top_p, params.top_k, params.seed = 0.8, 0.9, 20, 100 + i
    together = run_together(batched, jobs, arrive_every=3)
    for i, (prompt, params) in enumerate(jobs):
        assert len(together[f"r{i}"]) == params.max_tokens, f"{kind} request {i}"
        if params.is_greedy:
            assert together[f"r{i}"] == single.generate_ids(prompt, params).output_ids, f"{kind} request {i}"


def test_aborts_free_every_slot(engines):
    kind, batched, _, vocab = engines
    rng = random.Random(3)
    jobs = workload(vocab, 40, seed=3)
    live = []
    for i, (prompt, params) in enumerate(jobs):
        request = Request(request_id=f"a{i}", prompt_ids=prompt, params=params)
        batched.add(request)
        live.append(request)
        batched.step()
        if rng.random() < 0.4:
            victim = live.pop(rng.randrange(len(live)))
            batched.abort(victim.request_id)
    while batched.has_work:
        batched.step()
    assert not batched.running and not batched.waiting
    assert sorted(batched.free_slots) == list(range(batched.config.max_num_seqs)), kind


def test_a_batch_of_ar_steps_runs_as_one_pass_and_equals_alone(engines, monkeypatch):
    """Hybrid targets: when every request of a round takes an `ar` step, the GDN layers gather their states, run one
    conv and one recurrence call for all and scatter the states back (GatedDeltaNet._steps); each request still
    decodes what it decodes alone."""
    kind, batched, single, vocab = engines
    if not kind.startswith("hybrid"):
        pytest.skip("a hybrid target's path")
    from ddtree.models.qwen3_5 import GatedDeltaNet

    calls, steps = [], GatedDeltaNet._steps
    monkeypatch.setattr(GatedDeltaNet, "_steps", lambda self, mixed, *a: calls.append(mixed.shape[0]) or steps(self, mixed, *a))
    rng = random.Random(4)
    jobs = [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 30))],
             SamplingParams(max_tokens=rng.randint(6, 14), mode="ar", ignore_eos=True)) for _ in range(6)]
    together = run_together(batched, jobs, arrive_every=1)
    assert calls and max(calls) >= 4, calls
    for i, (prompt, params) in enumerate(jobs):
        assert together[f"r{i}"] == single.generate_ids(prompt, params).output_ids, f"{kind} request {i}"


@pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter runs our kernel on the CPU)")
def test_trees_of_a_batch_through_our_paths_kernel_equal_alone(engines, monkeypatch):
    """Hybrid targets where our paths kernel runs (on CUDA; here Triton's interpreter, with fla's interface in plain
    torch for the commit replay): every tree of a round goes through one kernel call per GDN layer (TreeBatch), each
    path from its own request's slot, and each request decodes what it decodes alone on the ancestor-masked form."""
    kind, batched, single, vocab = engines
    if not kind.startswith("hybrid"):
        pytest.skip("a hybrid target's path")
    from ddtree.models import qwen3_5
    from ddtree.models.gdn import reference_recurrent

    rng = random.Random(5)
    jobs = [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 30))],
             SamplingParams(max_tokens=rng.randint(6, 12), mode=("dflash", "ddtree")[i % 2], tree_budget=(1, 4, 1, 16)[i % 4],
                            ignore_eos=True)) for i in range(5)]
    batched.noise.manual_seed(0)   # the oracle's drafts, so the rounds' batches, whatever the module's tests ran before
    expected = [single.generate_ids(prompt, params).output_ids for prompt, params in jobs]
    kernel, batches, make = tree_kernel_module().batched_tree_paths, [], qwen3_5.TreeBatch.of
    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    monkeypatch.setattr(qwen3_5, "tree_gdn_kernel", lambda device: kernel)
    chunks = tree_kernel_module().batched_tree_chunks   # whole trees in the chunk form (paths: test_tree_batch.py)
    monkeypatch.setattr(qwen3_5, "tree_chunk_kernel", lambda device: chunks)
    monkeypatch.setattr(qwen3_5.TreeBatch, "of", lambda *a: batches.append(len(a[1])) or make(*a))
    together = run_together(batched, jobs, arrive_every=1)
    assert batches and max(batches) >= 3, batches
    for i, (prompt, params) in enumerate(jobs):
        assert together[f"r{i}"] == expected[i], f"{kind} request {i} mode {params.mode} budget {params.tree_budget}"
    # static programs pad the paths to the rows (our kernel's padding paths read nothing): one program per row bucket
    shapes = {key[2:5] for key in batched.graphs.programs if key[0] == "target"}   # (rows, keys, paths)
    assert all(paths in (0, rows) for rows, _, paths in shapes) and (not kind.endswith("static") or shapes), shapes


@pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter runs our kernel on the CPU)")
def test_ar_steps_in_place_through_our_kernel_equal_alone(engines, monkeypatch):
    """Hybrid targets where our kernel runs `ar` steps (CUDA; here Triton's interpreter): a round's steps, a lone one
    too, read the committed windows and states from the pool and write them back in place (GatedDeltaNet._steps,
    tree_kernel.conv_steps_in_place and steps_in_place); each request decodes what it decodes alone on the torch
    recurrence."""
    kind, batched, single, vocab = engines
    if not kind.startswith("hybrid"):
        pytest.skip("a hybrid target's path")
    from ddtree.models import qwen3_5

    rng = random.Random(6)
    jobs = [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 30))],
             SamplingParams(max_tokens=rng.randint(6, 12), mode="ar", ignore_eos=True)) for _ in range(5)]
    expected = [single.generate_ids(prompt, params).output_ids for prompt, params in jobs]
    in_place, calls = tree_kernel_module().steps_in_place, []
    conv_in_place, conv_calls = tree_kernel_module().conv_steps_in_place, []
    monkeypatch.setattr(qwen3_5, "steps_gdn_kernel",
                        lambda device: lambda q, *a: calls.append(q.shape[0]) or in_place(q, *a))
    monkeypatch.setattr(qwen3_5, "conv_steps_kernel",
                        lambda device: lambda x, *a: conv_calls.append(x.shape[0]) or conv_in_place(x, *a))
    together = run_together(batched, jobs, arrive_every=1)
    assert calls and max(calls) >= 4 and min(calls) == 1 and conv_calls == calls, sorted(set(calls))
    for i, (prompt, params) in enumerate(jobs):
        assert together[f"r{i}"] == expected[i], f"{kind} request {i}"
