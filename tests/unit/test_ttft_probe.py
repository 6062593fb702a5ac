"""perf/ttft_probe.py on tiny models (CPU): every stream's requests end, each request's time to first response is the
sum of its parts (the engine's queue, admission, the prefill step, the first response), and the steps that prefill
arrivals are told apart from those that only decode; with a think time the streams' requests still all end."""

from __future__ import annotations

import json

import pytest

from perf import ttft_probe


@pytest.mark.parametrize("think_ms", ["0", "3"])
def test_ttft_probe(think_ms, tiny_models, tmp_path):
    result = ttft_probe.main(["--think-ms", think_ms,
                              "--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                              "--concurrency", "1,3", "--requests-per-stream", "2", "--max-tokens", "5",
                              "--methods", "ar,ddtree", "--engine", "stream_response_rate=1000",
                              "--out", str(tmp_path), "--name", "t"])
    runs = json.loads((tmp_path / "t.json").read_text())["runs"]
    assert list(runs) == ["ar@1", "ar@3", "ddtree@1", "ddtree@3"] == list(result["runs"])
    assert result["settings"] == {"stream_response_rate": 1000}
    for key, run in runs.items():
        streams = int(key.split("@")[1])
        assert run["num_requests"] == 2 * streams and run["tokens_per_s"] > 0
        ms = run["ms"]
        assert ms["ttft"]["mean"] == pytest.approx(sum(ms[part]["mean"] for part in ttft_probe.PARTS), rel=1e-6)
        assert all(ms[part]["mean"] >= 0 for part in ttft_probe.PARTS) and ms["prefill"]["mean"] > 0
        steps = run["steps"]
        assert steps["prefilling"] >= 2 and steps["decoding"] >= 1   # a prefill per turn of the streams at least
        assert 1 <= steps["requests_per_prefill"] <= streams
    assert "| ddtree | 3 |" in (tmp_path / "t.md").read_text()


def test_an_engine_setting_is_parsed_as_the_config_takes_it():
    assert [ttft_probe.setting(v) for v in ("3", "0.5", "true", "False", "auto")] == [3, 0.5, True, False, "auto"]
