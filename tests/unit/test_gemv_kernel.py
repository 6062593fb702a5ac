"""Our one-row GEMV and few-rows kernel (ddtree.models.gemv_kernel) against F.linear on the CPU through Triton's
interpreter (compiled on a GPU machine), and engines whose static forwards send their Linears of up to
kernels.gemv_max_rows() rows through them decode what they decode through F.linear."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F

from ddtree.sampling_params import SamplingParams
from tests.triton_interpreter import AVAILABLE, tree_kernel_module
from tests.unit.test_batching import run_together

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter runs our kernel on the CPU)")


def gemv_module():
    tree_kernel_module()   # the interpreter's scalar-index patch
    return importlib.import_module("ddtree.models.gemv_kernel")


@pytest.mark.parametrize("m, n, k, config", [(1, 37, 300, (8, 128, 4, 3)), (1, 64, 512, (16, 256, 4, 2)),
                                             (1, 10, 1030, (4, 512, 8, 4)), (1, 5, 64, None), (2, 37, 300, (16, 128, 4, 3)),
                                             (17, 64, 512, (32, 256, 4, 2)), (65, 10, 1030, None)])
@pytest.mark.parametrize("swap", [False, True])
def test_linear_rows_equals_f_linear(m, n, k, config, swap):
    """Partial tiles in both dimensions (rows too: 2, 17 and 65 rows in programs of 16, 32 and 128), in both forms of
    the few-rows kernel (rows first, or swapped: the weight's columns first) and with the residual added."""
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(m, 2 * k, generator=gen)[:, ::2].contiguous()
    w = torch.randn(n, k, generator=gen)
    add = torch.randn(m, n, generator=gen)
    linear_rows = gemv_module().linear_rows
    torch.testing.assert_close(linear_rows(x, w, config, swap=swap), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear_rows(x, w, config, swap=swap, add=add), add + F.linear(x, w), rtol=1e-5, atol=1e-4)


def prologue_cases(k: int, n: int, group: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   rows: int = 1):
    """x [rows, k] and per case (prologue, kernel keyword arguments, the Linear's input as the unfused forward computes
    it (the eager chain, rounding to dtype where the prologue rounds), the residual stream [rows, n] added after the
    Linear or None)."""
    from ddtree.models import fused

    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    x, a, residual = rand(rows, k), rand(rows, k), rand(rows, n)
    scale, weight, group_weight = 1.0 + 0.1 * rand(k, dt=torch.float32), rand(k), rand(group)
    gate = rand(rows, k // group, 2 * group)[..., group:]      # a strided view, as the attention's output gate
    return x, [
        ("norm", dict(p=scale, eps=1e-6), fused.zero_centered_rms_norm.eager(x, scale, 1e-6), None),
        ("norm_plain", dict(p=weight, eps=1e-5), fused.rms_norm.eager(x, weight, 1e-5), None),
        (None, dict(add=residual), x, residual),
        ("silu_mul", dict(a=a, add=residual), fused.silu_mul.eager(x, a), residual),
        ("sigmoid_gate", dict(a=gate, group=group, add=residual), fused.sigmoid_gate.eager(x, gate.reshape(rows, -1)),
         residual),
        ("gated_norm", dict(a=a, p=group_weight, eps=1e-6, group=group),
         fused.gated_rms_norm.eager(x.reshape(-1, group), a.reshape(-1, group), group_weight, 1e-6).reshape(rows, -1),
         None),
    ]


@pytest.mark.parametrize("norm_first", ["0", "1"])   # the norms' statistic in the product's loop (default) or before it
@pytest.mark.parametrize("rows, k, config", [(1, 512, (8, 128, 4, 3)), (1, 1000, (16, 256, 4, 2)),
                                             (17, 512, (16, 128, 4, 3)), (5, 1000, (32, 256, 4, 2))])
def test_prologues_equal_their_eager_chains(rows, k, config, norm_first, monkeypatch):
    """Each prologue's Linear == the Linear of the eager chain's output, plus the residual stream where one is added
    in the epilogue; one row (the GEMV) and, without a prologue, several (the few-rows kernel)."""
    monkeypatch.setenv("DDTREE_GEMV_NORM_FIRST", norm_first)
    w = torch.randn(23, k, generator=torch.Generator().manual_seed(k))
    x, cases = prologue_cases(k, 23, 8, seed=k, rows=rows)
    for prologue, kwargs, chained, residual in cases:
        if rows > 1 and prologue is not None:
            with pytest.raises(AssertionError, match="no prologue"):
                gemv_module().linear_rows(x, w, config, prologue=prologue, **kwargs)
            continue
        got = gemv_module().linear_rows(x, w, config, prologue=prologue, **kwargs)
        want = F.linear(chained, w) if residual is None else residual + F.linear(chained, w)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(prologue))


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_engines_with_linears_through_the_kernels_decode_what_they_decode_without(kind, tiny_models, tmp_path,
                                                                                   monkeypatch):
    """Greedy `ar` and `ddtree` requests with every Linear of the static forwards of up to gemv_max_rows() rows (the
    `ar` steps', the trees', the drafter's blocks, at batch 1) through our kernels: the tokens of F.linear's
    engine."""
    from ddtree.engine import Engine
    from ddtree.models import layers
    from tests.unit.test_batching import static_cpu_config

    config = static_cpu_config(kind, tiny_models, tmp_path, max_num_seqs=1)
    vocab = Engine(config).target.config.vocab_size
    rng = random.Random(3)
    jobs = [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 12))],
             SamplingParams(max_tokens=5, mode=mode, tree_budget=6, ignore_eos=True)) for mode in ("ar", "ddtree")]
    expected = [run_together(Engine(config), [job]) for job in jobs]
    kernel, calls = gemv_module().linear_rows, []
    monkeypatch.setattr(layers.kernels, "gemv_kernel",
                        lambda device: lambda x, w, **k: calls.append((x.shape[0], k.get("prologue"), k.get("add") is not None))
                        or kernel(x, w, **k))
    eager_norms, eager = [], layers.NormedRows.eager   # a norm computed apart from the Linear that reads it
    monkeypatch.setattr(layers.NormedRows, "eager", lambda self: eager_norms.append(self) or eager(self))
    assert [run_together(Engine(config), [job]) for job in jobs] == expected
    assert eager_norms and all(norm.shape[0] > 1 for norm in eager_norms)   # a one-row norm: in its GEMV's prologue
    want = {"norm", None, "silu_mul", "sigmoid_gate", "gated_norm"} if kind == "hybrid" else {"norm_plain", None, "silu_mul"}
    rows = {rows for rows, _, _ in calls}
    assert 1 in rows and max(rows) > 1 and max(rows) <= layers.kernels.gemv_max_rows(), rows
    assert {p for _, p, _ in calls} == want, set(calls)
    assert {add for _, _, add in calls} == {True, False}   # residual adds in epilogues, the others plain



def drafting_jobs_through_the_kernels(kind: str, tiny_models, tmp_path, monkeypatch, seed: int):
    """(config, linear_rows, jobs): a static CPU engine config of the family whose Linears go through our kernels
    (Triton's interpreter) from now on, and a greedy `ddtree` and a `dflash` request on random prompts."""
    from ddtree.engine import Engine
    from ddtree.models import layers
    from tests.unit.test_batching import static_cpu_config

    config = static_cpu_config(kind, tiny_models, tmp_path, max_num_seqs=1)
    kernel = gemv_module().linear_rows
    monkeypatch.setattr(layers.kernels, "gemv_kernel", lambda device: kernel)
    vocab = Engine(config).target.config.vocab_size
    rng = random.Random(seed)
    jobs = [([rng.randrange(vocab - 1) for _ in range(rng.randint(3, 12))],
             SamplingParams(max_tokens=5, mode=mode, tree_budget=6, ignore_eos=True)) for mode in ("ddtree", "dflash")]
    return config, kernel, jobs


@pytest.mark.parametrize("rows", [2, 16, 17])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("n, k, config", [(37, 300, (16, 128, 4, 3)), (64, 512, None), (5, 64, (32, 64, 4, 2))])
def test_the_rows_kernel_glu_form_equals_the_product_then_silu_times_up(rows, swap, n, k, config):
    """glu: weight = [gate; up] ([2n, k]) and out = silu(x @ gate.T) * (x @ up.T) [rows, n], partial tiles of the
    interleaved columns too (n = 37: 19 columns of each in the last program of 32; n = 5: one program, most of it
    past n)."""
    from ddtree.models import fused

    linear_rows = gemv_module().linear_rows
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(2 * n, k, generator=gen) / k**0.5
    gate, up = F.linear(x, w).split(n, dim=-1)
    got = linear_rows(x, w, config, swap=swap, glu=True)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, fused.silu_mul.eager(gate, up), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="glu"):
        linear_rows(x, w, config, glu=True, add=torch.zeros(rows, n))


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_engines_with_the_rows_glu_form_decode_what_they_decode_without(kind, tiny_models, tmp_path, monkeypatch):
    """DDTREE_ROWS_GLU (on by default): each gated MLP of the static forwards of a few rows (trees, `dflash`
    verifies, the drafter's blocks) takes silu(gate) * up in the epilogue of its fused gate/up product, no chain
    apart; greedy `ddtree` and `dflash` tokens as without it."""
    from ddtree.engine import Engine
    from ddtree.models import layers

    config, kernel, jobs = drafting_jobs_through_the_kernels(kind, tiny_models, tmp_path, monkeypatch, seed=7)
    calls, chains = [], []
    eager = layers.SiluMul.eager
    monkeypatch.setattr(layers.SiluMul, "eager", lambda self: chains.append(self.shape[0]) or eager(self))
    monkeypatch.setenv("DDTREE_ROWS_GLU", "0")   # on by default (kernels.rows_glu)
    expected = [run_together(Engine(config), [job]) for job in jobs]
    chains_without = len(chains)
    chains.clear()
    monkeypatch.setattr(layers.kernels, "gemv_kernel", lambda device: lambda x, w, **k: calls.append(
        (x.shape[0], k.get("glu", False))) or kernel(x, w, **k))
    monkeypatch.setenv("DDTREE_ROWS_GLU", "1")
    assert [run_together(Engine(config), [job]) for job in jobs] == expected
    glu = [rows for rows, on in calls if on]
    assert glu and min(glu) > 1
    # each MLP taken in the epilogue is a chain less (the rest: prefills, the drafter's unfused MLPs)
    assert len(chains) == chains_without - len(glu), (len(chains), chains_without, len(glu))


@pytest.mark.parametrize("rows", [2, 17])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("glu", [False, True])
def test_a_norm_across_two_products_epilogues_equals_the_norm_between_them(rows, swap, glu):
    """norm_out then norm_in (kernels.norm_parts): the first product adds into the stream h and writes y = h * scale
    and its programs' sums of h^2 (12 programs of 8 columns, 3 of them partial past n = 90 on the last one); the
    second, over y, divides by rms(h): equal to the zero-centered norm of h computed apart before the second product
    (plain, or its GLU epilogue)."""
    from ddtree.models import fused

    linear_rows = gemv_module().linear_rows
    gen = torch.Generator().manual_seed(rows * 2 + swap)
    n, k, n2, eps = 90, 70, 24, 1e-6
    a, w1, add = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(rows, n, generator=gen)
    w2, scale = torch.randn(n2, n, generator=gen) / n**0.5, 1.0 + 0.1 * torch.randn(n, generator=gen)
    h, y, parts = linear_rows(a, w1, (8, 32, 4, 2), swap=swap, add=add, norm_out=scale)
    torch.testing.assert_close(h, add + F.linear(a, w1), rtol=1e-5, atol=1e-4)
    assert parts.shape == (12, rows)
    torch.testing.assert_close(y, h * scale)
    got = linear_rows(y, w2, (16, 32, 4, 2), swap=swap, glu=glu, norm_in=parts, eps=eps)
    want = F.linear(fused.zero_centered_rms_norm.eager(h, scale, eps), w2)
    if glu:
        want = fused.silu_mul.eager(*want.split(n2 // 2, dim=-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="few-rows"):
        linear_rows(a[:1], w1, add=add[:1], norm_out=scale)


def test_engines_with_the_norms_across_products_decode_what_they_decode_without(tiny_models, tmp_path, monkeypatch):
    """DDTREE_NORM_PARTS (on by default): a hybrid target's static forwards of a few rows take each norm of the
    stream but the first layer's (and the final one, apart) across the products around it; greedy `ddtree` and
    `dflash` tokens as without it (=0), and each norm so taken is an eager norm less."""
    from ddtree.engine import Engine
    from ddtree.models import layers

    config, kernel, jobs = drafting_jobs_through_the_kernels("hybrid", tiny_models, tmp_path, monkeypatch, seed=11)
    monkeypatch.setenv("DDTREE_NORM_PARTS", "0")
    expected = [run_together(Engine(config), [job]) for job in jobs]
    norms, calls = [], []
    eager = layers.NormedRows.eager
    monkeypatch.setattr(layers.NormedRows, "eager", lambda self: norms.append(self.shape[0]) or eager(self))
    assert [run_together(Engine(config), [job]) for job in jobs] == expected
    norms_without = len(norms)
    norms.clear()
    monkeypatch.setattr(layers.kernels, "gemv_kernel", lambda device: lambda x, w, **k: calls.append(
        (x.shape[0], "norm_out" in k, "norm_in" in k)) or kernel(x, w, **k))
    monkeypatch.setenv("DDTREE_NORM_PARTS", "1")
    assert [run_together(Engine(config), [job]) for job in jobs] == expected
    outs, ins = [r for r, out, _ in calls if out], [r for r, _, into in calls if into]
    assert outs and min(outs) > 1 and len(ins) == len(outs), (len(ins), len(outs))
    assert len(norms) == norms_without - len(ins), (len(norms), norms_without, len(ins))


def test_tuned_configs_read_a_gemv_bench_result(tmp_path, monkeypatch):
    """DDTREE_GEMV_TUNED=<gemv_bench json>:<rows> gives linear_rows the configurations that run chose, per form."""
    import json

    module = gemv_module()
    shapes = {"17": {"64x512 None": {"plain": {"config": [16, 128, 4, 2]}, "swap": {"config": [32, 64, 4, 2]}}}}
    path = tmp_path / "gemv.json"
    path.write_text(json.dumps({"shapes": shapes}))
    assert module.tuned_configs(f"{path}:17") == {(64, 512, False, 32): (16, 128, 4, 2), (64, 512, True, 32): (32, 64, 4, 2)}
    assert module.tuned_configs("") == {}
    monkeypatch.setenv("DDTREE_GEMV_TUNED", f"{path}:17")
    x, w = torch.randn(17, 512), torch.randn(64, 512)
    for rows in (17, 16):   # 16 rows: a program of 16, not the one tuned
        for swap in (False, True):
            torch.testing.assert_close(module.linear_rows(x[:rows], w, swap=swap), F.linear(x[:rows], w), rtol=1e-5,
                                       atol=1e-4)


def test_the_few_rows_pipeline_fits_the_devices_shared_memory(monkeypatch):
    """The few-rows kernel's stages are cut to what the device gives a block (shared_budget): Hopper's 227 KB leave the
    H200's configurations as they are (SHARED_BYTES), an RTX PRO 6000 Blackwell's 99 KB (sm_120) cut every one of
    them to fit, the lm_head's and the swapped 14336-wide ones among them (120 KB compiled for sm120 with Hopper's
    cuts: perf/results/kernel_resources_sm120_hopper_cuts.md); off CUDA nothing is cut further."""
    import types

    module = gemv_module()
    budgets = {}
    try:
        for name, optin in (("hopper", 232448), ("blackwell", 101376)):   # what torch reports for sm_90 and sm_120
            props = types.SimpleNamespace(shared_memory_per_block_optin=optin)
            monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
            module.shared_budget.cache_clear()
            budgets[name] = module.shared_budget(torch.device("cuda", 0))
    finally:
        module.shared_budget.cache_clear()   # nothing faked stays cached for a real device
        monkeypatch.undo()
    assert budgets == {"hopper": module.SHARED_BYTES, "blackwell": 101376 - module.SHARED_SPARE}
    assert module.shared_budget(torch.device("cpu")) == module.SHARED_BYTES
    # linear_rows asks for its device's budget (here a fake one: the interpreter's CPU tensors have the default)
    asked, rows_config = [], module.rows_config
    monkeypatch.setattr(module, "shared_budget", lambda device: asked.append(device) or budgets["blackwell"])
    monkeypatch.setattr(module, "rows_config", lambda *args: asked.append(args[-1]) or rows_config(*args))
    x, w = torch.randn(17, 512), torch.randn(64, 512)
    torch.testing.assert_close(module.linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert asked == [x.device, budgets["blackwell"]]
    monkeypatch.undo()
    shapes = set(module.ROWS_CONFIGS) | set(module.SWAP_CONFIGS) | {(n, k) for n, k, _ in module.CONFIGS}
    cut = 0
    for (n, k), block_m, swap in ((s, m, w) for s in sorted(shapes) for m in (16, 32, 128) for w in (False, True)):
        hopper = module.rows_config(n, k, block_m, swap, 2, budget=budgets["hopper"])
        block_n, block_k, warps, stages = module.rows_config(n, k, block_m, swap, 2, budget=budgets["blackwell"])
        assert stages * (block_m + block_n) * block_k * 2 <= budgets["blackwell"], (n, k, block_m, swap)
        assert stages >= 2 and block_n == hopper[0] and warps == hopper[2]
        cut += (block_k, stages) != (hopper[1], hopper[3])
    assert cut > 0


# PDL's form (kernels.pdl): the weight's first tile loaded first, its step peeled off the loop (linear_rows' _peel
# alone: the interpreter cannot run the wait between them). The same products summed in the same order as the single
# loop's, so the outputs are exactly equal.
@pytest.mark.parametrize("norm_first", ["0", "1"])
@pytest.mark.parametrize("k, config", [(1000, (16, 256, 4, 2)), (120, (8, 128, 4, 3)), (512, (8, 128, 4, 3))])
def test_the_peeled_gemv_computes_what_its_loop_computes(k, config, norm_first, monkeypatch):
    """Every prologue, over several steps with a partial last one, one partial step, and whole steps."""
    monkeypatch.setenv("DDTREE_GEMV_NORM_FIRST", norm_first)
    linear_rows = gemv_module().linear_rows
    w = torch.randn(23, k, generator=torch.Generator().manual_seed(k))
    x, cases = prologue_cases(k, 23, 8, seed=k)
    for prologue, kwargs, _, _ in cases:
        loop = linear_rows(x, w, config, prologue=prologue, _peel=False, **kwargs)
        peeled = linear_rows(x, w, config, prologue=prologue, _peel=True, **kwargs)
        assert torch.equal(peeled, loop), prologue


@pytest.mark.parametrize("rows", [2, 16, 17])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("k, config", [(300, (16, 128, 4, 3)), (100, (32, 128, 4, 2))])
def test_the_peeled_rows_kernel_computes_what_its_loop_computes(rows, swap, k, config):
    """The few-rows kernel in both forms, with and without the residual add, over several steps and one partial one."""
    linear_rows = gemv_module().linear_rows
    gen = torch.Generator().manual_seed(rows * k)
    x, w, add = torch.randn(rows, k, generator=gen), torch.randn(37, k, generator=gen), torch.randn(rows, 37, generator=gen)
    for residual in (None, add):
        loop = linear_rows(x, w, config, swap=swap, add=residual, _peel=False)
        peeled = linear_rows(x, w, config, swap=swap, add=residual, _peel=True)
        assert torch.equal(peeled, loop), residual is None
        torch.testing.assert_close(loop, F.linear(x, w) + (0 if residual is None else residual), rtol=1e-5, atol=1e-4)


def test_gemv_bench_gives_a_dense_models_linears_their_own_prologues():
    """perf/gemv_bench.linears on a dense shape: o_proj without the hybrid's sigmoid gate, the fused q/k/v and gate/up
    after a norm, down_proj after silu * up, the residual added by o_proj and down_proj."""
    from perf.gemv_bench import linears
    from perf.gpu_ratios import dense_target

    kinds = [(kind, group, add) for _, kind, group, add in linears(dense_target("tiny-dense", torch.float32, "cpu"))]
    assert kinds[:4] == [(None, 1, True), ("norm", 1, False), ("silu_mul", 1, True), ("norm", 1, False)]
    assert kinds[-1] == (None, 1, False)   # the lm_head
