"""sha256 over a checkpoint's tensors (names, dtypes, shapes and bytes, in name order).

Identifies weights independently of the safetensors header layout, e.g. to check that a
conversion on another machine produced exactly the local weights.

    python scripts/tensor_digest.py models/smollm2-135m-instruct
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.loader import load_state_dict  # noqa: E402


def digest(path: str) -> str:
    state = load_state_dict(path)
    h = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].contiguous()
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    print(digest(sys.argv[1]))
