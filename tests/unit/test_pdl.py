"""Programmatic Dependent Launch (kernels.pdl, DDTREE_PDL): off by default and off the GPU; the compiled chains
(ddtree.models.fused) compile once per setting, read at each call. tests/gpu/test_pdl.py runs it on Hopper."""

from __future__ import annotations

import pytest
import torch

from ddtree.models import fused, kernels


@pytest.mark.parametrize("value", [None, "", "0", "1"])
def test_pdl_is_off_on_the_cpu_and_by_default(value, monkeypatch):
    if value is None:
        monkeypatch.delenv("DDTREE_PDL", raising=False)
    else:
        monkeypatch.setenv("DDTREE_PDL", value)
    monkeypatch.setattr(kernels, "_capability_major", lambda index: 9)   # a Hopper, were the device CUDA
    assert not kernels.pdl(torch.device("cpu"))
    assert kernels.pdl(torch.device("cuda", 0)) == (value == "1")


def test_pdl_needs_hopper(monkeypatch):
    monkeypatch.setenv("DDTREE_PDL", "1")
    for major, on in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(kernels, "_capability_major", lambda index, major=major: major)
        assert kernels.pdl(torch.device("cuda", 0)) == on


@pytest.mark.parametrize("value, gemv, swapped", [(None, True, False), ("1", True, False), ("0", False, False),
                                                  ("", False, False), ("all", True, True)])
def test_pdl_peels_the_first_weight_tile_where_it_costs_no_programs_an_sm(value, gemv, swapped, monkeypatch):
    """By default the GEMV and the rows-first few-rows kernel peel, the swapped form (a pipeline buffer more) does not."""
    from ddtree.models import gemv_kernel

    if value is None:
        monkeypatch.delenv("DDTREE_PDL_PEEL", raising=False)
    else:
        monkeypatch.setenv("DDTREE_PDL_PEEL", value)
    assert gemv_kernel.peel_first() is gemv
    assert gemv_kernel.peel_first(swapped=True) is swapped


class _CudaLike:
    """A first argument that the fused wrapper takes for a CUDA tensor (this machine has none)."""
    is_cuda = True
    device = torch.device("cuda", 0)


def test_fused_chains_compile_once_per_pdl_setting(monkeypatch):
    """One compiled object per setting, chosen at each call; inductor's triton.enable_pdl only with PDL."""
    made = []

    def compile_(fn, **kwargs):
        made.append(kwargs)
        return lambda *args, n=len(made): ("pdl" if kwargs.get("options") else "plain", n)

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(kernels, "_capability_major", lambda index: 9)
    chain = fused.fused(lambda x: x)
    with fused.static(), torch.no_grad():
        for value, want in (("0", ("plain", 1)), ("1", ("pdl", 2)), ("0", ("plain", 1)), ("1", ("pdl", 2))):
            monkeypatch.setenv("DDTREE_PDL", value)
            assert chain(_CudaLike()) == want, value
    assert made == [{"fullgraph": True}, {"fullgraph": True, "options": {"triton.enable_pdl": True}}]
    monkeypatch.setenv("DDTREE_PDL_CHAINS", "0")   # our kernels with PDL, the chains without
    with fused.static(), torch.no_grad():
        assert chain(_CudaLike()) == ("plain", 1)
    assert kernels.pdl(_CudaLike.device)


def test_inductor_takes_the_pdl_option():
    """This torch's inductor has triton.enable_pdl (else the chains run without PDL, logged once), and torch.compile
    accepts it as an option."""
    assert fused._inductor_pdl()
    torch.compile(lambda x: x + 1, fullgraph=True, options={"triton.enable_pdl": True})
