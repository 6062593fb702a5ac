"""Our one-row GEMV and few-rows kernel with their prologues (ddtree.models.gemv_kernel) compiled on the GPU against the eager chains and
F.linear, in float32 and bf16, inside a CUDA graph too; and engines with it against engines without
(DDTREE_GEMV_KERNEL). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_gemv_kernel import prologue_cases

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("norm_first", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(5120, 6144), (300, 1000), (34816, 512)])
@pytest.mark.parametrize("rows, swap", [(1, "0"), (16, "0"), (65, "0"), (16, "1"), (17, "1"), (65, "1")])
def test_prologues_equal_their_eager_chains_on_the_gpu(dtype, n, k, norm_first, rows, swap, monkeypatch):
    """Each prologue's Linear == F.linear of the eager chain's output (which rounds to dtype where the prologue
    rounds; the norms' default form does not round their input), plus the residual stream where the epilogue adds
    it: to float32 rounding in float32, to a bf16 ulp or two of the output's scale in bf16."""
    from ddtree.models.gemv_kernel import linear_rows

    monkeypatch.setenv("DDTREE_GEMV_NORM_FIRST", norm_first)
    monkeypatch.setenv("DDTREE_GEMV_SWAP", swap)   # more than one row: the few-rows kernel's form

    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / k**0.5).to("cuda", dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    x, cases = prologue_cases(k, n, 8 if k % 128 else 128, seed=n + k, device="cuda", dtype=dtype, rows=rows)
    with torch.inference_mode():
        for prologue, kwargs, chained, residual in cases:
            if rows > 1 and prologue is not None:
                continue
            want = F.linear(chained, w) if residual is None else residual + F.linear(chained, w)
            got = linear_rows(x, w, prologue=prologue, **kwargs).float()
            scale = want.float().abs().max().clamp(min=1.0)
            assert (got - want.float()).abs().max() <= tolerance * scale, f"{prologue} {dtype} {n}x{k} {rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(17408, 5120), (300, 1000)])
@pytest.mark.parametrize("rows, swap", [(16, "0"), (17, "1"), (16, "1"), (17, "0")])
def test_rows_glu_form_equals_the_product_then_silu_times_up_on_the_gpu(dtype, n, k, rows, swap, monkeypatch):
    """linear_rows(x, [gate; up], glu=True) == fused.silu_mul(*F.linear(x, [gate; up]).split(n)): to float32 rounding
    in float32; in bf16 to a bf16 ulp or two of the output's scale (the epilogue rounds gate, up, silu and the
    product where the chain does; the products' sums differ from cuBLAS's in their order only)."""
    from ddtree.models import fused
    from ddtree.models.gemv_kernel import linear_rows

    monkeypatch.setenv("DDTREE_GEMV_SWAP", swap)
    gen = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(2 * n, k, generator=gen) / k**0.5).to("cuda", dtype)
    x = torch.randn(rows, k, generator=gen).to("cuda", dtype)
    with torch.inference_mode():
        want = fused.silu_mul.eager(*F.linear(x, w).split(n, dim=-1)).float()
        got = linear_rows(x, w, glu=True).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape and (got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1.0)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_engine_with_the_rows_glu_form_decodes_what_it_decodes_without(family, tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with each gated MLP's silu(gate) * up of a few rows in the
    epilogue of its gate/up product (DDTREE_ROWS_GLU=1, kernels.rows_glu) == with the chain's own kernel."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_ROWS_GLU", tiny_config(family, tiny_models, tmp_path),
                                      [("dflash", 1), ("ddtree", 16)], seed=8)


@pytest.mark.parametrize("rows, swap", [(1, "0"), (16, "0"), (17, "1")])
def test_gemv_replays_from_a_cuda_graph(rows, swap, monkeypatch):
    from ddtree.models.gemv_kernel import linear_rows

    monkeypatch.setenv("DDTREE_GEMV_SWAP", swap)

    x, w = torch.randn(rows, 4096, device="cuda"), torch.randn(1000, 4096, device="cuda")
    linear_rows(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_rows(x, w)
    x.copy_(torch.randn(rows, 4096, device="cuda"))
    graph.replay()
    # against float64: two fp32 sums of 4096 products differ by their rounding (~1e-6 of the largest output; a fixed
    # atol of 1e-4 failed once in 16-row runs), while a stale or wrong row is off by the order of the outputs
    want = F.linear(x.double(), w.double())
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_hybrid_engine_with_every_verify_fusion_decodes_what_it_decodes_without(tiny_models, monkeypatch, tmp_path):
    """The GLU form and the GDN gates in the conv's kernel on together (the default since 27d901e; gpu_ratios'
    static-noglugates turns both off): greedy tokens (fp32, static forwards with graphs) == both off."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, ("DDTREE_ROWS_GLU", "DDTREE_TREE_GATES"),
                                      tiny_config("hybrid", tiny_models, tmp_path), [("dflash", 1), ("ddtree", 16)],
                                      seed=11)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_engine_with_the_gemv_decodes_what_it_decodes_without(family, tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with the Linears of up to gemv_max_rows() rows through our
    GEMV and few-rows kernel == through cuBLAS."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_GEMV_KERNEL", tiny_config(family, tiny_models, tmp_path),
                                      [("ar", 1), ("dflash", 1), ("ddtree", 16)], seed=6)


def test_hybrid_engine_with_prologue_views_decodes_what_it_decodes_without(tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with the hybrid's gated norms and sigmoid gates before the
    few-rows kernel reading their strided gates as views (DDTREE_PROLOGUE_VIEWS=1, kernels.prologue_views) == after
    copying them (the dense family has neither)."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_PROLOGUE_VIEWS", tiny_config("hybrid", tiny_models, tmp_path),
                                      [("dflash", 1), ("ddtree", 16)], seed=13)


def test_hybrid_engine_with_the_norms_across_products_decodes_what_it_decodes_without(tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with the hybrid's norms of the stream taken across the
    products around them (DDTREE_NORM_PARTS, on by default; kernels.norm_parts) == each norm's own kernel (=0)."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_NORM_PARTS", tiny_config("hybrid", tiny_models, tmp_path),
                                      [("dflash", 1), ("ddtree", 16)], seed=17)


@pytest.mark.parametrize("rows", [16, 17, 65])
@pytest.mark.parametrize("glu", [False, True])
def test_a_norm_across_two_products_is_the_norm_between_them_at_27b_shapes_in_bf16(rows, glu):
    """norm_out then norm_in at a 27B layer's shapes (down_proj into the stream, then gate/up or the GDN's input
    projections over it) in bf16: to a bf16 ulp or two of the output's scale from the norm computed apart."""
    from ddtree.models import fused
    from ddtree.models.gemv_kernel import linear_rows

    gen = torch.Generator().manual_seed(rows + glu)
    n2 = 34816 if glu else 16480

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    a, w1, add, w2 = rand(rows, 17408), rand(5120, 17408) / 17408**0.5, rand(rows, 5120), rand(n2, 5120) / 5120**0.5
    scale = (1.0 + 0.1 * torch.randn(5120, generator=gen)).cuda()
    with torch.inference_mode():
        h, y, parts = linear_rows(a, w1, add=add, norm_out=scale)
        got = linear_rows(y, w2, glu=glu, norm_in=parts, eps=1e-6).float()
        want = F.linear(fused.zero_centered_rms_norm.eager(h, scale, 1e-6), w2)
        if glu:
            want = fused.silu_mul.eager(*want.split(n2 // 2, dim=-1))
    want = want.float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max().clamp(min=1.0)
