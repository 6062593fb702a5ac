"""The serving tokenizer (tokenizers + jinja) equals transformers' AutoTokenizer token for token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ddtree.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "日本語のテキスト。中文。", "🚀🔥 café <|im_end|> x"]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about 🌸"},
     {"role": "assistant", "content": "Spring."}, {"role": "user", "content": "More?"}],
]


def tokenizer_dirs(tiny_models) -> list[Path]:
    dirs = [tiny_models / "qwen3-target", tiny_models / "llama-target"]
    default = ROOT / "models" / "smollm2-135m-instruct"
    return dirs + ([default] if (default / "tokenizer.json").exists() else [])


def test_matches_transformers(tiny_models):
    rng = random.Random(0)
    for path in tokenizer_dirs(tiny_models):
        ours, reference = Tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert len(ours) == len(reference), path
        for text in TEXTS:
            assert ours.encode(text) == reference(text)["input_ids"], (path, text)
            assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]
        for _ in range(20):
            ids = [rng.randrange(len(ours)) for _ in range(30)]
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), (path, ids)
        for chat in CHATS:
            for kwargs in ({}, {"enable_thinking": False}):
                expected = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False, **kwargs)
                assert ours.apply_chat_template(chat, add_generation_prompt=True, **kwargs) == expected, (path, kwargs)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
