"""load_target(path) -> the serving forward for the checkpoint's architecture."""

from __future__ import annotations

from pathlib import Path

import torch

from ddtree.models.dense import DenseTarget
from ddtree.models.loader import read_config
from ddtree.models.qwen3_5 import HYBRID_TYPES, HybridTarget


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DenseTarget | HybridTarget:
    if read_config(path).get("model_type") in HYBRID_TYPES:
        return HybridTarget.from_pretrained(path, dtype, device)
    return DenseTarget.from_pretrained(path, dtype, device)
