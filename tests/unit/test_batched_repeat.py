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
    saved = []
    batched_repeat.worker(args, lambda runs: saved.append(list(runs)))   # saved after each seed
    assert len(saved) == 1
    runs = saved[0]
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
    batched_repeat.worker(args, saved.append)
    runs = saved[-1]
    differ = [r for r in runs if not r["equal"]]
    assert [(r["request"], r["first_difference"]) for r in differ] == [("s0-r0", 0)]
    # the target's own logits there name the batched token first (the reference was the one changed), a gap above 0
    assert differ[0]["top"] == differ[0]["batched"] and differ[0]["gap"] > 0, differ[0]


def test_a_set_stopped_at_its_time_limit_is_written_as_a_timeout(tmp_path):
    """--set-seconds: a switch set's process still running at the limit is killed and its set written with exit
    "timeout" and the seeds it finished (none within a second: the tiny models are not even built by then), then the
    next set runs; the script exits 1."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "perf/batched_repeat.py", "--seeds", "1", "--set-seconds", "1", "--sets",
                           "none;DDTREE_ROWS_GLU=0", "--out", str(tmp_path), "--name", "cut"],
                          cwd=batched_repeat.ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    sets = json.loads((tmp_path / "cut.json").read_text())["sets"]
    assert [(s["set"], s["returncode"], s["requests"]) for s in sets] == [({}, "timeout", 0),
                                                                          ({"DDTREE_ROWS_GLU": "0"}, "timeout", 0)]
    assert "| none | timeout | 0 |" in (tmp_path / "cut.md").read_text()
