"""DDTREE_PROLOGUE_VIEWS (kernels.prologue_views): the gated norm and the sigmoid gate computed before the few-rows
kernel read their strided gates as views, no copy: the same values as after the copy, and the same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree.models import layers
from ddtree.models.qwen3_5 import GatedRMSNorm

COPIES = ("aten.clone.default", "aten.copy_.default", "aten._to_copy.default", "aten.contiguous.default")


class Copies(TorchDispatchMode):
    """The copies torch dispatches inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in COPIES:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def eager(prologue, views: bool, monkeypatch) -> tuple[torch.Tensor, list[str]]:
    monkeypatch.setenv("DDTREE_PROLOGUE_VIEWS", "1" if views else "0")
    with Copies() as copies:
        out = prologue.eager()
    return out, copies.seen


@pytest.mark.parametrize("kind", ["gated_norm", "sigmoid_gate"])
def test_prologues_read_their_strided_gates_as_views(kind, monkeypatch):
    """A GDN output's gated norm (z a column slice of the fused projection, as GatedDeltaNet.forward passes it) and an
    attention output's sigmoid gate (the gate half of each head's q/gate columns): with the switch no copy is
    dispatched and the output equals the one computed after the copy the switch saves, to the last bit of float32
    (torch's CPU sigmoid rounds a strided input's elements apart from a contiguous one's, one unit at most)."""
    gen = torch.Generator().manual_seed(0)
    n, heads, group = 5, 4, 8
    if kind == "gated_norm":
        projected = torch.randn(n, 3 * heads * group, generator=gen)
        z = projected[:, heads * group: 2 * heads * group]                 # rows 3 x heads x group apart
        norm = GatedRMSNorm(group, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(group, generator=gen) + 0.5)
        prologue = layers.GatedNormed(norm, torch.randn(n, heads * group, generator=gen), z, group)
    else:
        q_gate = torch.randn(n, heads, 2 * group, generator=gen)
        _, gate = q_gate.chunk(2, dim=-1)                                   # [n, heads, group], strided
        prologue = layers.SigmoidGated(torch.randn(n, heads * group, generator=gen), gate)
    copied, seen = eager(prologue, False, monkeypatch)
    assert seen, "the form without views copies the gate"
    viewed, seen = eager(prologue, True, monkeypatch)
    assert not seen, seen
    assert viewed.shape == copied.shape == (n, heads * group)
    torch.testing.assert_close(viewed, copied, rtol=2.4e-7, atol=1e-7)


def test_engine_with_prologue_views_decodes_what_it_decodes_without(tmp_path, monkeypatch):
    """The tiny hybrid (gated norms, sigmoid-gated attention) on the CPU, where every prologue is computed eagerly:
    greedy `ar`, `dflash` and `ddtree` tokens with the switch == without."""
    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.sampling_params import SamplingParams
    from tests.unit.test_batching import make_hybrid

    target, drafter = make_hybrid(tmp_path)
    config = EngineConfig(target_path=str(target), drafter_path=str(drafter), dtype="float32", max_model_len=128)
    prompt = torch.randint(0, 90, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    cases = [("ar", 1), ("dflash", 1), ("ddtree", 16)]
    outputs = {}
    for views in ("0", "1"):
        monkeypatch.setenv("DDTREE_PROLOGUE_VIEWS", views)
        engine = Engine(config)
        outputs[views] = [engine.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, max_tokens=24,
                                                                     ignore_eos=True)).output_ids for mode, budget in cases]
    assert outputs["1"] == outputs["0"]


def test_prologue_views_are_on_by_default(monkeypatch):
    """On unless DDTREE_PROLOGUE_VIEWS is 0 or empty (measured on an H100: perf/results/gpu_ratios_h100_viewsreplay.md)."""
    from ddtree.models import kernels

    monkeypatch.delenv("DDTREE_PROLOGUE_VIEWS", raising=False)
    assert kernels.prologue_views()
    for off in ("0", ""):
        monkeypatch.setenv("DDTREE_PROLOGUE_VIEWS", off)
        assert not kernels.prologue_views()
