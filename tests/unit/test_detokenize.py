"""Streamed deltas, each decoded statelessly from its window, concatenate to the one-shot decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ddtree.detokenize import IncrementalDetokenizer, decode, decode_range
from ddtree.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world! How are you today?  Two  spaces and\nnew lines.\n",
    "日本語のテキストも扱えます。中文也可以。",
    "Emoji: 🚀🔥✨ family 👨‍👩‍👧 flags 🇫🇷 café naïve résumé",
    "def add(a, b):\n    return a + b  # 🚀\n",
]


def tokenizers(tiny_models):
    found = [Tokenizer(tiny_models / "qwen3-target")]
    default = ROOT / "models" / "smollm2-135m-instruct"
    if (default / "tokenizer.json").exists():
        found.append(Tokenizer(default))
    return found


def stream(tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 5)          # a round accepts several tokens at once
        new = ids[i : i + step]
        i += step
        chunk = detok.push(new, is_final=i >= len(ids))
        # what the stateless postprocessing step computes from the response alone
        assert decode_range(tokenizer, chunk.window, chunk.prefix_length, chunk.text_start, chunk.text_end) == chunk.text
        pieces.append(chunk.text)
    return pieces


@pytest.mark.parametrize("seed", range(4))
def test_stream_concatenates_to_one_shot_decode(tiny_models, seed):
    rng = random.Random(seed)
    for tokenizer in tokenizers(tiny_models):
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            pieces = stream(tokenizer, ids, rng)
            assert "".join(pieces) == decode(tokenizer, ids) == text, (type(tokenizer).__name__, text)
            assert all("\ufffd" not in p for p in pieces), pieces


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_including_broken_utf8(tiny_models, seed):
    rng = random.Random(100 + seed)
    for tokenizer in tokenizers(tiny_models):
        ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
        assert "".join(stream(tokenizer, ids, rng)) == decode(tokenizer, ids)


def test_split_multibyte_character_is_held_back(tiny_models):
    tokenizer = Tokenizer(tiny_models / "qwen3-target")
    # the single byte tokens of the 4-byte emoji: one round ends in the middle of the character
    byte_ids = [tokenizer.backend.token_to_id(t) for t in ("ð", "Ł", "ļ", "Ģ")]
    assert decode(tokenizer, byte_ids) == "🚀"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(byte_ids[:2], is_final=False).text == ""
    assert detok.push(byte_ids[2:], is_final=True).text == "🚀"
