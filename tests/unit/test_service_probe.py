"""perf/service_probe.py on tiny checkpoints: every side serves the same requests to their end, the serving sides
report their loop's time and (--parts) its parts, and the table names every side."""

from __future__ import annotations

import json

from perf import service_probe


def test_every_side_serves_and_the_parts_are_timed(tiny_models, tmp_path):
    result = service_probe.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                 str(tiny_models / "qwen3-dflash"), "--prompts", "2", "--max-tokens", "6",
                                 "--turns", "1", "--methods", "ar,dflash", "--sides", "alone,thread,service,pipe,child",
                                 "--parts", "--out", str(tmp_path), "--name", "probe"])
    for method in ("ar", "dflash"):
        sides = result["summary"][method]
        assert set(sides) == {"alone", "thread", "service", "pipe", "child"}
        for side, s in sides.items():
            assert s["tokens_per_s"] > 0 and s["verify_ms"] > 0   # the child's: from the stats it published
            assert (s["serve_ms"] > 0) == (side in ("service", "pipe", "child"))   # only the serving loop has serve time
        for side in ("service", "pipe"):
            assert sides[side]["parts_us"]["Stream.add"] > 0 and sides[side]["parts_us"]["_report"] > 0
            # the waits for the next request apart from the loop's work (no gate on the CPU: the text on the engine)
            assert sides[side]["parts_us"]["_take_jobs (idle)"] > 0 and "Stream.add (outbox)" not in sides[side]["parts_us"]
        turn = result["turns"][0][method]
        assert len({run["tokens"] for run in turn.values()}) == 1   # the same tokens on every side, the child's engine too
        assert turn["child"]["rounds"] == turn["alone"]["rounds"]
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["sides"] == ["alone", "thread", "service", "pipe", "child"]
    md = (tmp_path / "probe.md").read_text()
    assert "| dflash | pipe |" in md and "Stream.add" in md
    from ddtree import serving
    assert not hasattr(serving._Stream.add, "__wrapped_by_probe__")   # the timers are gone after
