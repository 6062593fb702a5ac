"""Draft trees: best-first build under a node budget, and compilation into one verify batch."""

from ddtree.tree.build import DraftTree, build_chain, build_tree, top_ids, top_log_probs
from ddtree.tree.compile import VerifyBatch, compile_tree

__all__ = ["DraftTree", "VerifyBatch", "build_chain", "build_tree", "compile_tree", "top_ids", "top_log_probs"]
