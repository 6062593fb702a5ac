"""Make tiny random-weight checkpoints (dense Qwen3 and Llama targets + DFlash drafters) for fast tests.

Each target is an HF safetensors checkpoint with a real byte-level BPE tokenizer (trained here on
a small built-in corpus) and a ChatML chat template; each drafter is written in the published
z-lab DFlash layout. Deterministic: the same seed gives the same files.

    python scripts/make_tiny_models.py --out models/tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "A tree of drafts shares its prefixes; siblings share positions.",
    "Triton Inference Server streams responses over gRPC and HTTP.",
    "日本語のテキストも扱えます。中文也可以。 Emoji: 🚀🔥✨ café naïve résumé",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, world! How are you today? I am fine, thank you.",
]


def make_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def make_target(out: Path, family: str, vocab_size: int, seed: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    special = make_tokenizer(out, vocab_size)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
                  bos_token_id=None, tie_word_embeddings=family == "llama")
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, rope_theta=1_000_000.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10_000.0))
    # Sharper than the default init so greedy continuations are not flat noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if family != "llama" else model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(str(out), safe_serialization=True)
    return {**json.loads((out / "config.json").read_text()), "mask_token_id": special["<|mask|>"]}


def make_drafter(out: Path, target_config: dict, block_size: int, seed: int) -> None:
    hf = dflash_hf_config(target_config, num_layers=2, block_size=block_size,
                          mask_token_id=target_config["mask_token_id"])
    save_drafter(out, hf, init_random_drafter(hf, seed=seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/tiny")
    parser.add_argument("--vocab-size", type=int, default=320)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(args.out)
    for family in ("qwen3", "llama"):
        config = make_target(root / f"{family}-target", family, args.vocab_size, args.seed)
        make_drafter(root / f"{family}-dflash", config, args.block_size, args.seed + 1)
        print(f"wrote {root / family}-target and {root / family}-dflash")


if __name__ == "__main__":
    main()
