"""Programmatic Dependent Launch (DDTREE_PDL=1, kernels.pdl) on a Hopper GPU: our kernels compiled and launched with
it, back to back in a CUDA graph with a torch kernel between them, read what the kernel before them wrote; a static
forward's logits and taps (graphs captured under each setting) and engines' greedy tokens with it == without it.
Skipped without CUDA or below compute capability 9."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of compute capability 9+ (PDL)")


@pytest.mark.parametrize("peel", ["1", "0", "all"])
def test_pdl_launches_read_what_the_kernel_before_wrote(peel, monkeypatch):
    """GEMV and few-rows kernels chained in a graph (each reading the previous one's output, one through a torch
    kernel), replayed on new inputs: float64's products; and each compiled for a PDL launch. Every form of the wait:
    after the first weight tile where peel_first says (DDTREE_PDL_PEEL), first otherwise."""
    from ddtree.models import gemv_kernel, kernels

    monkeypatch.setenv("DDTREE_PDL", "1")
    monkeypatch.setenv("DDTREE_PDL_PEEL", peel)
    assert kernels.pdl(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(n, k, generator=gen) / k**0.5).cuda() for n, k in ((4096, 4096), (8192, 4096), (4096, 8192))]
    for rows in (1, 16, 17):
        x = torch.randn(rows, 4096, device="cuda")

        def chain():
            h = gemv_kernel.linear_rows(x, ws[0])
            h = gemv_kernel.linear_rows(h, ws[1]) * 0.5     # a torch kernel (no PDL) between two of ours
            return gemv_kernel.linear_rows(h, ws[2], add=x)

        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for seed in range(3):
            x.copy_(torch.randn(rows, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
            graph.replay()
            h = F.linear(F.linear(x.double(), ws[0].double()), ws[1].double()) * 0.5
            want = x.double() + F.linear(h, ws[2].double())
            assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max(), (rows, seed)
    launched = [kernel.metadata.launch_pdl for jit in (gemv_kernel._gemv_kernel, gemv_kernel._rows_kernel)
                for cache in jit.device_caches.values() for kernel in cache[0].values()]
    assert launched and any(launched), launched


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_static_forward_with_pdl_equals_it_without(family, tiny_models, tmp_path, monkeypatch):
    """The same trees (an `ar` step among them) through a static forward captured with DDTREE_PDL=0 and one captured
    with it =1, each from the same committed state: logits and taps alike (fp32; to float32 rounding: the compiled
    chains are compiled apart for each setting, and inductor may tune a reduction differently)."""
    from ddtree.models import fused
    from ddtree.models.gdn import _root_path
    from ddtree.models.graphs import GraphPool, StaticTarget
    from ddtree.tree import compile_tree
    from tests.unit.test_static_forward import random_tree

    if family == "hybrid":
        from ddtree.models.qwen3_5 import HybridTarget
        from tests.unit.oracle import make_tiny_hybrid

        root, _ = make_tiny_hybrid(tmp_path)
        model = HybridTarget.from_pretrained(root / "target", device="cuda")
        caches, taps = [model.new_cache(400) for _ in range(2)], [1, 2]
    else:
        from ddtree.models.dense import DenseTarget

        model = DenseTarget.from_pretrained(tiny_models / "qwen3-target", device="cuda")
        caches, taps = model.new_caches(2, 400), [0, 1]
    vocab, prompt = model.config.vocab_size, 21
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(3))
    causal = torch.ones(prompt, prompt, dtype=torch.bool, device="cuda").tril()
    monkeypatch.setenv("DDTREE_PDL", "0")
    for cache in caches:
        model(ids.cuda(), torch.arange(prompt, device="cuda"), cache, 0, causal, tap_layers=taps)
        cache.compact(0, list(range(prompt)))
    outputs = {}
    for value, cache in zip(("0", "1"), caches):
        monkeypatch.setenv("DDTREE_PDL", value)
        static, start, outputs[value] = StaticTarget(model, taps, GraphPool(torch.device("cuda"), capture=True)), prompt, []
        for round_, budget in enumerate([1, 4, 12, 30, 0, 4, 12, 1]):   # shapes recur: graphs replayed on new inputs
            tree = random_tree(vocab, budget, round_) if budget else random_tree(vocab, 1, 0).truncated(0)
            batch = compile_tree(tree, root_token=int(ids[round_]), start=start)
            logits, tapped = static(cache, start, batch.input_ids, batch.positions, tree.parents)
            outputs[value].append((logits.clone(), tapped.clone()))
            path = _root_path(tree.parents, max(range(tree.num_nodes + 1), key=lambda i: tree.depths[i]))
            cache.compact(start, path)
            start += len(path)
        assert all(p.graph not in (None, False) for p in static.graphs.programs.values()), "every program captured"
    assert fused.chain_pdl(torch.device("cuda")), "this torch's inductor takes triton.enable_pdl"
    for round_, ((logits, tapped), (logits_pdl, tapped_pdl)) in enumerate(zip(outputs["0"], outputs["1"])):
        torch.testing.assert_close(logits_pdl, logits, rtol=1e-5, atol=1e-5, msg=f"round {round_} logits")
        torch.testing.assert_close(tapped_pdl, tapped, rtol=1e-5, atol=1e-5, msg=f"round {round_} taps")


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_engine_with_pdl_decodes_what_it_decodes_without(family, tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with our kernels and the compiled chains launched with PDL ==
    without it."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_PDL", tiny_config(family, tiny_models, tmp_path),
                                      [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)], seed=7)
