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


class _Recorder:
    """The real engine, the number of requests it holds (running and waiting) noted after every step."""

    def __init__(self, engine) -> None:
        self.engine, self.held = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        outputs = self.engine.step()
        self.held.append(len(self.engine.running) + len(self.engine.waiting))
        return outputs


def test_run_batch_keeps_streams_running_until_total(tiny_models):
    """total: 2 streams kept running until 5 requests ran, each replaced as soon as it finished (the engine never
    holds more than the streams); without it, the prompts alone."""
    from ddtree.config import EngineConfig
    from ddtree.engine import Engine

    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                                 max_num_seqs=2))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    recorder = _Recorder(engine)
    params = batch_rounds.params_for("ar", 6)
    result = batch_rounds.run_batch(recorder, prompts, params, total=5)
    assert result["num_requests"] == 5 and result["num_tokens"] == 5 * 6
    assert max(recorder.held) == 2 and recorder.held[-1] == 0
    assert recorder.held.count(2) > len(recorder.held) // 2   # mostly both streams busy: replacements arrive at once
    alone = batch_rounds.run_batch(engine, prompts, params)
    assert alone["num_requests"] == 2 and alone["num_tokens"] == 2 * 6


def test_run_batch_spread_cuts_each_requests_max_tokens_the_same_every_run(tiny_models):
    """spread: request i asks max_tokens less random.Random(i).randint(0, spread), so requests finish (and the next
    arrive) on different rounds; the cuts repeat run to run, so methods compared in turns decode the same tokens."""
    import random

    from ddtree.config import EngineConfig
    from ddtree.engine import Engine

    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                                 max_num_seqs=2))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = batch_rounds.params_for("ar", 8)
    expected = sum(8 - random.Random(i).randint(0, 5) for i in range(6))
    assert expected < 6 * 8   # the seeds cut something
    runs = [batch_rounds.run_batch(engine, prompts, params, total=6, spread=5) for _ in range(2)]
    assert [r["num_tokens"] for r in runs] == [expected, expected] and runs[0]["num_requests"] == 6
    assert params.max_tokens == 8   # the caller's params are left as they were
