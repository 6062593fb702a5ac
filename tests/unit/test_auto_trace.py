"""perf/auto_trace.py on tiny models (CPU): every round `auto` ran is in the trace, with the tokens it committed."""

from __future__ import annotations

import json

from perf import auto_trace


def test_auto_trace_records_every_round_of_auto(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Say hello.", "Count to three.", "Name a colour."]))
    result = auto_trace.main(["--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                              "--prompts", str(prompts), "--max-tokens", "6", "--passes", "2", "--concurrency", "2",
                              "--out", str(tmp_path), "--name", "t"])
    assert result["ar_tokens_per_s"] > 0 and len(result["passes"]) == 2
    for p in result["passes"]:
        arms = p["arms"].values()
        # the rounds' tokens are every token but each request's first (its prefill's)
        assert sum(a["tokens"] for a in arms) == p["tokens"] - p["requests"] == 3 * 6 - 3
        assert sum(a["rounds"] for a in arms) == p["rounds"] == sum(n for _, n in p["sequence"])
        assert p["switches"] == len(p["sequence"]) - 1
        assert abs(sum(a["time_share"] for a in arms) - 1.0) < 1e-9
    whole = result["whole"]
    assert whole["rounds"] == sum(p["rounds"] for p in result["passes"])
    assert "| 1 |" in (tmp_path / "t.md").read_text() and "- pass 2: " in (tmp_path / "t.md").read_text()
