"""ddtree.serving.freeze_heap (what the Triton model calls after warm-up) and perf/gc_probe.py on a tiny engine: the
objects alive at the freeze leave the collector's generations, so a full collection no longer walks them."""

from __future__ import annotations

import gc
import json

from ddtree.serving import freeze_heap
from perf import gc_probe


def test_freeze_heap_takes_live_objects_out_of_the_collections():
    alive = [[i] for i in range(1000)]   # lists: always tracked (a dict of ints is not)
    assert all(gc.is_tracked(o) for o in alive)
    try:
        frozen = freeze_heap()
        assert frozen >= len(alive) and gc.get_freeze_count() == frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in alive), "a frozen object is still walked by collections"
        later = [[i] for i in range(10)]
        assert all(gc.is_tracked(o) for o in later) and id(later[0]) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_probe(tiny_models, tmp_path):
    result = gc_probe.main(["--target", str(tiny_models / "llama-target"), "--drafter", str(tiny_models / "llama-dflash"),
                            "--requests", "4", "--max-tokens", "6", "--repeats", "1", "--out", str(tmp_path),
                            "--name", "g"])
    before, after = result["before"], result["after"]
    assert result["frozen"] > 10_000 and after["objects"] < before["objects"] - result["frozen"] // 2
    assert after["full_ms"] < before["full_ms"]
    assert gc.get_freeze_count() == 0   # the probe unfroze: the test process collects as before
    assert after["batch"]["batch_rounds"] > 0 and len(before["batch"]["collections"]) == 3
    assert json.loads((tmp_path / "g.json").read_text())["frozen"] == result["frozen"]
    assert "| after freeze_heap |" in (tmp_path / "g.md").read_text()
