"""perf/humaneval.py on tiny checkpoints: the acceptance phase (tau, histograms, greedy outputs equal
across methods and to batch-1 decoding) and the report it writes."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoModelForCausalLM

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from ddtree.tokenizer import Tokenizer
from perf import humaneval
from tests.unit.oracle import OracleDraftEngine

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def paths(tiny_models):
    return str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash")


@pytest.fixture(scope="module")
def prompt_ids(paths):
    ids = humaneval.encode_prompts(Tokenizer(paths[0]), humaneval.load_problems()[:2])
    assert ids[0] != ids[1]
    return ids


def config(paths, prompt_ids, **kw) -> EngineConfig:
    return EngineConfig(target_path=paths[0], drafter_path=paths[1], max_tree_budget=16,
                        max_model_len=max(map(len, prompt_ids)) + MAX_NEW_TOKENS + 1, **kw)


def test_prompts_are_the_humaneval_problems_in_the_chat_template(paths):
    problems = humaneval.load_problems()
    assert len(problems) == 164 and problems[0].lstrip().startswith("from typing import List")
    text = Tokenizer(paths[0]).decode(humaneval.encode_prompts(Tokenizer(paths[0]), problems[:1])[0],
                                      skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nWrite a solution to the following problem and make sure that it passes "
                           "the tests:\n```python\n" + problems[0] + "\n```<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # enable_thinking=False reached the template


def test_acceptance_phase(paths, prompt_ids):
    """Batched acceptance run with a drafter that is partly right: tau, histograms, identical greedy outputs."""
    reference = AutoModelForCausalLM.from_pretrained(paths[0]).eval()
    engine = OracleDraftEngine(config(paths, prompt_ids, max_num_seqs=8), reference=reference, seed=0)
    methods = humaneval.methods_for([4, 16])
    results, outputs = humaneval.acceptance_phase(engine, prompt_ids, methods, [0.0, 1.0], MAX_NEW_TOKENS, 0)
    names = ["ar", "dflash", "ddtree-4", "ddtree-16"]
    assert set(results) == set(outputs) == {"0", "1"}
    for key in results:
        assert list(results[key]) == names
        for name, r in results[key].items():
            assert r["num_responses"] == 2 and len(outputs[key][name]) == 2
            assert sum(r["acceptance_histogram"].values()) == r["num_rounds"] > 0
            assert 0 < r["num_output_tokens"] <= 2 * MAX_NEW_TOKENS
        assert results[key]["ar"]["tau"] == 1.0
        assert results[key]["ar"]["acceptance_histogram"]["1"] == results[key]["ar"]["num_rounds"]
        assert list(results[key]["ar"]["acceptance_histogram"]) == [str(n) for n in range(1, 9)]   # tiny block_size 8
    greedy = results["0"]
    assert greedy["ddtree-16"]["tau"] > 1.3 and greedy["dflash"]["tau"] > 1.3, greedy
    assert humaneval.greedy_mismatches(outputs["0"]) == []
    # ... and they equal batch-1 decoding by a plain engine
    alone = Engine(config(paths, prompt_ids))
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(**humaneval.sampling_parameters(humaneval.Method("ar", 1), 0.0, MAX_NEW_TOKENS, i))
        assert outputs["0"]["ar"][i] == alone.generate_ids(ids, params).output_ids


def test_greedy_mismatches_finds_a_differing_prompt():
    same = [[1, 2, 3], [4, 5]]
    assert humaneval.greedy_mismatches({"ar": same, "dflash": same}) == []
    assert humaneval.greedy_mismatches({"ar": same, "dflash": [[1, 2, 3], [4, 6]], "ddtree-4": same}) == [1]


def test_report(paths, tmp_path):
    """The whole script without Triton: JSON, markdown table, plots."""
    result = humaneval.main(["--target", paths[0], "--drafter", paths[1], "--num-prompts", "2", "--speed-prompts", "1",
                             "--budgets", "4,16", "--temperatures", "0", "--max-new-tokens", "4", "--skip-triton",
                             "--out", str(tmp_path), "--name", "he"])
    saved = json.loads((tmp_path / "he.json").read_text())
    assert saved["greedy_outputs_identical"] is True and saved["num_prompts"] == 2
    assert set(saved["acceptance"]["0"]) == set(saved["in_process"]["0"]) == {"ar", "dflash", "ddtree-4", "ddtree-16"}
    assert saved["acceptance"]["0"]["ar"]["tau"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["num_tokens"] > 0 for r in saved["in_process"]["0"].values())
    # one time to first token per speed prompt, within the request's time
    assert all(len(r["ttft_s"]) == 1 and 0 < r["ttft_s"][0] <= r["seconds"] for r in saved["in_process"]["0"].values())
    assert "triton" not in saved and set(saved["phase_seconds"]) == {"load", "acceptance", "in_process_speed"}
    md = (tmp_path / "he.md").read_text()
    assert ("| method | T | τ | tok/s in process | speedup | tok/s Triton, ensemble | speedup Triton, ensemble | "
            "triton/in-process, ensemble |") in md
    assert "| ar | 0 | 1.00 |" in md and "| ddtree-16 | 0 |" in md
    ttft_rows = md.split("Time to first token")[1].split("Rounds per acceptance length")[0]
    assert "| method | T | in process | Triton, ensemble |" in ttft_rows and "| ddtree-4 | 0 |" in ttft_rows
    assert ttft_rows.count(" | - |") == 4   # no Triton side in this run
    assert [p.rsplit("/", 1)[1] for p in result["plots"]] == ["he_tau.png", "he_speedup.png"]
    assert all((tmp_path / p).stat().st_size > 1000 for p in ("he_tau.png", "he_speedup.png"))


def test_speed_auto_measures_the_policy_beside_the_fixed_methods(paths, tmp_path):
    """--speed-auto: `auto` (capped at the largest speed budget) in the speed phase, as many tokens as `ar`'s."""
    humaneval.main(["--target", paths[0], "--drafter", paths[1], "--num-prompts", "2", "--speed-prompts", "2",
                    "--budgets", "4,16", "--temperatures", "0", "--max-new-tokens", "6", "--skip-triton", "--skip-acceptance",
                    "--speed-auto", "--out", str(tmp_path), "--name", "he"])
    saved = json.loads((tmp_path / "he.json").read_text())
    assert list(saved["in_process"]["0"]) == ["ar", "dflash", "ddtree-4", "ddtree-16", "auto"]
    assert saved["in_process"]["0"]["auto"]["num_tokens"] == saved["in_process"]["0"]["ar"]["num_tokens"] > 0
    assert "| auto | 0 |" in (tmp_path / "he.md").read_text()
    assert saved["speed_methods"][-1] == ["auto", 16]


def test_acceptance_and_speed_in_separate_runs_merge(paths, tmp_path):
    """A speed-only run (fewer budgets, one temperature) and an acceptance-only run combine into one table."""
    common = ["--target", paths[0], "--drafter", paths[1], "--num-prompts", "2", "--budgets", "4,16",
              "--max-new-tokens", "4", "--skip-triton", "--out", str(tmp_path)]
    humaneval.main(common + ["--temperatures", "0,1", "--skip-in-process-speed", "--name", "acc"])
    humaneval.main(common + ["--temperatures", "0", "--skip-acceptance", "--speed-prompts", "1", "--speed-budgets", "16",
                             "--name", "speed"])
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert speed["acceptance"] == {} and set(speed["in_process"]["0"]) == {"ar", "dflash", "ddtree-16"}
    merged = humaneval.main(["--merge", str(tmp_path / "acc.json"), str(tmp_path / "speed.json"),
                             "--out", str(tmp_path), "--name", "all"])
    assert set(merged["acceptance"]) == {"0", "1"} and merged["speed_prompts"] == 1 and merged["num_prompts"] == 2
    assert merged["greedy_outputs_identical"] is True and len(merged["runs"]) == 2
    md = (tmp_path / "all.md").read_text()
    assert "| ddtree-4 | 0 |" in md and "| ddtree-4 | 1 |" in md
    speed_row = next(line for line in md.splitlines() if line.startswith("| ddtree-16 | 0 |"))
    assert speed_row.split("|")[4].strip() != "-"      # tokens/s in process came from the speed run
    assert (tmp_path / "all_speedup.png").stat().st_size > 1000


def test_engine_args_set_the_config_as_the_model_parses_them():
    config = EngineConfig(target_path="t", drafter_path="d")
    same, none = humaneval.with_engine_args(config, [])
    assert same is config and none == {}
    changed, items = humaneval.with_engine_args(config, ["static_prefill=256", "ar_lookahead=auto"])
    assert changed.static_prefill == 256 and changed.ar_lookahead is None and changed.target_path == "t"
    assert items == {"static_prefill": "256", "ar_lookahead": "auto"}
    with pytest.raises(ValueError, match="unknown engine parameter"):
        humaneval.with_engine_args(config, ["no_such=1"])


def test_triton_variants_parse_and_their_environment_is_undone():
    assert humaneval.parse_variant("inline:DDTREE_INLINE_SENDS=1,DDTREE_OUTBOX_GATE=0") == (
        "inline", {"DDTREE_INLINE_SENDS": "1", "DDTREE_OUTBOX_GATE": "0"})
    for bad in ("inline", "base:A=1", "x:A", ":A=1"):
        with pytest.raises(SystemExit):
            humaneval.parse_variant(bad)
    os.environ.pop("DDTREE_TEST_ONLY_VAR", None)
    with humaneval.environment({"DDTREE_TEST_ONLY_VAR": "1"}):
        assert os.environ["DDTREE_TEST_ONLY_VAR"] == "1"
    assert "DDTREE_TEST_ONLY_VAR" not in os.environ


def test_request_split_takes_the_means_of_a_window():
    from perf.triton_bench import request_split
    before = {"ddtree_time_to_first_token_seconds_sum": 1.0, "ddtree_time_to_first_token_seconds_count": 10}
    after = {"ddtree_time_to_first_token_seconds_sum": 1.05, "ddtree_time_to_first_token_seconds_count": 15,
             "ddtree_request_latency_seconds_sum": 0.5, "ddtree_request_latency_seconds_count": 5}
    split = request_split(before, after)
    assert split["ttft_ms"] == pytest.approx(10.0) and split["latency_ms"] == pytest.approx(100.0)
    assert split["queue_ms"] is None   # nothing counted in the window


def test_triton_turns_are_divided_by_their_own_in_process_pass_where_the_run_made_one():
    speed = lambda tps: {"0": {"dflash": {"tokens_per_s": tps}}}  # noqa: E731
    variant = {"env": {}, "turns": [speed(90.0), speed(99.0)]}
    result = {"in_process": speed(100.0), "triton_variants": {"base": variant}}
    assert humaneval.turn_ratios(result, variant, "0", "dflash") == [0.9, 0.99]     # the one pass before
    result["in_process_turns"] = [speed(100.0), speed(110.0)]
    assert humaneval.turn_ratios(result, variant, "0", "dflash") == [0.9, 0.9]      # each turn's own
    table = humaneval.variants_table({**result, "acceptance": {}})
    assert "| dflash | 0 | 100.0 / 110.0 | 0.900 / 0.900 | 0.900 |" in table
