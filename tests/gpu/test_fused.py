"""The fused elementwise chains (ddtree.models.fused) compiled on the GPU against the same functions run eagerly,
and an engine with them compiled against one without. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ddtree.models import fused

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def chain_inputs(n: int, dtype: torch.dtype) -> dict[str, tuple]:
    """Arguments of every chain for n rows (small widths; the conv window indexes cat(conv_state.T, x))."""
    g = torch.Generator(device="cuda").manual_seed(n)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dt)

    hidden, channels, kernel, heads, d, r = 256, 96, 4, 4, 32, 8
    x = rand(n, hidden)
    return {
        "rms_norm": (x, rand(hidden), 1e-6),
        "add_rms_norm": (x, rand(n, hidden), rand(hidden), 1e-6),
        "add_zero_centered_rms_norm": (x, rand(n, hidden), rand(hidden, dt=torch.float32), 1e-6),
        "zero_centered_rms_norm": (x, rand(hidden, dt=torch.float32), 1e-6),
        "gated_rms_norm": (rand(n * heads, d), rand(n * heads, d), rand(d), 1e-6),
        "silu_mul": (x, rand(n, hidden)),
        "sigmoid_gate": (x, rand(n, hidden)),
        "rotary": (rand(n, heads, d), rand(n, d), rand(n, d)),
        "rms_norm_rotary": (rand(n, heads, d), rand(d), 1e-6, rand(n, d), rand(n, d)),
        "zero_centered_norm_partial_rotary": (rand(n, heads, d), rand(d, dt=torch.float32), 1e-6, rand(n, r), rand(n, r)),
        "gdn_gates": (rand(n, heads), rand(n, heads), -rand(heads, dt=torch.float32).abs(), rand(heads)),
        "conv_windows": (rand(n, channels), rand(channels, kernel), rand(channels, kernel, dt=torch.float32),
                         torch.randint(0, kernel + n, (n, kernel), generator=g, device="cuda")),
        "shifted_window": (rand(channels, kernel), rand(1, channels)),
        "conv_steps": (rand(n, channels), rand(n, channels, kernel), rand(channels, kernel, dt=torch.float32)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chains_equal_eager(dtype):
    """Each chain at 1, 3 and 17 rows (the second shape recompiles with dynamic rows), compiled == eager: to float32
    rounding in float32, to a bf16 ulp in bf16 (emulate_precision_casts rounds where eager rounds)."""
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    with torch.inference_mode(), fused.static():
        for n in (1, 3, 17):
            for name, args in chain_inputs(n, dtype).items():
                chain = getattr(fused, name)
                got, want = chain(*args), chain.eager(*args)
                got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape, name
                    scale = b.float().abs().max().clamp(min=1.0)
                    assert (a.float() - b.float()).abs().max() <= tolerance * scale, f"{name} n={n} {dtype}"


def test_compiled_chains_are_captured_in_a_graph():
    """A compiled chain replays from a CUDA graph on new inputs (the static forwards capture them)."""
    x, w = torch.randn(5, 256, device="cuda"), torch.randn(256, device="cuda")
    with torch.inference_mode(), fused.static():
        fused.rms_norm(x, w, 1e-6)                      # compiles (the warm-up)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused.rms_norm(x, w, 1e-6)
        x.copy_(torch.randn(5, 256, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, fused.rms_norm.eager(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_engine_with_compiled_chains_decodes_what_eager_decodes(family, tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with the chains compiled == with DDTREE_COMPILE=0."""
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_COMPILE", tiny_config(family, tiny_models, tmp_path),
                                      [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)], seed=5)
