"""Read HF-layout checkpoints: config.json and safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)


def read_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    return json.loads(config_file.read_text())


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in checkpoint directory {path}")
    return files


def load_state_dict(path: str | Path, desc: str = "loading weights") -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, keyed as stored."""
    state: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
    for file in tqdm(files, desc=desc, unit="shard", disable=len(files) < 2):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                state[key] = handle.get_tensor(key)
    return state


def rope_theta(config: dict, default: float = 10000.0) -> float:
    """rope_theta from either the flat (transformers 4) or rope_parameters (transformers 5) layout."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", default)))


def rope_scaling(config: dict) -> dict | None:
    params = config.get("rope_scaling") or config.get("rope_parameters") or None
    if not params or params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return params


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load `state` (keys already renamed to the model's) into a meta-device model.

    A missing tensor is an error naming the checkpoint; tensors the model does not use (shared
    embeddings, MTP or vision weights) are logged and skipped.
    """
    expected = model.state_dict()
    missing = set(expected) - set(state)
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors {sorted(missing)[:8]}")
    unused = sorted(set(state) - set(expected))
    if unused:
        logger.info("%s: ignoring %d tensors not used here, e.g. %s", Path(path).name, len(unused), unused[:4])
    model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
