"""perf/round_profile.py on tiny models (CPU): both methods measured in turns, with requests added at once and with
streams kept running (--requests-per-stream), and their profiles compared."""

from __future__ import annotations

import json

from perf import round_profile


def test_round_profile_with_arrivals(tiny_models, tmp_path):
    result = round_profile.main(["--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                                 "--concurrency", "2", "--max-tokens", "5", "--turns", "2", "--top", "3",
                                 "--requests-per-stream", "3", "--spread", "2", "--out", str(tmp_path), "--name", "r"])
    assert result["freeze_heap"] is True   # as the served model's heap (perf.common.frozen_heap)
    point = result["points"]["2"]
    assert len(point["ratios"]) == 2 and point["ratio_worst"] <= point["ratio_median"]
    assert all(point["methods"][m]["tokens_per_s"] > 0 for m in ("ar", "auto")) and len(point["profile_diff_us"]) == 3
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["requests_per_stream"] == 3 and saved["spread"] == 2
    assert "3 a stream" in (tmp_path / "r.md").read_text() and "each asking 5 tokens less 0..2" in (tmp_path / "r.md").read_text()
