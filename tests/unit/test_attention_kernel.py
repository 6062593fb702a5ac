"""Our split-KV masked attention (ddtree.models.attention_kernel) against PyTorch's scaled_dot_product_attention, on
the CPU through Triton's interpreter (compiled on a GPU machine): requests read from scattered slots of a K/V pool,
grouped query heads, trees' ancestor masks, keys split over several programs (some slices fully masked for a row),
and a dense and a hybrid engine whose CUDA-style forwards attend through it decode what they decode without it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ddtree.sampling_params import SamplingParams
from perf.attention_bench import tree_masks
from tests.triton_interpreter import AVAILABLE, attention_kernel_module
from tests.unit.test_batching import run_together

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter runs our kernel on the CPU)")


@pytest.mark.parametrize("rows, keys, programs, dims", [(1, 40, 8, (6, 2, 32)), (5, 70, 8, (6, 2, 32)),
                                                        (17, 100, 64, (6, 2, 32)), (5, 70, 1, (6, 2, 32)),
                                                        (17, 90, 16, (9, 3, 64)), (65, 80, 8, (9, 3, 64))])
def test_masked_attention_equals_sdpa(rows, keys, programs, dims):
    """(9, 3, 64): SmolLM2-135M's heads (the embedded default), whose trees take the kernel by default on CUDA."""
    kernel = attention_kernel_module().masked_attention
    gen = torch.Generator().manual_seed(rows * 100 + keys)
    (heads, kv_heads, d), slots = dims, torch.tensor([3, 0, 4])
    r = slots.shape[0]
    pool_k, pool_v = (torch.randn(5, keys + 9, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(r, heads, rows, d, generator=gen).transpose(1, 2)     # [R, Q, heads, d], a strided view
    mask = tree_masks(r, rows, keys, gen)
    got = kernel(q, pool_k, pool_v, slots, keys, mask, d**-0.5, target_programs=programs)
    keys_, values = (pool[slots, :keys].transpose(1, 2) for pool in (pool_k, pool_v))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys_, values, attn_mask=mask[:, None], scale=d**-0.5,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def mixed_requests(kind: str, tiny_models, tmp_path, seed: int) -> tuple:
    """A static CPU engine config of four sequences and four greedy requests, `ar` and `ddtree` in turn."""
    from ddtree.engine import Engine
    from tests.unit.test_batching import static_cpu_config

    config = static_cpu_config(kind, tiny_models, tmp_path, max_num_seqs=4)
    vocab = Engine(config).target.config.vocab_size
    rng = random.Random(seed)
    return config, [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 20))],
                     SamplingParams(max_tokens=rng.randint(4, 8), mode=("ar", "ddtree")[i % 2], tree_budget=6,
                                    ignore_eos=True)) for i in range(4)]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_engines_attending_through_the_kernel_decode_what_they_decode_without(kind, tiny_models, tmp_path, monkeypatch):
    """Greedy `ar` and `ddtree` requests, alone and four at once, with every packed attention call of the target
    through our kernel (few programs: the interpreter is slow) decode what the engine decodes with SDPA."""
    from ddtree.engine import Engine
    from ddtree.models import dense

    config, jobs = mixed_requests(kind, tiny_models, tmp_path, seed=7)
    expected = run_together(Engine(config), jobs, arrive_every=1)
    kernel, calls = attention_kernel_module().masked_attention, []
    monkeypatch.setattr(dense, "attention_kernel",
                        lambda device: lambda *a: calls.append(a[0].shape[:2]) or kernel(*a, target_programs=4))
    monkeypatch.setenv("DDTREE_ATTENTION_KERNEL", "1")
    assert run_together(Engine(config), jobs, arrive_every=1) == expected
    assert calls and {rows for _, rows in calls} == {1}, "with 1, only `ar` steps (one row each) take our kernel"
    calls.clear()
    monkeypatch.setenv("DDTREE_ATTENTION_KERNEL", "128")   # trees too
    assert run_together(Engine(config), jobs, arrive_every=1) == expected
    assert max(r for r, _ in calls) >= 2 and max(rows for _, rows in calls) > 1, calls
    calls.clear()
    monkeypatch.delenv("DDTREE_ATTENTION_KERNEL")   # the default: trees too, the tiny models' heads being 16 wide
    assert run_together(Engine(config), jobs, arrive_every=1) == expected
    assert max(r for r, _ in calls) >= 2 and max(rows for _, rows in calls) > 1, calls


@pytest.mark.parametrize("zero_centered, rotary, norms", [(True, 8, True), (False, 32, True), (False, 32, False)])
def test_prepare_qkv_equals_the_chains_and_the_pool_writes(zero_centered, rotary, norms):
    """prepare_qkv: q as the eager norm + rotary chain gives it (q a strided view, as the gated attention's q beside
    its gate), each row's k (the same chain) and v written into the pool at its slot and position, nothing else.
    Qwen3.5's partial rotary, Qwen3's, and a Llama's rotary without norms (SmolLM2, the embedded default)."""
    from ddtree.models import fused

    kernel = attention_kernel_module().prepare_qkv
    gen = torch.Generator().manual_seed(rotary)
    n, heads, kv_heads, d, eps = 5, 6, 2, 32, 1e-6
    q = torch.randn(n, heads, 2 * d, generator=gen)[..., :d]
    k, v = torch.randn(n, kv_heads, d, generator=gen) * 3, torch.randn(n, kv_heads, d, generator=gen)
    q_weight, k_weight = 1.0 + 0.2 * torch.randn(d, generator=gen), 1.0 + 0.2 * torch.randn(d, generator=gen)
    angles = torch.rand(n, rotary // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    pool_k, pool_v = torch.randn(4, 12, kv_heads, d, generator=gen), torch.randn(4, 12, kv_heads, d, generator=gen)
    slots, positions = torch.tensor([3, 3, 0, 2, 0]), torch.tensor([7, 8, 1, 11, 2])
    if not norms:
        def chain(x, w):
            return fused.rotary.eager(x, cos, sin)
    elif zero_centered:
        def chain(x, w):
            return fused.zero_centered_norm_partial_rotary.eager(x, w, eps, cos, sin)
    else:
        def chain(x, w):
            return fused.rms_norm_rotary.eager(x, w, eps, cos, sin)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[slots, positions], want_v[slots, positions] = chain(k, k_weight), v
    if not norms:
        q_weight = k_weight = None
    got = kernel(q, k, v, q_weight, k_weight, eps, cos, sin, pool_k, pool_v, slots, positions, zero_centered=zero_centered)
    torch.testing.assert_close(got, chain(q, q_weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool_v, want_v)


def test_prepare_qkv_reads_a_broadcast_slot():
    """A static forward's one request has its slot broadcast over its rows (PackedAttention.static: a stride-0 view);
    the kernel must read it by its stride. Read as contiguous, rows past the first took the next elements of the
    storage (here slot 3; on the H200, memory past a one-element tensor: an illegal address at 27B dims)."""
    kernel = attention_kernel_module().prepare_qkv
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, d, eps = 4, 2, 1, 32, 1e-6
    q = torch.randn(n, heads, d, generator=gen)
    k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
    cos, sin = torch.ones(n, 8), torch.zeros(n, 8)
    pool_k, pool_v = torch.zeros(4, 10, kv_heads, d), torch.zeros(4, 10, kv_heads, d)
    storage = torch.tensor([1, 3, 3, 3, 3])
    slots = storage[:1, None].expand(1, n).flatten()          # as PackedAttention.static builds it for one request
    positions = (torch.tensor([5])[:, None] + torch.arange(n)).flatten()
    assert slots.stride() == (0,)
    kernel(q, k, v, torch.ones(d), torch.ones(d), eps, cos, sin, pool_k, pool_v, slots, positions, zero_centered=True)
    assert torch.equal(pool_v[1, 5 : 5 + n], v), "every row written in slot 1"
    assert not pool_v[3].any() and not pool_k[3].any(), "nothing written in slot 3"


@pytest.mark.parametrize("kind", ["dense", "llama", "hybrid"])
def test_engines_preparing_qkv_in_the_kernel_decode_what_they_decode_without(kind, tiny_models, tmp_path, monkeypatch):
    """Greedy `ar` and `ddtree` requests, four at once, with every packed forward's q/k norms, rotary and K/V writes
    through prepare_qkv decode what the engine decodes with the chains (no chain left in those forwards); a Llama's
    (no q/k norms: SmolLM2, the embedded default) rotary and K/V writes too where DDTREE_QKV_KERNEL=all."""
    from ddtree.engine import Engine
    from ddtree.models import dense

    config, jobs = mixed_requests(kind, tiny_models, tmp_path, seed=8)
    expected = run_together(Engine(config), jobs, arrive_every=1)
    kernel, calls, written = attention_kernel_module().prepare_qkv, [], []
    monkeypatch.setattr(dense, "qkv_kernel", lambda device: lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    attend = dense.PackedAttention.attend
    monkeypatch.setattr(dense.PackedAttention, "attend", lambda self, pk, pv, q, k, v, scale:
                        written.append(k is not None) or attend(self, pk, pv, q, k, v, scale))
    if kind == "llama":   # heads without norms take the kernel only where DDTREE_QKV_KERNEL=all (not yet measured)
        monkeypatch.delenv("DDTREE_QKV_KERNEL", raising=False)
        assert run_together(Engine(config), jobs, arrive_every=1) == expected
        assert not calls and written and all(written), "by default a Llama's heads keep the chains and index writes"
        written.clear()
        monkeypatch.setenv("DDTREE_QKV_KERNEL", "all")
    assert run_together(Engine(config), jobs, arrive_every=1) == expected
    assert calls and max(calls) > 1, calls                     # packed forwards of several rows too
    assert written and not any(written), "every packed forward's K/V written by the kernel, none by the index writes"


def test_attention_kernel_rows_reads_its_setting(monkeypatch):
    from ddtree.models.kernels import attention_kernel_rows

    monkeypatch.delenv("DDTREE_ATTENTION_KERNEL", raising=False)
    # trees too for 256-wide heads and for 16- to 64-wide ones; `ar` steps only at 128 (and at 8: tl.dot wants 16)
    assert [attention_kernel_rows(d) for d in (8, 16, 32, 64, 128, 256)] == [1, 128, 128, 128, 1, 128]
    for value, rows in (("0", 0), ("", 0), ("1", 1), ("17", 17), ("4096", 128)):
        monkeypatch.setenv("DDTREE_ATTENTION_KERNEL", value)
        assert [attention_kernel_rows(d) for d in (32, 64, 128, 256)] == [rows] * 4


def test_qkv_kernel_without_norms_reads_its_setting(monkeypatch):
    from ddtree.models.kernels import qkv_kernel_without_norms

    monkeypatch.delenv("DDTREE_QKV_KERNEL", raising=False)
    assert not qkv_kernel_without_norms(), "off by default: not yet measured"
    for value, on in (("1", False), ("0", False), ("", False), ("all", True), (" all ", True)):
        monkeypatch.setenv("DDTREE_QKV_KERNEL", value)
        assert qkv_kernel_without_norms() is on, value


def test_drafter_blocks_attend_in_place_through_the_kernel(tmp_path, monkeypatch):
    """The drafter's pooled pass with our kernel (DFlashDrafter.forward_pooled on CUDA; here Triton's interpreter):
    each block's K/V written after its context in the pool and read there with the contexts, sliding windows that
    cut, padding keys past each context masked: the blocks' hidden states those of the gathered SDPA pass. A context
    bucket with no room for a block after it keeps the gathered pass. kernel+prepare: each layer's q/k norms, rotary
    and the block's K/V writes through prepare_qkv too (kernels.draft_qkv_kernel, DDTREE_DRAFT_QKV_KERNEL=1)."""
    from ddtree.models import dflash
    from tests.unit.test_dflash_drafter import BLOCK

    run = drafter_blocks(tmp_path)
    kernel, calls = attention_kernel_module().masked_attention, []
    prepare, prepared = attention_kernel_module().prepare_qkv, []
    outputs = {}
    for name, make in (("gathered", lambda device: None),
                       ("kernel", lambda device: lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k)),
                       ("kernel+prepare", lambda device: lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))):
        monkeypatch.setattr(dflash, "draft_attention_kernel", make)
        monkeypatch.setattr(dflash, "draft_qkv_kernel", lambda device: (
            lambda *a, **k: prepared.append(a[0].shape) or prepare(*a, **k)) if name == "kernel+prepare" else None)
        outputs[name] = run(32)
    assert calls == [(DRAFT_REQUESTS, BLOCK, 4, 16)] * 10                # 5 layers, each form through the kernel
    assert prepared == [(DRAFT_REQUESTS * BLOCK, 4, 16)] * 5
    torch.testing.assert_close(outputs["kernel"], outputs["gathered"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["kernel+prepare"], outputs["gathered"], rtol=1e-5, atol=1e-5)
    calls.clear()   # 64 - 16 < 56: no room for a block after the bucket, the gathered pass
    full = run(56)
    assert not calls and len(prepared) == 5
    torch.testing.assert_close(full, outputs["gathered"], rtol=1e-5, atol=1e-5)


DRAFT_REQUESTS = 3


def drafter_blocks(tmp_path, device: str = "cpu"):
    """The drafter of the in-place block tests (Qwen3.6's 5 layers and taps, sliding windows of 6 that cut) on
    `device`, with DRAFT_REQUESTS requests' contexts (3, 21, 9 rows) and blocks: keys -> the blocks' hidden states
    from DFlashDrafter.forward_pooled over that many keys, the contexts written into fresh caches of 64 positions."""
    from ddtree.models import dflash
    from tests.unit.test_dflash_drafter import BLOCK, HIDDEN, write_published_checkpoint

    taps = [1, 16, 31, 46, 61]
    write_published_checkpoint(tmp_path / "d", taps, seed=4, num_target_layers=64, sliding_window=6,
                               layer_types=["sliding_attention"] * 4 + ["full_attention"])
    drafter = dflash.DFlashDrafter.from_pretrained(tmp_path / "d", device=device)
    gen = torch.Generator().manual_seed(8)
    lengths = [3, 21, 9]
    contexts = [torch.randn(n, HIDDEN * len(taps), generator=gen).to(device) for n in lengths]
    blocks = torch.randn(DRAFT_REQUESTS, BLOCK, HIDDEN, generator=gen).to(device)

    @torch.no_grad()
    def run(keys: int) -> torch.Tensor:
        caches = drafter.new_caches(DRAFT_REQUESTS, 64)
        drafter.add_contexts(caches, contexts)
        slots = torch.tensor([c.slot for c in caches], device=device)
        starts = torch.tensor(lengths, device=device)
        positions = starts[:, None] + torch.arange(BLOCK, device=device)
        return drafter.forward_pooled(caches[0].pool, slots, starts, positions, keys, blocks)
    return run


def test_trees_split_their_keys_for_the_programs_the_switch_names(monkeypatch):
    """DDTREE_ATTENTION_TREE_PROGRAMS (attention_kernel.split_target): "0", every call splits for TARGET_PROGRAMS;
    N, calls of several rows split for N (one row keeps TARGET_PROGRAMS); N,M, N up to 32 rows and M above (unset:
    132,66). A 17-row tree's call through it equals SDPA, with fewer splits than the default's."""
    module = attention_kernel_module()
    monkeypatch.setenv("DDTREE_ATTENTION_TREE_PROGRAMS", "0")
    assert {module.split_target(rows) for rows in (1, 17, 65)} == {module.TARGET_PROGRAMS}
    monkeypatch.delenv("DDTREE_ATTENTION_TREE_PROGRAMS")
    assert [module.split_target(rows) for rows in (1, 17, 65)] == [module.TARGET_PROGRAMS, 132, 66]
    monkeypatch.setenv("DDTREE_ATTENTION_TREE_PROGRAMS", "132")
    assert [module.split_target(rows) for rows in (1, 17, 65)] == [module.TARGET_PROGRAMS, 132, 132]
    monkeypatch.setenv("DDTREE_ATTENTION_TREE_PROGRAMS", "132,66")
    assert [module.split_target(rows) for rows in (1, 17, 32, 33, 65)] == [module.TARGET_PROGRAMS, 132, 132, 66, 66]
    gen = torch.Generator().manual_seed(9)
    rows, keys, heads, kv_heads, d, slots = 17, 300, 6, 2, 32, torch.tensor([1])
    pool_k, pool_v = (torch.randn(2, keys, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(1, rows, heads, d, generator=gen)
    mask = tree_masks(1, rows, keys, gen)
    splits = []
    empty = torch.empty

    def recording_empty(*shape, **kwargs):   # the partials' first dim: the splits
        if len(shape) == 5 and kwargs.get("dtype") == torch.float32:
            splits.append(shape[0])
        return empty(*shape, **kwargs)

    monkeypatch.setattr(module.torch, "empty", recording_empty)
    monkeypatch.setenv("DDTREE_ATTENTION_TREE_PROGRAMS", "8")
    got = module.masked_attention(q, pool_k, pool_v, slots, keys, mask, d**-0.5)
    monkeypatch.delenv("DDTREE_ATTENTION_TREE_PROGRAMS")
    module.masked_attention(q, pool_k, pool_v, slots, keys, mask, d**-0.5)
    assert splits[0] < splits[1], splits
    keys_, values = (pool[slots, :keys].transpose(1, 2) for pool in (pool_k, pool_v))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys_, values, attn_mask=mask[:, None], scale=d**-0.5,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
