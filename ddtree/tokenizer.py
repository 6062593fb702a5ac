"""Tokenizer for serving: the checkpoint's tokenizer.json (HF `tokenizers`) and its jinja chat template.

The serving path does not import transformers (the 2.51 Triton stub runs numpy 1.26, under which
transformers 5 fails to import on numpy-2 machines); tests check this class against
transformers' AutoTokenizer token for token.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (run `make setup` first)")
        self.backend = FastTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        self.chat_template: str | None = (template_file.read_text() if template_file.is_file()
                                          else self.config.get("chat_template"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **kw: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Render the checkpoint's chat template and tokenize it (the template holds any special tokens)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        return self.encode(text, add_special_tokens=False)
