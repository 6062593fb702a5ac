"""Read HF-layout checkpoints: config.json and safetensors (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


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
