"""The serving-overhead probes against a real tritonserver (CPU, tiny models): perf/stub_probe.py runs its workload in
process and inside a decoupled stub three ways, and perf/serve_overhead.py --repeats measures the engine alone and
through Triton in turns with both alive."""

from __future__ import annotations

import json

from perf import humaneval, serve_overhead, stub_probe


def test_stub_probe_runs_in_process_and_in_the_stub(tmp_path):
    result = stub_probe.main(["--repeats", "1", "--sends-per-s", "200", "--out", str(tmp_path), "--name", "p"])
    runs = json.loads((tmp_path / "p.json").read_text())["runs"]
    assert set(runs) == {"in process", "in process, own thread", "stub, main thread", "stub, own thread",
                         "stub, own thread + 200 sends/s"}
    for label, run in runs.items():
        assert run["timings"]["python_loop_ms"] > 0 and run["timings"]["torch_cpu_ops_us"] > 0
        assert any("(this thread)" in row for row in run["busy_threads"]), label
    # the stub's process is another one, in the environment tritonserver gives it
    assert runs["stub, main thread"]["facts"]["pid"] != runs["in process"]["facts"]["pid"]
    assert "PYTHONPATH" in result["differences"]["default"]["environment"]
    assert "| stub, own thread + 200 sends/s |" in (tmp_path / "p.md").read_text()


def test_serve_overhead_pairs_alone_and_triton(tiny_models, tmp_path):
    result = serve_overhead.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                  str(tiny_models / "qwen3-dflash"), "--dtype", "float32", "--methods", "ar,ddtree-4",
                                  "--repeats", "2", "--stream-intervals", "1,3", "--num-prompts", "1", "--max-tokens", "4",
                                  "--out", str(tmp_path), "--name", "o"])
    data = result["interleaved"]
    assert [(t["repeat"], t["method"], t["stream_interval"]) for t in data["turns"]] == [
        (r, m, k) for r in (0, 1) for m in ("ar", "ddtree-4") for k in (1, 3)]
    for turn in data["turns"]:
        # the same requests on both sides: the same number of tokens, counted by the engine and by the client
        assert turn["alone"]["num_tokens"] == turn["triton"]["num_tokens"] == 4
        assert turn["alone"]["num_input_tokens"] == turn["triton"]["num_input_tokens"]   # the same prompt ids
        assert turn["ratio"] == turn["triton"]["tokens_per_s"] / turn["alone"]["tokens_per_s"]
        assert turn["triton"]["stages"]["batch_rounds"] >= 1 and turn["host_loop_ms"] > 0
        assert any(row.split()[1].rstrip(":") == "ddtree-engine" for row in turn["triton"]["engine_stub_threads"])
    assert set(data["summary"]) == {f"{m}, stream_interval {k}" for m in ("ar", "ddtree-4") for k in (1, 3)}
    assert "| method | median triton / alone |" in (tmp_path / "o.md").read_text()


def test_humaneval_asks_the_ensemble_and_the_generation_model_alone(tiny_models, tmp_path):
    """--triton-models: every method through both models on one server; each streams the in-process engine's text."""
    result = humaneval.main(["--target", str(tiny_models / "qwen3-target"), "--drafter", str(tiny_models / "qwen3-dflash"),
                             "--num-prompts", "2", "--speed-prompts", "2", "--budgets", "4,16", "--speed-budgets", "4",
                             "--temperatures", "0", "--max-new-tokens", "6", "--skip-acceptance", "--triton-models", "ensemble,ddtree",
                             "--out", str(tmp_path), "--name", "he"])
    assert result["triton_models"] == ["ensemble", "ddtree"]
    for side in ("triton", "triton:ddtree"):
        rows = result[side]["0"]
        assert set(rows) == {"ar", "dflash", "ddtree-4"}
        assert all(r["text_matches_in_process"] == 2 and r["prompt_ids_match"] and r["num_tokens"] > 0
                   and r["num_tokens"] == result["in_process"]["0"][name]["num_tokens"] for name, r in rows.items()), side
    assert set(result["triton_variants"]) == {"base", "base (ddtree)"}
    md = (tmp_path / "he.md").read_text()
    assert "triton/in-process, ensemble | tok/s Triton, ddtree |" in md
    assert "| ddtree-4 | 0 | ddtree |" in md   # the request table's row through the generation model alone
    # the turn's own in-process pass (the engine kept beside the server): each turn's ratios over it, not the first pass
    (paired,) = result["in_process_turns"]
    assert set(paired["0"]) == {"ar", "dflash", "ddtree-4"}
    ratios = humaneval.turn_ratios(result, result["triton_variants"]["base"], "0", "dflash")
    assert ratios == [result["triton"]["0"]["dflash"]["tokens_per_s"] / paired["0"]["dflash"]["tokens_per_s"]]
    assert "each turn over that turn's in-process pass" in md and "in process: tok/s by turn" in md
