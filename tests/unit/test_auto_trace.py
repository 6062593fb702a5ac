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
    assert whole["rounds"] == sum(p["rounds"] for p in result["passes"]) == len(result["rounds"])
    assert sum(row[1] for row in result["rounds"]) == sum(p["tokens"] - p["requests"] for p in result["passes"])
    assert "| 1 |" in (tmp_path / "t.md").read_text() and "- pass 2: " in (tmp_path / "t.md").read_text()


def test_a_served_engines_trace_is_summarised_run_by_run(tiny_models, tmp_path, monkeypatch):
    """DDTREE_AUTO_TRACE=<dir>: an engine built with it writes every round of `auto` as a JSON line (as the Triton
    model's would, inheriting the server's environment); --summarise splits the file into runs at idle gaps."""
    import time

    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.sampling_params import SamplingParams

    monkeypatch.setenv("DDTREE_AUTO_TRACE", str(tmp_path / "trace"))
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_num_seqs=2))
    params = SamplingParams(max_tokens=5, ignore_eos=True, mode="auto", tree_budget=8)
    counted = []
    for burst in range(2):
        tokens = 0
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            tokens += engine.generate_ids(prompt, params).num_output_tokens - 1   # the first token: the prefill's
        counted.append(tokens)
        if not burst:
            time.sleep(3.0)   # idle: the next burst is a new run (a loaded CI machine's prefill may take a second)
    (path,) = (tmp_path / "trace").iterdir()
    result = auto_trace.main(["--summarise", str(path), "--gap", "2.0", "--out", str(tmp_path), "--name", "s"])
    assert [sum(a["tokens"] for a in run["arms"].values()) for run in result["runs"]] == counted == [8, 8]
    assert all(run["batch_sizes"] == [1] for run in result["runs"])
    assert "| 2 | " in (tmp_path / "s.md").read_text()
    # --replay: the same selector, fed the trace's rounds, chooses every arm the engine chose (so its estimates, printed
    # round by round, are those the engine chose on); a gzipped copy reads the same
    import gzip

    replayed = auto_trace.main(["--replay", str(path), "--rounds", "0:3", "--max-budget", "8"])["rounds"]
    assert len(replayed) == sum(run["rounds"] for run in result["runs"]) and all(r["matched"] for r in replayed)
    assert all(r["rates"] for r in replayed) and sum(r["tokens"] for r in replayed) == 16
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert auto_trace.main(["--replay", str(packed), "--max-budget", "8"])["rounds"] == replayed
