"""perf/warmup_probe.py on the tiny hybrid (CPU, static forwards run eagerly): every part of Engine.warm_up is timed
once per call, the programs they make add up to the engine's, and the result is written."""

from __future__ import annotations

import json

from perf import warmup_probe


def test_warmup_probe(tmp_path):
    result = warmup_probe.main(["--device", "cpu", "--dtype", "float32", "--shape", "tiny-hybrid", "--max-model-len", "256",
                                "--max-num-seqs", "4", "--engine", "static_forward=on", "--out", str(tmp_path),
                                "--name", "w"])
    parts = result["parts"]
    assert list(parts) == list(warmup_probe.PARTS)
    assert parts["generate_ids"]["calls"] == 4 and all(parts[p]["calls"] == 1 for p in warmup_probe.PARTS[1:])
    assert sum(p["programs"] for p in parts.values()) == result["programs"] > 0
    assert parts["_warm_batched_verifies"]["programs"] > 0 and result["warm_s"] > 0
    assert json.loads((tmp_path / "w.json").read_text())["programs"] == result["programs"]
    assert "| _warm_batched_verifies | 1 |" in (tmp_path / "w.md").read_text()
