"""perf/batched_repeat.py: the batched scenario's requests against the target's own greedy tokens, per switch set."""

from __future__ import annotations

import argparse

import pytest

from perf import batched_repeat


def test_switch_sets_parse_or_are_refused():
    assert batched_repeat.parse_set("none") == {}
    assert batched_repeat.parse_set(" DDTREE_ROWS_GLU=1,DDTREE_TREE_GATES=0 ") == {"DDTREE_ROWS_GLU": "1",
                                                                                   "DDTREE_TREE_GATES": "0"}
    assert batched_repeat.parse_set("TRITON_F32_DEFAULT=ieee") == {"TRITON_F32_DEFAULT": "ieee"}
    for bad in ("GLU=1", "DDTREE_ROWS_GLU", "DDTREE_A=1,", "PATH=/x"):
        with pytest.raises(SystemExit, match="switch set"):
            batched_repeat.parse_set(bad)


def test_batched_requests_equal_the_targets_own_tokens_and_a_difference_is_counted(monkeypatch):
    """On the CPU (dynamic forwards) every batched request of the tiny hybrid decodes the target's own greedy tokens;
    with the reference's first answer changed in its first token, that request, and only it, is counted as
    differing there, with the target's top-two logits at that token."""
    from ddtree.engine import Engine

    args = argparse.Namespace(device="cpu", family="hybrid", seeds=1, rebuild=1, nan_fill=False)
    runs = batched_repeat.worker(args)["runs"]
    assert len(runs) == 2 * len(batched_repeat.MODES) and all(r["equal"] for r in runs), runs
    assert {r["mode"] for r in runs} == {"ar-1", "dflash-1", "ddtree-4", "ddtree-16", "ddtree-64"}

    original, seen = Engine.generate_ids, []

    def first_changed(self, prompt, params):
        out = original(self, prompt, params)
        if not seen:
            out.output_ids[0] = (out.output_ids[0] + 1) % 90
        seen.append(1)
        return out

    monkeypatch.setattr(Engine, "generate_ids", first_changed)
    runs = batched_repeat.worker(args)["runs"]
    differ = [r for r in runs if not r["equal"]]
    assert [(r["request"], r["first_difference"]) for r in differ] == [("s0-r0", 0)]
    # the target's own logits there name the batched token first (the reference was the one changed), a gap above 0
    assert differ[0]["top"] == differ[0]["batched"] and differ[0]["gap"] > 0, differ[0]
