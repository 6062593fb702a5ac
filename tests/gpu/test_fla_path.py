"""The CUDA path of the hybrid target: fla's chunked gated delta rule for committed chains (prefills).

These run only where CUDA and fla are present (the GPU machine: `bash perf/run_gpu_training.sh verify`);
on the CPU CI they are skipped, and fla is never imported there. The references are the plain per-path
recurrence of ddtree.models.gdn in float64, and for whole models our own torch path on the CPU (tested
against transformers in tests/unit/test_hybrid.py). transformers itself cannot be the reference here:
with fla installed it routes its CPU model through fla's Triton kernels, which fail on CPU tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddtree.models.gdn import gdn_sequential
from ddtree.models.kernels import chain_gdn_kernel, gdn_chain_fla

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA or chain_gdn_kernel(torch.device("cuda")) is None,
                                reason="needs a CUDA GPU with fla installed")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double().cpu() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("n", [1, 17, 64, 65, 300])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_chain_equals_sequential_recurrence(n, dtype, bound):
    """Outputs and final state of fla's chunk kernel == the per-node recurrence (float64), from a non-zero
    initial state, with grouped value heads (HV = 2 x key heads after the engine's repeat)."""
    gen = torch.Generator().manual_seed(n)
    hv, dk, dv = 8, 64, 32
    q = torch.randn(n, hv, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(n, hv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(n, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, hv, generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(n, hv, generator=gen, dtype=torch.float64)
    s0 = torch.randn(hv, dk, dv, generator=gen, dtype=torch.float64) * 0.1
    chain = list(range(-1, n - 1))
    expected_o, expected_states = gdn_sequential(q, k, v, g, beta, chain, s0)
    cuda = [t.to("cuda", dtype) for t in (q, k, v)]
    o, state = gdn_chain_fla(chain_gdn_kernel(torch.device("cuda")), *cuda, g.float().cuda(), beta.to("cuda", dtype),
                             s0.float().cuda())
    assert o.dtype == dtype and state.dtype == torch.float32
    assert relative_error(o, expected_o) < bound
    assert relative_error(state, expected_states[-1]) < bound


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_step_equals_sequential_recurrence(dtype, bound):
    """One decode step (an `ar` round) through fla's fused recurrent kernel == the per-node recurrence (float64)."""
    from ddtree.models.kernels import step_gdn_kernel

    gen = torch.Generator().manual_seed(11)
    hv, dk, dv = 8, 64, 32
    q, k = (torch.randn(1, hv, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, hv, generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(1, hv, generator=gen, dtype=torch.float64)
    s0 = torch.randn(hv, dk, dv, generator=gen, dtype=torch.float64) * 0.1
    expected_o, expected_states = gdn_sequential(q, k, v, g, beta, [-1], s0)
    o, state = gdn_chain_fla(step_gdn_kernel(torch.device("cuda")), *(t.to("cuda", dtype) for t in (q, k, v)),
                            g.float().cuda(), beta.to("cuda", dtype), s0.float().cuda())
    assert o.dtype == dtype and state.dtype == torch.float32 and state.shape == (hv, dk, dv)
    assert relative_error(o, expected_o) < bound
    assert relative_error(state, expected_states[-1]) < bound


class CpuReference:
    """Our torch path on the CPU with transformers' calling convention (what OracleDraftEngine asks of it)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        n = ids.shape[1]
        logits, _ = self.model(ids[0], torch.arange(n), self.model.new_cache(n + 1), 0,
                               torch.ones(n, n, dtype=torch.bool).tril())
        return SimpleNamespace(logits=logits[None])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from ddtree.models.qwen3_5 import HybridTarget
    from tests.unit.oracle import make_tiny_hybrid

    root, _ = make_tiny_hybrid(tmp_path_factory.mktemp("hybrid_gpu"))
    return root, CpuReference(HybridTarget.from_pretrained(root / "target"))


def test_long_prefill_through_fla_matches_the_cpu_path(hybrid):
    """A prompt longer than PREFILL_CHUNK (the fla path) on CUDA: logits and the committed state (seen through
    the next step's logits) match the torch path on the CPU."""
    from ddtree.models.qwen3_5 import PREFILL_CHUNK, HybridTarget

    root, reference = hybrid
    model = HybridTarget.from_pretrained(root / "target", device="cuda")
    n = 2 * PREFILL_CHUNK + 37
    ids = torch.randint(0, 96, (n + 1,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        cache = model.new_cache(n + 8)
        causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        logits, _ = model(ids[:n].cuda(), torch.arange(n, device="cuda"), cache, 0, causal)
        cache.compact(0, list(range(n)))
        step, _ = model(ids[n:].cuda(), torch.tensor([n], device="cuda"), cache, n,
                        torch.ones(1, 1, dtype=torch.bool, device="cuda"))
    torch.testing.assert_close(logits.cpu(), expected[:n], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(step[0].cpu(), expected[n], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode,budget", [("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
def test_greedy_speculative_equals_ar_on_cuda(hybrid, mode, budget):
    """On CUDA (fp32, fla prefill, torch tree verify): greedy speculative output == greedy ar, token for token."""
    from ddtree.config import EngineConfig
    from ddtree.sampling_params import SamplingParams
    from tests.unit.oracle import OracleDraftEngine

    root, reference = hybrid
    config = EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=400,
                          max_tree_budget=64, device="cuda")
    engine = OracleDraftEngine(config, reference=reference)
    prompt = torch.randint(0, 95, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    params = dict(max_tokens=40, ignore_eos=True)
    expected = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
    request = engine.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, **params))
    assert request.output_ids == expected
    assert request.mean_acceptance_length > 1.3


def test_paths_form_and_replay_commit_through_fla_equal_the_torch_forms():
    """The paths form (fla's varlen fused recurrent kernel over root-to-leaf paths) == the ancestor-masked tree form,
    and the replay commit (one fla call, layers as heads) == commit_path, on a 65-node DDTree tree in float32."""
    from ddtree.models.gdn import (
        ReplayStash,
        TreePaths,
        TreeStash,
        _root_path,
        commit_path,
        gdn_paths,
        gdn_tree,
        replay_path,
        tree_paths,
    )
    from ddtree.models.kernels import step_gdn_kernel
    from tests.unit.test_gdn_tree import deepest_leaf, make_inputs, make_tree

    kernel = step_gdn_kernel(torch.device("cuda"))
    parents = make_tree("ddtree", 65, seed=2)
    layers, hv, dk, dv, channels = 2, 8, 64, 32, 16
    tree_stash = TreeStash.empty(layers, 65, hv, dk, dv, channels, torch.float32, torch.float32, "cuda")
    replay = ReplayStash.empty(layers, 65, hv, dk, dv, channels, torch.float32, "cuda")
    paths = TreePaths(*(torch.from_numpy(a).cuda() for a in tree_paths(parents, 16)))
    states = torch.randn(layers, hv, dk, dv, device="cuda") * 0.1
    for layer in range(layers):
        q, k, v, g, beta, _ = (t.cuda() for t in make_inputs(65, hv, dk, dv, seed=layer, dtype=torch.float32))
        expected, _ = gdn_tree(q, k, v, g, beta, parents, states[layer], out=tree_stash.layer(layer))
        got = gdn_paths(kernel, q, k, v, g, beta, paths, states[layer])
        assert relative_error(got, expected.double().cpu()) < 1e-4
        replay.k[layer], replay.v[layer], replay.g[layer], replay.beta[layer] = k, v, g, beta
    x = torch.randn(layers, 65, channels, device="cuda")
    tree_stash.x.copy_(x)
    replay.x.copy_(x)
    path = _root_path(parents, deepest_leaf(parents))
    conv = torch.randn(layers, channels, 4, device="cuda")
    state_a, conv_a, state_b, conv_b = states.clone(), conv.clone(), states.clone(), conv.clone()
    commit_path(tree_stash, path, state_a, conv_a)
    replay_path(replay, path, state_b, conv_b, kernel)
    assert relative_error(state_b, state_a.double().cpu()) < 1e-4 and torch.equal(conv_a, conv_b)
