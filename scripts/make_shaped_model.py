"""A random-weight checkpoint with the exact shapes (config.json) and tokenizer of a real one.

For speed measurements where the real weights cannot travel (the GPU machine takes at most
64 MiB per call): every request then decodes a fixed number of tokens (ignore_eos), so the
time per token depends on the shapes alone. Acceptance is not meaningful with random weights.

    python scripts/make_shaped_model.py --like models/smollm2-135m-instruct --out models/smollm2-shaped
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.dense import DenseConfig, DenseTarget  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True, help="directory with config.json (+ tokenizer files)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    like, out = Path(args.like), Path(args.out)
    hf = json.loads((like / "config.json").read_text())
    torch.manual_seed(args.seed)
    model = DenseTarget(DenseConfig.from_hf(hf))
    dtype = getattr(torch, args.dtype)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight"):
            value = torch.ones_like(tensor)
        else:
            value = torch.randn_like(tensor) * 0.02
        key = name if name.startswith("lm_head") else f"model.{name}"
        state[key] = value.to(dtype).contiguous()
    if hf.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    print(f"wrote {out}: {sum(t.numel() for t in state.values()) / 1e6:.1f}M random parameters ({args.dtype})")


if __name__ == "__main__":
    main()
