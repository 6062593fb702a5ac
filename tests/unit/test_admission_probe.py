"""perf/admission_probe.py on tiny models (CPU): requests kept running and replaced as they finish, every step timed
and split into the settle of queued steps, the prefill and the rest; the prefill's functions profiled."""

from __future__ import annotations

import json

from perf import admission_probe


def test_admission_probe_splits_the_steps_that_admit(tiny_models, tmp_path):
    result = admission_probe.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                   str(tiny_models / "qwen3-dflash"), "--methods", "ar,auto", "--slots", "3",
                                   "--requests", "7", "--max-tokens", "6", "--spread", "3", "--top", "4",
                                   "--out", str(tmp_path), "--name", "a"])
    for method in ("ar", "auto"):
        r = result["methods"][method]
        admitting, decoding = r["admitting"], r["decoding"]
        # every request admitted once: the first 3 together, the others as the running ones finish (max_tokens apart)
        assert admitting["requests"] == 7 and 1 < admitting["steps"] < 7 and decoding["steps"] > 0
        assert abs(admitting["ms"] - admitting["settle_ms"] - admitting["prefill_ms"] - admitting["rest_ms"]) < 1e-6
        assert len(r["prefill_ms_by_group"]) >= 2   # groups of different sizes
        assert r["prefill_functions_us"][0][0].endswith("_prefill") and len(r["prefill_functions_us"]) == 4
        assert r["tokens_per_s"] > 0
    assert sum(result["methods"]["auto"]["arms"].values()) > 0 and not result["methods"]["ar"]["arms"]
    assert json.loads((tmp_path / "a.json").read_text())["spread"] == 3
    assert "prefill ms by requests admitted together" in (tmp_path / "a.md").read_text()
