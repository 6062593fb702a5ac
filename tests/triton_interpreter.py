"""Our Triton kernels on CPU tensors, through Triton's interpreter (triton is in requirements/dev.txt; fla, which
would make transformers pick its kernels, is not); the GPU machine runs them compiled."""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

AVAILABLE = torch.cuda.is_available() or importlib.util.find_spec("triton") is not None


def interpret_on_the_cpu() -> None:
    """Without CUDA, where triton is installed: TRITON_INTERPRET=1. Every @triton.jit function reads it when it is
    defined, triton's own (tl.sum, ...) at triton's import, so tests/conftest.py calls this before anything imports
    triton (transformers and torch may)."""
    if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        os.environ["TRITON_INTERPRET"] = "1"


def tree_kernel_module():
    """ddtree.models.tree_kernel: compiled on a CUDA machine, else interpreted (interpret_on_the_cpu)."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET before triton loads"
        _interpreter_scalar_index()
    return importlib.import_module("ddtree.models.tree_kernel")


def attention_kernel_module():
    """ddtree.models.attention_kernel: compiled on a CUDA machine, else interpreted (as tree_kernel_module)."""
    tree_kernel_module()
    return importlib.import_module("ddtree.models.attention_kernel")


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array), which numpy >= 2.3 refuses
    for its 1-element arrays (a loop bound read from memory fails); index such arrays by their one element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "ddtree_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.ddtree_patched = True
    interpreter._patch_lang_tensor = patched
