"""Shared fixtures: tiny checkpoints made once per session by scripts/make_tiny_models.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.triton_interpreter import interpret_on_the_cpu  # noqa: E402

interpret_on_the_cpu()   # before anything imports triton: its own jit functions are defined at its import


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(out)],
                   check=True, capture_output=True)
    return out
