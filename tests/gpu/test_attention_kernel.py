"""Our split-KV masked attention (ddtree.models.attention_kernel) compiled on the GPU at Qwen3.6-27B's attention dims
(24 query heads, 4 K/V heads of 256, bf16) and SmolLM2-135M's (9 of 64, 3) against PyTorch's
scaled_dot_product_attention in float32: an `ar` step's one row, trees of 17, 65 and 128 rows, a 128-token prefill's
causal mask, batches of requests at scattered pool slots, short and long caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perf.attention_bench import tree_masks
from tests.triton_interpreter import attention_kernel_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# Qwen3.6-27B's attention dims, and SmolLM2-135M's (the embedded default: 9 heads of 64, 3 K/V heads), whose trees
# attend through the kernel by default too (kernels.attention_kernel_rows)
DIMS = {"27b": (24, 4, 256), "smollm2": (9, 3, 64)}


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("requests, rows, keys, causal", [(1, 1, 1024, False), (1, 17, 1024, False), (1, 65, 520, False),
                                                          (4, 17, 2048, False), (8, 5, 300, False), (1, 128, 160, False),
                                                          (2, 128, 128, True)])
def test_compiled_masked_attention_equals_sdpa(requests, rows, keys, causal, dims):
    """causal: prefills of `rows` tokens (each sees itself and those before it), which take the kernel at up to 128."""
    kernel = attention_kernel_module().masked_attention
    gen = torch.Generator().manual_seed(requests * 1000 + rows)
    heads, kv_heads, d = DIMS[dims]
    slots = torch.randperm(requests + 3, generator=gen)[:requests]
    pool_k, pool_v = (torch.randn(requests + 3, keys + 40, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(requests, rows, heads, d, generator=gen)
    mask = (torch.ones(rows, keys, dtype=torch.bool).tril().expand(requests, rows, keys).contiguous() if causal
            else tree_masks(requests, rows, keys, gen))
    got = kernel(*(t.to("cuda", torch.bfloat16) for t in (q, pool_k, pool_v)), slots.cuda(), keys, mask.cuda(), d**-0.5)
    keys_, values = (pool[slots, :keys].transpose(1, 2) for pool in (pool_k, pool_v))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys_, values, attn_mask=mask[:, None], scale=d**-0.5,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("zero_centered, rotary, norms", [(True, 64, True), (False, 256, True), (False, 64, False)])
def test_compiled_prepare_qkv_equals_the_chains(zero_centered, rotary, norms):
    """prepare_qkv compiled, at Qwen3.6-27B's attention dims in bf16, against the engine's norm + rotary chains run
    eagerly (outside fused.static(); emulate_precision_casts makes the compiled ones round where these do) and index
    writes: q and the written K within 2e-2 (a few bf16 ulps), V copied exactly. Without norms: SmolLM2-135M's dims
    (9 heads of 64, 3 K/V heads; a Llama, rotary only), each product rounded as the rotary chain rounds it, so q and K
    equal the chain's exactly."""
    from ddtree.models import fused

    kernel = attention_kernel_module().prepare_qkv
    gen = torch.Generator().manual_seed(rotary)
    n, heads, kv_heads, d, eps = (17, 24, 4, 256, 1e-6) if norms else (17, 9, 3, 64, 1e-5)
    q = torch.randn(n, heads, 2 * d, generator=gen).to("cuda", torch.bfloat16)[..., :d]
    k, v = (torch.randn(n, kv_heads, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    q_weight, k_weight = (1.0 + 0.2 * torch.randn(d, generator=gen)).cuda(), (1.0 + 0.2 * torch.randn(d, generator=gen)).cuda()
    if not zero_centered:
        q_weight, k_weight = q_weight.bfloat16(), k_weight.bfloat16()
    angles = torch.rand(n, rotary // 2, generator=gen) * 6
    cos, sin = (f(torch.cat([angles, angles], -1)).to("cuda", torch.bfloat16) for f in (torch.cos, torch.sin))
    pool_k, pool_v = (torch.zeros(3, 40, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots, positions = torch.full((n,), 2, device="cuda"), torch.arange(5, 5 + n, device="cuda")
    chain = fused.zero_centered_norm_partial_rotary if zero_centered else fused.rms_norm_rotary
    if not norms:
        q_weight = k_weight = None

        def chain(x, w, eps, cos, sin):
            return fused.rotary(x, cos, sin)
    got = kernel(q, k, v, q_weight, k_weight, eps, cos, sin, pool_k, pool_v, slots, positions, zero_centered=zero_centered)
    if not norms:
        assert torch.equal(got, chain(q, None, eps, cos, sin)) and torch.equal(pool_k[2, 5 : 5 + n], chain(k, None, eps, cos, sin))
    torch.testing.assert_close(got.float(), chain(q, q_weight, eps, cos, sin).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool_k[2, 5 : 5 + n].float(), chain(k, k_weight, eps, cos, sin).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(pool_v[2, 5 : 5 + n], v) and not pool_k[:2].any() and not pool_v[:2].any()


@pytest.mark.parametrize("split_target", ["", "132,66"])
def test_compiled_drafter_blocks_with_their_switches_equal_without(tmp_path, monkeypatch, split_target):
    """The drafter's pooled pass on CUDA (its attention in place through our kernel) with each layer's q/k norms,
    rotary and block K/V writes through prepare_qkv (DDTREE_DRAFT_QKV_KERNEL=1) == through the compiled chains and
    index writes; and with the attention's keys split for fewer programs (DDTREE_ATTENTION_TREE_PROGRAMS: by default
    132,66) == split for 264 like one-row calls (empty) (float32)."""
    from tests.unit.test_attention_kernel import drafter_blocks

    run = drafter_blocks(tmp_path, "cuda")
    outputs = {}
    for name, env in (("chains", {}), ("switches", {"DDTREE_DRAFT_QKV_KERNEL": "1",
                                                    "DDTREE_ATTENTION_TREE_PROGRAMS": split_target})):
        for key in ("DDTREE_DRAFT_QKV_KERNEL", "DDTREE_ATTENTION_TREE_PROGRAMS"):
            monkeypatch.setenv(key, env.get(key, ""))
        outputs[name] = run(32)
    torch.testing.assert_close(outputs["switches"], outputs["chains"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])   # llama: no q/k norms (SmolLM2), its rotary in prepare_qkv
@pytest.mark.parametrize("mode, budget", [("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
def test_trees_through_our_kernels_decode_the_targets_greedy_tokens(mode, budget, family, tiny_models, monkeypatch):
    """Lossless on the GPU with the default attention routing: the tiny dense pair's heads are 16 wide, so its trees' attention
    goes through our kernel (kernels.attention_kernel_rows); each drafting mode's greedy tokens (float32, graphs on)
    equal the target's own, `ar`'s from an engine whose every attention call goes through SDPA
    (DDTREE_ATTENTION_KERNEL=0), and some call of the kernel in the drafting run took more than one row and not as
    many as the prompt's prefill (a tree's: `dflash`'s chain is one). The reference engine runs without
    prepare_qkv too (DDTREE_QKV_KERNEL=0: the compiled chains and index writes); the drafting run's with it, a Llama's
    heads included (DDTREE_QKV_KERNEL=all, not the default), its trees' rows through it counted too."""
    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.models import dense
    from ddtree.sampling_params import SamplingParams

    base = dict(target_path=str(tiny_models / f"{family}-target"), drafter_path=str(tiny_models / f"{family}-dflash"),
                max_model_len=300, max_tree_budget=64, device="cuda", dtype="float32")
    prompt = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setenv("DDTREE_ATTENTION_KERNEL", "0")
    monkeypatch.setenv("DDTREE_QKV_KERNEL", "0")
    expected = Engine(EngineConfig(**base)).generate_ids(
        prompt, SamplingParams(mode="ar", max_tokens=48, ignore_eos=True)).output_ids
    monkeypatch.delenv("DDTREE_ATTENTION_KERNEL")
    monkeypatch.setenv("DDTREE_QKV_KERNEL", "all")   # a Llama's rotary and K/V writes through prepare_qkv too
    rows, kernel = [], dense.attention_kernel

    def counting(device):
        inner = kernel(device)
        return None if inner is None else (lambda *a, **k: rows.append(a[0].shape[1]) or inner(*a, **k))

    prepared, qkv = [], dense.qkv_kernel

    def counting_qkv(device):
        inner = qkv(device)
        return None if inner is None else (lambda *a, **k: prepared.append(a[0].shape[0]) or inner(*a, **k))

    monkeypatch.setattr(dense, "attention_kernel", counting)
    monkeypatch.setattr(dense, "qkv_kernel", counting_qkv)
    engine = Engine(EngineConfig(**base))
    assert engine.generate_ids(prompt, SamplingParams(mode="ar", max_tokens=48, ignore_eos=True)).output_ids == expected
    prefill, rows[:], prepared[:] = set(rows), [], []    # the prompt's prefill rows (its bucket) and the steps' one
    got = engine.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, max_tokens=48, ignore_eos=True))
    assert got.output_ids == expected
    assert any(r > 1 and r not in prefill for r in rows), f"no tree's attention through our kernel: {rows}, {prefill}"
    assert any(r > 1 and r not in prefill for r in prepared), f"no tree's q/k/v through prepare_qkv: {prepared}"
