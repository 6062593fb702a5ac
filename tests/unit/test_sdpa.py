"""ddtree.models.layers.sdpa: the repeated form (masked eager calls on CUDA: K/V heads repeated, no cuDNN)
computes what PyTorch's GQA call computes; the CPU and static forwards keep PyTorch's call; perf/sdpa_probe.py writes
its table."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ddtree.models import layers
from perf import sdpa_probe


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_the_repeated_form_equals_the_gqa_call(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, 5, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, 12, 16, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 5, 12, generator=gen) < 0.6
    mask[..., 0] = True                                  # every row sees a key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=heads != kv_heads)
    out = layers.sdpa(q, k, v, mask, 0.3, repeat_kv=True)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    # query head h reads K/V head h // (heads / kv_heads): a wrong grouping differs
    if 1 < kv_heads < heads:
        wrong = F.scaled_dot_product_attention(q, k.repeat(1, heads // kv_heads, 1, 1), v.repeat(1, heads // kv_heads, 1, 1),
                                               attn_mask=mask, scale=0.3)
        assert not torch.allclose(out, wrong, atol=1e-3)


def test_the_cpu_keeps_pytorchs_call(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recording)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    layers.sdpa(q, k, k, mask, 0.5)
    layers.sdpa(q, k, k, mask, 0.5, repeat_kv=True)
    assert calls == [(2, True), (4, False)]   # the CPU: PyTorch's GQA call; the repeated form: K/V heads repeated


def test_eager_cuda_calls_repeat_and_static_forwards_keep_pytorchs_choice(monkeypatch):
    from ddtree.models import fused
    monkeypatch.delenv("DDTREE_SDPA_CUDNN", raising=False)
    assert layers.repeats_kv(True) and not layers.repeats_kv(False)
    with fused.static():   # a static forward's body: bucketed shapes, cuDNN's plan built once at capture
        assert not layers.repeats_kv(True)
    assert layers.repeats_kv(True)
    monkeypatch.setenv("DDTREE_SDPA_CUDNN", "1")
    assert not layers.repeats_kv(True)


def test_the_probe_writes_its_table(tmp_path):
    result = sdpa_probe.main(["--device", "cpu", "--dtype", "float32", "--lengths", "2", "--forms", "default,repeated",
                              "--out", str(tmp_path), "--name", "p"])
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [r["length"] for r in saved["forms"]["repeated"]] == [170, 171] and saved["forms"] == result["forms"]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for rows in saved["forms"].values() for r in rows)
    assert "| repeated | 170-171 |" in (tmp_path / "p.md").read_text()
