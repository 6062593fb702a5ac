"""perf/serve_overhead.py on tiny models (CPU): the engine alone and through GenerationService decode the same
tokens, each side's stage times are read from the engine's counters, and the table names both."""

from __future__ import annotations

import json

from perf import serve_overhead


def test_alone_and_service_sides(tiny_models, tmp_path):
    result = serve_overhead.main(["--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                                  "--dtype", "float32", "--methods", "ar,ddtree-4", "--sides", "alone,service",
                                  "--num-prompts", "2", "--max-tokens", "6", "--out", str(tmp_path), "--name", "o"])
    run = json.loads((tmp_path / "o.json").read_text())["runs"]["this interpreter"]
    assert run == json.loads(json.dumps(result["runs"]["this interpreter"]))
    for side in ("alone", "service"):
        assert set(run[side]) == {"ar", "ddtree-4"}
        for name, r in run[side].items():
            assert r["num_tokens"] == 2 * 6 and r["tokens_per_s"] > 0
            assert r["stages"]["batch_rounds"] >= 1 and r["stages"]["verify_ms"] > 0
            assert (r["stages"]["draft_ms"] > 0) == (name != "ar")
    assert run["late_programs"] == []            # dynamic forwards on the CPU: no static program at all
    md = (tmp_path / "o.md").read_text()
    assert "| this interpreter | service | ddtree-4 |" in md and "| this interpreter | alone | ar |" in md


def test_host_speed_pins_each_cpu(tmp_path):
    import os

    from perf import host_speed

    result = host_speed.main(["--rounds", "2", "--repeats", "1", "--out", str(tmp_path), "--name", "h"])
    assert len(result["rounds"]) == 2
    assert all(set(row) == {str(c) for c in os.sched_getaffinity(0)} for row in result["rounds"])
    assert result["summary"]["python_loop_ms"]["max_over_min"] >= 1.0
    assert os.sched_getaffinity(0) == set(map(int, result["rounds"][0]))   # the caller's affinity is restored
