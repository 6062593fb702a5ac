"""The drafter loads the published z-lab DFlash layout and computes the published forward."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ddtree.models.dflash import DFlashDrafter, default_target_layer_ids

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK = 64, 4, 2, 16, 96, 5, 16
PUBLISHED_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight"]


def write_published_checkpoint(path, taps: list[int], seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """A checkpoint laid out as z-lab publishes it: Qwen3 config + dflash_config, 58 tensors."""
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": 99, "target_layer_ids": taps},
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_target_layers": 36, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 100,
        "max_position_embeddings": 40960, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * LAYERS, "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
              "self_attn.q_norm.weight": (HEAD_DIM,), "self_attn.k_norm.weight": (HEAD_DIM,),
              "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, INTER), "input_layernorm.weight": (HIDDEN,),
              "post_attention_layernorm.weight": (HIDDEN,)}
    state = {}
    for i in range(LAYERS):
        for key in PUBLISHED_KEYS:
            state[f"layers.{i}.{key}"] = 1 + 0.1 * torch.randn(shapes[key], generator=gen) if "norm" in key \
                else 0.05 * torch.randn(shapes[key], generator=gen)
    state["fc.weight"] = 0.05 * torch.randn(HIDDEN, HIDDEN * len(taps), generator=gen)
    state["hidden_norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    state["norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    # published weights are bf16; split over two shards with an index, as large checkpoints are
    half = sorted(state)[: len(state) // 2]
    shard1 = {k: state[k].bfloat16() for k in half}
    shard2 = {k: state[k].bfloat16() for k in state if k not in half}
    save_file(shard1, str(path / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in shard1},
                            **{k: "model-00002-of-00002.safetensors" for k in shard2}}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return {k: v.bfloat16().float() for k, v in state.items()}


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=1000000.0):
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    rot = torch.cat([-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def reference_draft(state, taps_all, noise, start, windows=(None,) * LAYERS):
    """Straight from the published description: all context recomputed, no cache."""
    ctx = rms(taps_all @ state["fc.weight"].T, state["hidden_norm.weight"])
    h = noise
    pos = torch.arange(start + BLOCK)
    for i in range(LAYERS):
        p = lambda k: state[f"layers.{i}.{k}"]  # noqa: E731
        x = rms(h, p("input_layernorm.weight"))
        q = rms((x @ p("self_attn.q_proj.weight").T).view(BLOCK, HEADS, HEAD_DIM), p("self_attn.q_norm.weight"))
        kv_in = torch.cat([ctx, x])
        k = rms((kv_in @ p("self_attn.k_proj.weight").T).view(-1, KV_HEADS, HEAD_DIM), p("self_attn.k_norm.weight"))
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rope(q, pos[-BLOCK:]), rope(k, pos)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
        if windows[i] is not None:   # sliding-window layer: keys within `window` positions behind the query
            visible = (pos[-BLOCK:, None] - pos[None, :]) < windows[i]
            scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.softmax(scores, -1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(BLOCK, -1)
        h = h + out @ p("self_attn.o_proj.weight").T
        y = rms(h, p("post_attention_layernorm.weight"))
        h = h + (F.silu(y @ p("mlp.gate_proj.weight").T) * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return rms(h, state["norm.weight"])


def test_default_taps_match_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(30, 1) == [15]


@pytest.mark.parametrize("chunks", [[23], [10, 6, 7]])
def test_loads_published_layout_and_matches_reference(tmp_path, chunks):
    taps = [1, 9, 17, 25, 33]
    state = write_published_checkpoint(tmp_path / "drafter", taps)
    assert len(state) == 58
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.config.block_size == BLOCK and drafter.config.mask_token_id == 99
    assert list(drafter.config.target_layer_ids) == taps
    gen = torch.Generator().manual_seed(1)
    start = sum(chunks)
    taps_all = torch.randn(start, HIDDEN * len(taps), generator=gen)
    noise = torch.randn(BLOCK, HIDDEN, generator=gen)
    cache = drafter.new_cache(64)
    offset = 0
    with torch.no_grad():
        for size in chunks:   # context arrives round by round
            drafter.add_context(cache, taps_all[offset : offset + size])
            offset += size
        ours = drafter(cache, noise, start)
    torch.testing.assert_close(ours, reference_draft(state, taps_all, noise, start), rtol=2e-4, atol=2e-4)


def test_missing_tensor_is_a_clear_error(tmp_path):
    write_published_checkpoint(tmp_path / "d", [1, 9, 17, 25, 33])
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    (tmp_path / "d" / "model-00002-of-00002.safetensors").unlink()
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "00001" in v}
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lacks tensors"):
        DFlashDrafter.from_pretrained(tmp_path / "d")


def test_qwen36_drafter_format(tmp_path):
    """The Qwen3.6-27B drafter's format: mask 248070, taps [1,16,31,46,61], sliding-window layers [S,S,S,S,F]."""
    taps = [1, 16, 31, 46, 61]
    window = 6   # 2048 in the published config; small here so that the window really cuts the context
    state = write_published_checkpoint(
        tmp_path / "d", taps, seed=3, num_target_layers=64, sliding_window=window,
        dflash_config={"mask_token_id": 248070, "target_layer_ids": taps}, vocab_size=248320,
        layer_types=["sliding_attention"] * 4 + ["full_attention"])
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert drafter.config.mask_token_id == 248070 and list(drafter.config.target_layer_ids) == taps
    assert drafter.config.sliding_windows == (window,) * 4 + (None,)
    gen = torch.Generator().manual_seed(2)
    start = 21
    taps_all = torch.randn(start, HIDDEN * len(taps), generator=gen)
    noise = torch.randn(BLOCK, HIDDEN, generator=gen)
    cache = drafter.new_cache(64)
    with torch.no_grad():
        drafter.add_context(cache, taps_all)
        ours = drafter(cache, noise, start)
    expected = reference_draft(state, taps_all, noise, start, windows=(window,) * 4 + (None,))
    torch.testing.assert_close(ours, expected, rtol=2e-4, atol=2e-4)
    unwindowed = reference_draft(state, taps_all, noise, start)
    assert not torch.allclose(ours, unwindowed, atol=1e-3), "the window changed nothing: the test is vacuous"


def test_packed_blocks_equal_one_at_a_time(tmp_path):
    """Several requests' blocks in one pooled pass (contexts of different lengths, padding masked, sliding windows
    that cut) == each block drafted alone from its own cache; contexts added for all requests at once."""
    taps = [1, 16, 31, 46, 61]
    write_published_checkpoint(tmp_path / "d", taps, seed=4, num_target_layers=64, sliding_window=6,
                               layer_types=["sliding_attention"] * 4 + ["full_attention"])
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d")
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 21, 9]
    contexts = [torch.randn(n, HIDDEN * len(taps), generator=gen) for n in lengths]
    blocks = torch.randn(len(lengths), BLOCK, HIDDEN, generator=gen)
    with torch.no_grad():
        pooled = drafter.new_caches(len(lengths), 64)
        drafter.add_contexts(pooled, [c[:2] for c in contexts])     # context arrives in two rounds
        drafter.add_contexts(pooled, [c[2:] for c in contexts])
        packed = drafter.forward_packed(pooled, blocks, lengths)
        for j, n in enumerate(lengths):
            alone = drafter.new_cache(64)
            drafter.add_context(alone, contexts[j])
            torch.testing.assert_close(packed[j], drafter(alone, blocks[j], n), rtol=1e-5, atol=1e-5)
