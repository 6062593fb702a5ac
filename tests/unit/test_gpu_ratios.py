"""perf/gpu_ratios.py end to end on tiny shapes (CPU): the table, the goals, the plot."""

from __future__ import annotations

import json
import math

import pytest

from perf import gpu_ratios
from perf.common import ROOT


def test_ratio_table_on_tiny_shapes(tmp_path):
    result = gpu_ratios.main(["--shapes", "tiny-hybrid,tiny-dense", "--dtype", "float32", "--budgets", "16,64",
                              "--prompt-len", "24", "--repeats", "1", "--rounds", "3", "--out", str(tmp_path),
                              "--name", "r"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["shapes"]) == {"tiny-hybrid", "tiny-dense"}
    for shape in saved["shapes"].values():
        assert set(shape["verify"]) == {"dynamic", "static"}
        assert set(shape["rounds"]) == {"dynamic", "static", "static-hosttree"}
        # the static forward builds a lone greedy request's trees on the device (one read a round); the variant on the host
        assert shape["rounds"]["static"]["ddtree-16"]["device_tree_share"] > 0.5   # the last round drafts nothing
        assert shape["rounds"]["static-hosttree"]["ddtree-16"]["device_tree_share"] == 0
        for rounds in shape["rounds"].values():
            assert set(rounds) == {"ar", "dflash", "ddtree-16", "ddtree-64"}
            assert all(1 <= e["rounds"] <= 3 and e["round_ms"] > 0 and 0 <= e["host_share"] < 1 for e in rounds.values())
            assert rounds["ar"]["draft_ms"] == 0 and rounds["ddtree-64"]["draft_ms"] > 0
            # the CPU has no chain kernel, so no paths-form stash: every commit is eager
            assert all(e["static_commit_share"] == 0 for e in rounds.values())
            for e in rounds.values():   # the commit stage's parts add up to it
                assert sum(e["commit_parts_ms"].values()) == pytest.approx(e["commit_ms"], rel=1e-6, abs=1e-6)
        assert set(shape["batched"]) == {"ar", "ddtree-16"}
        for per in shape["batched"].values():                         # R = 1, 2, 4, 8 concurrent requests
            assert list(per) == ["1", "2", "4", "8"] and all(e["rounds"] == 3 and e["tokens_per_s"] > 0 for e in per.values())
        assert math.isnan(shape["ratios"]["ar_over_floor"])          # no GPU, no bandwidth floor
        assert math.isnan(shape["ratios"]["ar_round_over_floor"])    # the whole `ar` round against it, too
        assert shape["ratios"]["ddtree-64_over_ar"] == shape["rounds"]["static"]["ddtree-64"]["round_over_ar"]
        # a drafting round's floor adds the drafter's weights and the lm_head read again (no GPU: NaN ratios)
        assert shape["draft_bytes"] > shape["weight_bytes"] * 0.05 and math.isnan(shape["ratios"]["ddtree-16_over_its_floor"])
        for forward, verify in shape["verify"].items():
            assert verify["forward"] == forward and list(verify["budgets"]) == ["16", "64"]
            assert verify["ar_step_ms"] > 0 and all(e["verify_ms"] > 0 for e in verify["budgets"].values())
    from ddtree.budget import CostModel

    cost = CostModel.load(tmp_path / "cost_model_r_tiny-hybrid.json")
    assert cost.rows == (1, 17, 65) and cost.draft_ms > 0
    assert cost.verify(17) == saved["shapes"]["tiny-hybrid"]["verify"]["static"]["budgets"]["16"]["verify_ms"]
    md = (tmp_path / "r.md").read_text()
    assert "a drafting round streams the target's" in md
    assert "| tiny-dense |" in md and "Goals (issue 6)" in md and "static commits: ar 0%" in md and "token bookkeeping): dynamic ar" in md
    assert (tmp_path / "r.png").stat().st_size > 1000 and result["plot"].endswith("r.png")
    checkpoint = json.loads((tmp_path / "r_tiny-hybrid_verify.json").read_text())   # kept as the verifies landed
    verify = saved["shapes"]["tiny-hybrid"]["verify"]["static"]
    assert checkpoint["verify_ms"]["static"]["budgets_ms"]["64"] == verify["budgets"]["64"]["verify_ms"]


def test_rounds_in_turns_pair_each_form_with_the_static_forward(tmp_path):
    """--round-turns: the static forward's rounds and a variant's (its environment set in its turns) measured in
    turns (static-hosttree, static-vocab32k, static-arahead, static-noahead: an engine setting): medians over turns,
    each turn's ratio to the form's own `ar`, and the variant against the static forward in the same turn; the
    sequential variant rounds are not run then."""
    gpu_ratios.main(["--shapes", "tiny-dense", "--dtype", "float32", "--budgets", "16", "--forwards", "static",
                     "--batches", "", "--variants", "static-gemv32", "--round-variants",
                     "static-gemv32,static-hosttree,static-vocab32k,static-arahead,static-noahead",
                     "--round-turns", "3", "--prompt-len", "24", "--repeats", "1", "--rounds", "3",
                     "--out", str(tmp_path), "--name", "t"])
    shape = json.loads((tmp_path / "t.json").read_text())["shapes"]["tiny-dense"]
    assert set(shape["rounds"]) == {"static"} and not shape["errors"]
    turns = shape["round_turns"]
    assert list(turns) == ["static", "static-gemv32", "static-hosttree", "static-vocab32k", "static-arahead",
                           "static-noahead"]
    for form, methods in turns.items():
        assert list(methods) == ["ar", "dflash", "ddtree-16"]
        for e in methods.values():
            assert len(e["turns_ms"]) == 3 and e["round_ms"] == sorted(e["turns_ms"])[1] and e["rounds"] == 3
        assert methods["ar"]["round_over_ar"] == 1.0 and methods["ddtree-16"]["draft_ms"] > 0
        paired = methods["ddtree-16"].get("over_first")
        if form == "static":
            assert paired is None
        else:
            ratios = [m / f for m, f in zip(methods["ddtree-16"]["turns_ms"], turns["static"]["ddtree-16"]["turns_ms"])]
            assert paired["form"] == "static" and paired["min"] == min(ratios) and paired["max"] == max(ratios)
    assert "whole rounds in turns (3 turns" in (tmp_path / "t.md").read_text()


def test_turns_only_measures_the_whole_rounds_in_turns_alone(tmp_path, monkeypatch):
    """--turns-only: no verify curve, no separate rounds, no batches, no cost model; the ratios from the static
    forward's turns, the variants paired with it (static-again: the default form's engine a second time, an A/A
    control); the table still written, and each turn's rounds as it ends. The turns run with the engines' heap frozen
    (--freeze-heap, the default: as the served model's after warm-up), unfrozen after."""
    import gc

    from perf import hybrid_verify

    gc.unfreeze()   # whatever an earlier test left frozen: the turns' count must come from their own freeze
    frozen, measure = [], hybrid_verify.measure_method
    monkeypatch.setattr(hybrid_verify, "measure_method",
                        lambda *a, **k: frozen.append(gc.get_freeze_count()) or measure(*a, **k))
    gpu_ratios.main(["--shapes", "tiny-dense", "--dtype", "float32", "--budgets", "16", "--turns-only",
                     "--round-variants", "static-hosttree,static-again", "--round-turns", "2", "--prompt-len", "24",
                     "--repeats", "1", "--rounds", "3", "--out", str(tmp_path), "--name", "t"])
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["freeze_heap"] is True
    shape = result["shapes"]["tiny-dense"]
    assert shape["verify"] == {} and shape["rounds"] == {} and shape["batched"] == {} and not shape["errors"]
    turns = shape["round_turns"]
    assert list(turns) == ["static", "static-hosttree", "static-again"]
    assert shape["ratios"]["ddtree-16_over_ar"] == turns["static"]["ddtree-16"]["round_over_ar"]
    assert shape["ratios"]["dflash_over_ar"] == turns["static"]["dflash"]["round_over_ar"]
    assert 0 <= shape["ratios"]["host_share"] < 1 and math.isnan(shape["ratios"]["ar_over_floor"])
    assert len(turns["static-hosttree"]["ddtree-16"]["over_first"]) == 4
    partial = json.loads((tmp_path / "t_tiny-dense_turns.json").read_text())["turns_round_ms"]   # kept after each turn
    assert partial["static-hosttree"]["ddtree-16"] == turns["static-hosttree"]["ddtree-16"]["turns_ms"]
    assert not (tmp_path / "cost_model_t_tiny-dense.json").exists()
    md = (tmp_path / "t.md").read_text()
    assert "whole rounds in turns (2 turns" in md and "target verify alone" not in md and "whole engine rounds" not in md
    assert "the turns' commit stage host time by part" in md and "static-again ddtree-16 " in md
    # the static programs' runs timed by kind (on the CPU their bodies run eagerly: the host time is their compute)
    assert {"batch", "draft", "tree"} <= set(turns["static"]["ddtree-16"]["program_host_ms"])   # the verify, draft, tree
    assert all(v > 0 for v in turns["static-again"]["ddtree-16"]["program_host_ms"].values())
    assert "the turns' static program runs' host time by kind" in md
    with pytest.raises(SystemExit):
        gpu_ratios.main(["--shapes", "tiny-dense", "--turns-only", "--out", str(tmp_path)])


def test_a_variant_of_the_runs_own_runs_under_its_environment(tmp_path, monkeypatch):
    """--variant-env: a form given on the command line (NAME:KEY=VALUE,...) runs its engine under that environment in
    the turns, beside the default's without it; the results record it, and the module's forms stay as they were."""
    import os

    from perf import hybrid_verify

    seen, build = [], hybrid_verify.Engine
    monkeypatch.setattr(hybrid_verify, "Engine", lambda *a, **k: seen.append(os.environ.get("DDTREE_TEST_FORM")) or build(*a, **k))
    before = dict(gpu_ratios.VARIANT_ENV)
    gpu_ratios.main(["--shapes", "tiny-dense", "--dtype", "float32", "--budgets", "16", "--turns-only",
                     "--round-variants", "static-mine", "--variant-env", "static-mine:DDTREE_TEST_FORM=a:b,DDTREE_X=1",
                     "--round-turns", "1", "--prompt-len", "24", "--repeats", "1", "--rounds", "2", "--out", str(tmp_path),
                     "--name", "t"])
    assert gpu_ratios.VARIANT_ENV == before and "DDTREE_TEST_FORM" not in os.environ
    assert sorted(seen, key=str) == [None, "a:b"]   # the default's engine, then the variant's (its value keeps its colon)
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["variant_env"] == {"static-mine": {"DDTREE_TEST_FORM": "a:b", "DDTREE_X": "1"}}
    assert list(result["shapes"]["tiny-dense"]["round_turns"]) == ["static", "static-mine"]
    assert "static-mine (this run's own, --variant-env)" in (tmp_path / "t.md").read_text()
    for bad in ("mine:A=1", "static-x:A=1,B", "static-x:=1", "static-again:A=1", "static-sdpa:A=1"):
        with pytest.raises(SystemExit):   # not a static- name, a pair without its value or key, a form already there
            gpu_ratios.main(["--shapes", "tiny-dense", "--turns-only", "--round-turns", "1", "--variant-env", bad,
                             "--out", str(tmp_path)])


def test_a_form_whose_engine_fails_is_left_out_of_the_turns(tmp_path, monkeypatch):
    """A variant whose engine cannot be built (a kernel of its that does not compile, 6a7041c on an H100) costs its
    own turns only: its error recorded under "<form> rounds", the static forward measured as usual."""
    from perf import hybrid_verify

    build = hybrid_verify.rounds_engine

    def failing(*args, device_tree: bool = True, **kwargs):
        if not device_tree:
            raise RuntimeError("does not compile")
        return build(*args, device_tree=device_tree, **kwargs)

    monkeypatch.setattr(hybrid_verify, "rounds_engine", failing)
    gpu_ratios.main(["--shapes", "tiny-dense", "--dtype", "float32", "--budgets", "16", "--turns-only",
                     "--round-variants", "static-hosttree", "--round-turns", "2", "--prompt-len", "24", "--repeats", "1",
                     "--rounds", "3", "--out", str(tmp_path), "--name", "t"])
    shape = json.loads((tmp_path / "t.json").read_text())["shapes"]["tiny-dense"]
    assert list(shape["round_turns"]) == ["static"] and len(shape["round_turns"]["static"]["ar"]["turns_ms"]) == 2
    assert shape["errors"] == {"static-hosttree rounds": "RuntimeError: does not compile"}


def test_kernels_per_round_subtract_the_prefill():
    from perf.hybrid_verify import kernels_per_round

    whole = {"all": {"gemm": (130.0, 26.0), "topk": (12.0, 0.6), "prefill_only": (1.0, 5.0)}}
    prefill = {"all": {"gemm": (10.0, 2.0), "prefill_only": (1.0, 5.0)}}
    assert kernels_per_round(whole, prefill, rounds=12) == [["gemm", 10.0, 2.0], ["topk", 1.0, 0.05]]


def test_idle_gaps_are_keyed_by_the_activities_around_them():
    from perf.hybrid_verify import gaps_per_round, idle_gaps

    timeline = [("draft", 0.0, 10.0), ("topk", 12.0, 13.0), ("DtoH", 13.5, 14.0), ("verify", 50.0, 90.0),
                ("embed", 20.0, 30.0),
                ("commit", 95.0, 96.0), ("draft", 100.0, 110.0), ("topk", 111.0, 112.0)]
    gaps = idle_gaps(timeline, threshold_us=1.5)
    assert gaps == {("draft", "topk"): (1, 2.0), ("DtoH", "embed"): (1, 6.0), ("embed", "verify"): (1, 20.0),
                    ("verify", "commit"): (1, 5.0), ("commit", "draft"): (1, 4.0)}
    # overlapping activities: the gap runs from the latest end before the next start
    assert idle_gaps([("a", 0.0, 10.0), ("b", 2.0, 4.0), ("c", 20.0, 21.0)], threshold_us=3.0) == {("a", "c"): (1, 10.0)}
    whole = {"gaps": {("draft", "topk"): (4, 8.0), ("DtoH", "verify"): (4, 20.0), ("prefill", "x"): (1, 3.0)}}
    prefill = {"gaps": {("DtoH", "verify"): (1, 2.0), ("prefill", "x"): (1, 3.0)}}
    assert gaps_per_round(whole, prefill, rounds=3) == [["DtoH", "verify", 1.0, 6.0], ["draft", "topk", 1.33, 2.6667]]


def test_program_profiles_count_calls_per_round_and_skip_uncaptured(monkeypatch):
    from types import SimpleNamespace

    from perf import hybrid_verify

    replays = []
    monkeypatch.setattr(hybrid_verify, "kernel_profile",
                        lambda fn: (fn(), {"device_ms": 1.0, "span_ms": 1.25, "kernels": 7, "top": [], "all": {}})[1])
    captured = SimpleNamespace(graph=SimpleNamespace(replay=lambda: replays.append("verify")))
    programs = {("verify", 1): captured, ("commit", 16): SimpleNamespace(graph=False), ("draft", 1): SimpleNamespace(graph=None)}
    engine = SimpleNamespace(graphs=SimpleNamespace(programs=programs))
    keys = [("verify", 1), ("commit", 16), ("verify", 1), ("draft", 1), ("verify", 1), ("verify", 1)]
    rows = hybrid_verify.program_profiles(engine, keys, rounds=2)
    assert rows == [{"key": ["verify", "1"], "calls_per_round": 2.0, "device_ms": 1.0, "span_ms": 1.25, "kernels": 7,
                     "top": []}]
    assert replays == ["verify"]    # replayed once, under the (faked) profiler; the eager and uncaptured ones not at all


def test_graph_turns_pairs_each_variant_with_the_default(tmp_path):
    from perf import graph_turns

    result = graph_turns.main(["--shape", "tiny-hybrid", "--device", "cpu", "--dtype", "float32", "--variants",
                               "static-noqkv", "--budgets", "16", "--prompt-len", "24", "--turns", "3", "--repeats", "1",
                               "--out", str(tmp_path), "--name", "t"])
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["configs"] == {"static": {}, "static-noqkv": {"DDTREE_QKV_KERNEL": "0"}}
    for name in ("static", "static-noqkv"):
        assert list(saved["summary"][name]) == ["ar", "dflash", "ddtree-16"]
        for program, row in saved["summary"][name].items():
            assert len(saved["samples"][name][program]["step"]) == 3 and row["step"] > 0
            assert math.isnan(row["replay"])   # no graphs on the CPU
        ratio = saved["summary"][name]["ar"]["step_vs_static"]
        assert ratio == 1.0 if name == "static" else ratio > 0
    assert len(result["floor_ms"]) == 3 and all(math.isnan(f) for f in result["floor_ms"])
    with pytest.raises(SystemExit):
        graph_turns.main(["--variants", "static-nonesuch", "--out", str(tmp_path)])


@pytest.mark.parametrize("prompt_len, rounds", [(512, 12), (512, 40), (24, 3), (1000, 20)])
def test_the_rounds_engines_key_buckets_are_not_clipped(prompt_len, rounds):
    """The rounds' engines (hybrid_verify.engine_max_len) hold every key bucket their contexts reach whole: the
    target's (context and a budget-64 tree) and the drafter's with room for its block's 16 K/V rows after it, the
    condition of its in-place attention kernel (DFlashDrafter.forward_pooled), as on a server with a long context
    limit. At the default 512 tokens the old limit (prompt_len + rounds + 4: a cache of 593 rows) clipped both."""
    from ddtree.models.graphs import MIN_KEYS, key_bucket
    from perf.hybrid_verify import engine_max_len

    def unclipped(n: int) -> int:
        return max(MIN_KEYS, 1 << (n - 1).bit_length())

    def fits(cache_len: int) -> bool:
        for context in range(prompt_len, prompt_len + rounds + 5):
            draft_keys = key_bucket(context + 17, cache_len)       # a round's accepted tokens appended, then the block
            if key_bucket(context + 65, cache_len) != unclipped(context + 65) or draft_keys != unclipped(context + 17):
                return False
            if draft_keys + 16 > cache_len:
                return False
        return True

    assert fits(engine_max_len(prompt_len, rounds) + 64 + 1)        # the engine's cache: max_model_len + budget + 1
    if prompt_len == 512 and rounds == 12:
        assert not fits(prompt_len + rounds + 4 + 64 + 1)            # the old limit: the test can fail


def test_the_smollm2_shape_is_the_shipped_pairs():
    """gpu_ratios' smollm2-135m shape (random weights) has the embedded default's dimensions: its target's as the
    shipped drafter records them, and that drafter's layers, block, mask id, taps and heads."""
    config = json.loads((ROOT / "drafters/smollm2-135m-instruct-dflash/config.json").read_text())
    target, drafter = gpu_ratios.DENSE_SHAPES["smollm2-135m"], gpu_ratios.DENSE_DRAFTERS["smollm2-135m"]
    assert (target["hidden_size"], target["intermediate_size"], target["vocab_size"], target["num_hidden_layers"]) == (
        config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_target_layers"])
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert (drafter["num_layers"], drafter["block_size"], drafter["mask_token_id"], drafter["target_layer_ids"],
            drafter["heads"]) == (config["num_hidden_layers"], config["block_size"], config["dflash_config"]["mask_token_id"],
                                  config["dflash_config"]["target_layer_ids"], heads)
    # the drafter's attention has the target's dims, rotary base and norm epsilon (what the kernels' choice rests on)
    assert (target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]) == heads
    assert target["rope_theta"] == config["rope_theta"] and target["rms_norm_eps"] == pytest.approx(config["rms_norm_eps"])
    assert target["model_type"] == "llama"   # SmolLM2: no q/k norms
    built = ROOT / "models/smollm2-135m-instruct/config.json"   # the embedded default, where `make setup` made it
    if built.is_file():
        hf = json.loads(built.read_text())
        assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == target["num_hidden_layers"]
