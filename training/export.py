"""Ship a trained drafter in the published DFlash layout: config.json, safetensors shards of at most
`shard_mb` with a model.safetensors.index.json, a loss-curve PNG and a model card."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.models.loader import dtype_of


def save_sharded(state: dict[str, torch.Tensor], out: Path, shard_mb: float) -> list[str]:
    limit = int(shard_mb * 1024 * 1024 * 0.98)     # headroom for the safetensors header
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if nbytes > limit:
            raise ValueError(f"tensor {key} ({nbytes} bytes) exceeds the shard size")
        if size + nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = state[key].contiguous()
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names


def plot_loss(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    steps = [r["step"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [r["loss"] for r in records])
    left.set(xlabel="step", ylabel="weighted block cross-entropy", title="training loss")
    right.plot(steps, [r["tau_chain"] for r in records], label="greedy chain acceptance (train batch)")
    right.plot(steps, [r["acc1"] for r in records], label="slot-1 accuracy")
    right.set(xlabel="step", title="acceptance proxies")
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def export(run_dir: Path, out: Path, hf_config: dict, shard_mb: float, dtype: str, card: dict) -> None:
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'}: train first")
    state = torch.load(ckpts[-1], map_location="cpu")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    weights = {k: v.to(dtype_of(dtype)) for k, v in state["drafter"].items()}
    shards = save_sharded(weights, out, shard_mb)
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}, indent=2) + "\n")
    log = run_dir / "train_log.jsonl"
    plot_loss(log, out / "loss_curve.png")
    last = json.loads(log.read_text().splitlines()[-1])
    (out / "README.md").write_text(model_card(hf_config, state["step"], last, shards, card))


def model_card(hf: dict, step: int, last: dict, shards: list[str], card: dict) -> str:
    data = card["data"]
    lines = [
        f"# {card['name']}",
        "",
        f"DFlash block-diffusion drafter for `{card['target']}`, trained with this repository's `training/` "
        "package. Published z-lab layout (`DFlashDraftModel`): load it with `ddtree.models.dflash.DFlashDrafter`.",
        "",
        "## Architecture",
        f"- {hf['num_hidden_layers']} draft layers, hidden {hf['hidden_size']}, block size {hf['block_size']}, "
        f"mask token id {hf['dflash_config']['mask_token_id']}, target taps {hf['dflash_config']['target_layer_ids']} "
        "(output of layer L); embedding and lm_head are the target's.",
        f"- weights: {len(shards)} safetensors shard(s), {card['dtype']}.",
        "",
        "## Data",
        f"- {data['num_prompts']} instructions derived from Python {data['python']} standard-library docstrings "
        "(`training/prompts.py`; no evaluation prompt among them), answered by the target itself "
        f"(temperature {data['temperature']}, up to {data['max_new_tokens']} new tokens): {data['num_sequences']} "
        f"sequences, {data['response_tokens']} response tokens.",
        "",
        "## Training",
        f"- {step} steps, {card['train']['batch_size']} sequences x {card['train']['blocks_per_seq']} random anchors "
        f"per step (x {card['train']['grad_accum']} accumulation x {card['world']} processes), AdamW lr "
        f"{card['train']['lr']} cosine, slot weights exp(-(k-1)/{card['train']['loss_gamma']}), "
        f"{card['train']['mixed_precision'] if 'cuda' in card['device'] else 'fp32'} on {card['device']}; "
        f"{last['seconds']:.0f} s.",
        f"- final (mean of the last logging window): loss {last['loss']:.3f}, slot-1 accuracy {last['acc1']:.3f}, "
        f"greedy chain acceptance on training blocks {last['tau_chain']:.2f}.",
        "- config: `training_config.json` beside this card; loss curve: `loss_curve.png`.",
        "",
        "![loss](loss_curve.png)",
        "",
        "## Measured acceptance",
        "See `perf/results/humaneval_*.md` (HumanEval, mean acceptance length per method and budget).",
        "",
    ]
    return "\n".join(lines)
