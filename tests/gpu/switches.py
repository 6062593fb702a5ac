"""A GPU test helper: greedy decoding with a kernel switch off and on."""

from __future__ import annotations

import torch


def tiny_config(family: str, tiny_models, tmp_path):
    """A CUDA engine config of the tiny qwen3 target or a tiny hybrid one (made under tmp_path) with its drafter."""
    from ddtree.config import EngineConfig
    from tests.unit.oracle import make_tiny_hybrid

    if family == "hybrid":
        root, _ = make_tiny_hybrid(tmp_path)
        target, drafter = root / "target", root / "dflash"
    else:
        target, drafter = tiny_models / "qwen3-target", tiny_models / "qwen3-dflash"
    return EngineConfig(target_path=str(target), drafter_path=str(drafter), max_model_len=300, max_tree_budget=64,
                        device="cuda")


def assert_switch_keeps_greedy_tokens(monkeypatch, variable: str | tuple[str, ...], config, cases: list[tuple[str, int]],
                                      seed: int) -> None:
    """Greedy tokens of each (mode, budget) with environment `variable` = 0 == with it = 1 (fresh engines, so each
    captures its own graphs under its setting); a tuple: those variables switched together."""
    from ddtree.engine import Engine
    from ddtree.sampling_params import SamplingParams

    prompt = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    outputs = {}
    for value in ("0", "1"):
        for name in (variable,) if isinstance(variable, str) else variable:
            monkeypatch.setenv(name, value)
        engine = Engine(config)
        outputs[value] = [engine.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, max_tokens=40,
                                                                     ignore_eos=True)).output_ids for mode, budget in cases]
    for (mode, budget), off, on in zip(cases, outputs["0"], outputs["1"]):
        assert on == off, f"{variable}=1 changed {mode}-{budget}"
