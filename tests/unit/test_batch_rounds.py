"""perf/batch_rounds.py on tiny models (CPU): every request of the batch decodes its tokens, the stage times per
batch round come from the engine's counters, auto's arms are counted, and a profile is written per method."""

from __future__ import annotations

import json

from perf import batch_rounds


def test_batch_rounds(tiny_models, tmp_path):
    result = batch_rounds.main(["--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                                "--concurrency", "3", "--max-tokens", "6", "--methods", "ar,auto,ddtree-4",
                                "--profile", str(tmp_path / "prof"), "--profile-skip", "1", "--profile-steps", "1",
                                "--out", str(tmp_path), "--name", "b"])
    methods = json.loads((tmp_path / "b.json").read_text())["methods"]
    assert list(methods) == ["ar", "auto", "ddtree-4"] == list(result["methods"])
    for name, r in methods.items():
        assert r["num_tokens"] == 3 * 6 and r["batch_rounds"] >= 1
        assert r["ms_per_round"]["verify"] > 0
        if name != "auto":   # auto drafts or not, by the arms it picks
            assert (r["ms_per_round"]["draft"] > 0) == (name == "ddtree-4")
        assert r["mean_acceptance"] >= 1.0
        assert (tmp_path / "prof" / f"b_{name}.txt").read_text().startswith(f"b_{name}:")
    assert sum(methods["auto"]["arms"].values()) == methods["auto"]["batch_rounds"] and methods["ar"]["arms"] == {}
    assert "| auto |" in (tmp_path / "b.md").read_text()
