"""Training prompts that exist offline: instructions derived from the Python standard library's docstrings.

The sources are parsed, never imported (importing some stdlib modules has side effects), and
the prompts are deterministic for a given Python version. HumanEval (the evaluation set) is not
drawn from the standard library, so the two do not overlap.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
             "dist-packages", "__pycache__", "pydoc_data", "venv"}

TEMPLATES = (
    "Write a Python function `{name}({args})` that {summary}",
    "Implement `{name}({args})` in Python. It should do the following: {summary}",
    "Here is a docstring from Python's `{module}` module:\n\n{doc}\n\nWrite a clean Python implementation of "
    "`{name}` with this behaviour, with a short explanation.",
    "Explain what `{module}.{name}` does in Python and show a short usage example. Its documentation says: {summary}",
)


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def docstring_entries(stdlib: Path | None = None) -> list[dict]:
    """(module, name, args, doc) for every public documented function and method, in a fixed order (a new list of
    new entries at every call: the parse, ~6 s on 2 CPU cores, is made once per process and directory)."""
    return [dict(entry) for entry in _parsed(stdlib or Path(sysconfig.get_paths()["stdlib"]))]


@functools.cache
def _parsed(stdlib: Path) -> tuple[dict, ...]:
    entries = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS for part in rel.parts) or rel.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(_summary(doc)) < 30:
                continue
            args = ast.unparse(node.args).replace("self, ", "").replace("self", "").replace("cls, ", "")
            entries.append({"module": module, "name": node.name, "args": args, "doc": doc.strip()[:1500]})
    return tuple(entries)


def make_prompts(num_prompts: int, seed: int, stdlib: Path | None = None) -> list[str]:
    """`num_prompts` distinct instructions (at most entries x templates), shuffled with `seed`.

    Each pass over the entries uses every entry once, each with a different template than in
    the passes before.
    """
    rng = random.Random(seed)
    entries = docstring_entries(stdlib)
    rng.shuffle(entries)
    prompts: dict[str, None] = {}   # insertion-ordered set: entries repeated across modules give one prompt
    for i in range(len(entries) * len(TEMPLATES)):
        if len(prompts) == num_prompts:
            break
        round_, j = divmod(i, len(entries))
        entry = entries[j]
        template = TEMPLATES[(j + round_) % len(TEMPLATES)]
        prompts[template.format(summary=_lower_first(_summary(entry["doc"])), **entry)] = None
    return list(prompts)
