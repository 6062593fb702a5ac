"""EngineConfig.static_prefill: a lone dense prompt prefilled through the static forward (a chain of rows from
position 0, its own program per row bucket; on CUDA a graph replay) decodes what the eager prefill decodes, in every
mode, for dense and hybrid targets; longer prompts keep the eager prefill, and arrivals admitted together share one
static prefill per row bucket. The CPU runs the static forwards eagerly (static_forward="on"), the same programs CUDA
graphs capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.models.graphs import prefill_bucket, row_bucket
from ddtree.request import Request
from ddtree.sampling_params import SamplingParams
from tests.unit.oracle import make_tiny_hybrid, serve_together


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engines(target: str, drafter: str) -> tuple[Engine, Engine]:
    base = dict(target_path=target, drafter_path=drafter, max_model_len=160, max_num_seqs=2, static_forward="on")
    return Engine(EngineConfig(**base)), Engine(EngineConfig(**base, static_prefill=40))


def test_a_static_prefill_decodes_what_the_eager_prefill_decodes(tiny_models):
    plain, static = engines(str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash"))
    cases = [(1, "ar", 1), (2, "dflash", 1), (5, "ddtree", 16), (17, "ddtree", 8), (33, "auto", 16), (40, "ar", 1),
             (41, "ddtree", 16)]
    for i, (n, mode, budget) in enumerate(cases):
        params = SamplingParams(mode=mode, tree_budget=budget, max_tokens=24, ignore_eos=True)
        expected = plain.generate_ids(prompt(i, n), params).output_ids
        assert static.generate_ids(prompt(i, n), params).output_ids == expected, (n, mode)
    # sampling: the same first token's distribution (the same seed draws the same tokens)
    params = SamplingParams(mode="ddtree", tree_budget=8, max_tokens=16, temperature=1.0, seed=5)
    assert static.generate_ids(prompt(9, 12), params).output_ids == plain.generate_ids(prompt(9, 12), params).output_ids
    assert static.stage_times.static_prefills == 7 and plain.stage_times.static_prefills == 0   # not the 41-token one


def test_the_prefill_logits_and_cache_equal_the_eager_ones(tiny_models):
    """The first token's logits and every committed K/V row of the prompt, static against eager."""
    plain, static = engines(str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash"))
    ids = prompt(3, 23)
    seen = {}
    for name, engine in (("plain", plain), ("static", static)):
        chosen = []   # the logits the prompt's first token is chosen from (greedy: with its group's, _greedy_firsts)
        real = engine._greedy_firsts
        engine._greedy_firsts = lambda seqs, logits, real=real, chosen=chosen: chosen.append(logits[0].clone()) or real(
            seqs, logits)
        engine.add(Request("r", ids, SamplingParams(mode="ar", max_tokens=1)))
        engine.step()
        cache = engine.caches[0]
        seen[name] = (chosen[0], [layer[cache.slot, :23].clone() for layer in cache.pool.k],
                      [layer[cache.slot, :23].clone() for layer in cache.pool.v])
    assert torch.allclose(seen["plain"][0], seen["static"][0], atol=1e-4)
    for a, b in zip(seen["plain"][1] + seen["plain"][2], seen["static"][1] + seen["static"][2]):
        assert torch.allclose(a, b, atol=1e-4)
    assert static.stage_times.static_prefills == 1


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_prefill_program_computes_the_last_rows_logits_alone(family, tiny_models, tmp_path):
    """A prompt's logits are read for its last row only: the program's lm_head runs on that row ([1, vocab] out of
    each prefill program, not rows x vocab: 358 MiB in bf16 over the 16 buckets at Qwen3.6-27B's vocabulary), and the first
    token equals the eager prefill's (test above), for dense and hybrid targets."""
    root = make_tiny_hybrid(tmp_path)[0] if family == "hybrid" else None
    target, drafter = ((str(root / "target"), str(root / "dflash")) if root is not None else
                       (str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash")))
    plain, static = engines(target, drafter)
    shapes = []
    real = static.static_target.batch
    static.static_target.batch = lambda *a, **k: (lambda r: shapes.append((k.get("prefill"), r[0].shape)) or r)(
        real(*a, **k))
    for n in (1, 7, 23):
        params = SamplingParams(mode="ddtree", tree_budget=8, max_tokens=6, ignore_eos=True)
        assert static.generate_ids(prompt(n, n), params).output_ids == plain.generate_ids(prompt(n, n), params).output_ids
    prefills = [shape for prefill, shape in shapes if prefill]
    assert len(prefills) == 3 and all(shape[0] == 1 for shape in prefills), prefills


def run_together(engine: Engine, seed: int, lengths=(9, 14, 19, 45)) -> list[list[int]]:
    """Requests admitted in one step, decoded to the end (mixed modes)."""
    modes = [("ddtree", 8), ("ar", 1), ("dflash", 1), ("auto", 8)]
    requests = [Request(f"r{i}", prompt(seed + i, n), SamplingParams(mode=modes[i % 4][0], tree_budget=modes[i % 4][1],
                                                                     max_tokens=12, ignore_eos=True))
                for i, n in enumerate(lengths)]
    return serve_together(engine, requests)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_arrivals_together_share_a_static_prefill(family, tiny_models, tmp_path):
    """Prompts admitted at once share one static program per prefill_bucket (9 and 14 tokens: one of two prompts of
    16 rows, each prompt's last row's logits and its own rows' features; 19 alone; 45, over static_prefill, eager) and
    decode what the packed eager prefill decodes, dense and hybrid, in every mode."""
    root = make_tiny_hybrid(tmp_path)[0] if family == "hybrid" else None
    target, drafter = ((str(root / "target"), str(root / "dflash")) if root is not None else
                       (str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash")))
    base = dict(target_path=target, drafter_path=drafter, max_model_len=160, max_num_seqs=4, static_forward="on")
    plain, static = Engine(EngineConfig(**base)), Engine(EngineConfig(**base, static_prefill=40))
    assert run_together(static, 20) == run_together(plain, 20)
    assert static.stage_times.static_prefills == 3 and plain.stage_times.static_prefills == 0
    groups = [key for key in static.graphs.programs if key[-1] == "prefill"]
    assert sorted(key[1:3] for key in groups) == [(1, row_bucket(19)), (2, 16)], groups


@pytest.mark.parametrize("budget, sizes", [(2048, {16: 4, 32: 4, 64: 4}), (10, {16: 4, 32: 2}), (9, {16: 4}), (0, {})])
def test_warm_up_makes_group_prefills_within_their_memory(budget, sizes, tiny_models):
    """static_prefill_memory bounds what the group prefills' programs hold: warm-up makes them smallest first (here
    each holds 1/16 MiB a row, counted by a stand-in for CUDA's allocator: 2, 4, 4, 8, ... MiB) while the next one fits
    by the bytes a row of those before it (10 MiB: 2 + 4 + 4; at 9 the third would overshoot, it is not made); a group
    larger than its row bucket's largest program is split into those (four prompts of 32 rows: two programs of two
    within 10 MiB, a lone prefill each within 9 or 0), the tokens the eager prefill's either way, and no program made
    after warm-up."""
    config = EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                          max_model_len=160, max_num_seqs=4, static_forward="on", static_prefill=40,
                          static_prefill_memory=budget)
    engine = Engine(config)
    engine._allocated_bytes = lambda: 2**20 * sum(key[1] * key[2] // 16 for key in engine.graphs.programs
                                                  if key[-1] == "prefill" and key[1] > 1)
    engine.warm_up()
    assert engine._group_sizes == sizes
    assert engine._allocated_bytes() <= budget * 2**20
    lengths = (20, 30, 17, 25)
    assert {prefill_bucket(n) for n in lengths} == {32}
    expected = run_together(Engine(dataclasses.replace(config, static_prefill=0)), 30, lengths)
    assert run_together(engine, 30, lengths) == expected
    assert engine.stage_times.static_prefills == 4
    assert not [key for key in engine.graphs.late_keys if "prefill" in key], engine.graphs.late_keys


def test_a_hybrid_static_prefill_starts_from_a_zero_state_and_commits_the_eager_one(tmp_path):
    """A hybrid's static forward reads its slot's recurrent state: for a prefill it is reset first (here the slot
    held the state a longer request left), and the committed conv windows and states equal the eager prefill's; every
    mode's tokens too."""
    root, _ = make_tiny_hybrid(tmp_path)
    plain, static = engines(str(root / "target"), str(root / "dflash"))
    for i, (n, mode, budget) in enumerate([(30, "ar", 1), (3, "ddtree", 8), (14, "dflash", 1), (40, "ddtree", 16),
                                           (1, "auto", 16)]):
        params = SamplingParams(mode=mode, tree_budget=budget, max_tokens=20, ignore_eos=True)
        expected = plain.generate_ids(prompt(i, n), params).output_ids
        assert static.generate_ids(prompt(i, n), params).output_ids == expected, (n, mode)
    assert static.stage_times.static_prefills == 5
    states = {}
    for name, engine in (("plain", plain), ("static", static)):
        engine.add(Request("r", prompt(7, 9), SamplingParams(mode="ar", max_tokens=1)))
        engine.step()
        cache = engine.caches[0]
        states[name] = (cache.conv.clone(), cache.state.clone(), [t[:, :9].clone() for t in (cache.kv.k, cache.kv.v)])
    a, b = states["plain"], states["static"]
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-4)
    assert all(torch.allclose(x, y, atol=1e-4) for x, y in zip(a[2], b[2]))


def test_the_prompts_features_outlive_the_programs_next_run(tiny_models):
    """The prompt's features the drafter has yet to read must be its own copy: the program's outputs are the same
    memory every replay, and the next prefill of its row bucket (a request admitted alone while this one waits to
    draft) or an `ar` step of one row (an `auto` request's `ar` arm, scripted here) writes the rows they came from.
    On the CPU each run's outputs are new tensors, so this holds either way here; the GPU test runs this case
    captured."""
    from ddtree.budget import Arm
    from ddtree.engine import _joined

    plain, static = engines(str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash"))
    pending = {}
    for name, engine in (("plain", plain), ("static", static)):
        engine.arm_selector.choose = lambda num_seqs, max_budget=None, chain=True: Arm("ar")
        engine.add(Request("r", prompt(11, 1), SamplingParams(mode="auto", tree_budget=8, max_tokens=8, ignore_eos=True)))
        engine.step()   # the prefill
        engine.step()   # an `ar` round
        pending[name] = _joined(engine.running[0].pending_taps).clone()
    assert pending["static"].shape == pending["plain"].shape == (2, pending["plain"].shape[1])
    assert torch.allclose(pending["static"], pending["plain"], atol=1e-4)
    assert static.stage_times.static_prefills == 1


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_one_prefill_program_serves_every_slot(family, tiny_models, tmp_path):
    """A request admitted alone while another runs holds slot 1: its prefill replays the program slot 0's made (the
    slot is an input, as in a batch's program; one made per slot would be ~16 row buckets x max_num_seqs captures),
    and both requests decode what they decode with the eager prefill."""
    from ddtree.models.graphs import row_bucket

    root = make_tiny_hybrid(tmp_path)[0] if family == "hybrid" else None
    target, drafter = ((root / "target", root / "dflash") if root else
                       (tiny_models / "qwen3-target", tiny_models / "qwen3-dflash"))
    plain, static = engines(str(target), str(drafter))
    first = SamplingParams(mode="ar", max_tokens=20, ignore_eos=True)
    second = SamplingParams(mode="ddtree", tree_budget=8, max_tokens=12, ignore_eos=True)
    results = {}
    for name, engine in (("plain", plain), ("static", static)):
        a, b = Request("a", prompt(1, 7), first), Request("b", prompt(2, 8), second)
        engine.add(a)
        engine.step()
        made = set(engine.graphs.programs)
        engine.add(b)
        engine.step()   # b admitted alone, into slot 1
        assert engine.running[1].slot == 1
        new = set(engine.graphs.programs) - made
        while engine.has_work:
            engine.step()
        results[name] = (a.output_ids, b.output_ids, new)
    assert results["static"][:2] == results["plain"][:2]
    assert static.stage_times.static_prefills == 2
    assert [key for key in static.graphs.programs if "prefill" in key and key[2] == row_bucket(8)]   # a's (7 rows: 8)
    assert not [key for key in results["static"][2] if key[1] == 1 and key[2] == row_bucket(8)], results["static"][2]


def test_auto_turns_static_prefill_on_where_static_forwards_are_graphs(tiny_models):
    """config.pbtxt's "auto" parses to None, which the engine resolves: STATIC_PREFILL_AUTO with CUDA graphs, off
    on the CPU's eager static forwards; a number is kept."""
    assert EngineConfig.from_dict({"target_path": "t", "default_mode": "ar", "static_prefill": "auto"}).static_prefill is None
    assert EngineConfig.from_dict({"target_path": "t", "default_mode": "ar", "static_prefill": "12"}).static_prefill == 12
    base = dict(target_path=str(tiny_models / "qwen3-target"), default_mode="ar", max_model_len=160, static_forward="on")
    assert Engine(EngineConfig(**base)).static_prefill == 0
    assert Engine(EngineConfig(**base, static_prefill=12)).static_prefill == 12
    assert Engine(EngineConfig(**{**base, "static_forward": "off"}, static_prefill=12)).static_prefill == 0


def test_warm_up_prepares_the_prefills_programs(tiny_models):
    """Every row bucket up to static_prefill is made at warm-up, for a lone prompt and for prompts admitted together:
    a prompt served after it makes no program (a capture on a user's request, tens of milliseconds at 27B), in slot 0
    or slot 1, alone or with others."""
    base = dict(target_path=str(tiny_models / "qwen3-target"), default_mode="ar", max_model_len=160, max_num_seqs=3,
                static_forward="on")
    engine = Engine(EngineConfig(**base, static_prefill=20))
    engine.warm_up()
    assert engine.graphs.warmed and not engine.graphs.late_keys
    params = SamplingParams(mode="ar", max_tokens=3, ignore_eos=True)
    for n in (1, 3, 6, 11, 20):
        assert engine.generate_ids(prompt(n, n), params).output_ids
    engine.add(Request("a", prompt(5, 5), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True)))
    engine.step()
    engine.add(Request("b", prompt(6, 13), params))
    engine.step()   # b alone, into slot 1
    while engine.has_work:
        engine.step()
    assert engine.stage_times.static_prefills == 7
    for lengths in ((4, 20), (2, 9, 15), (17, 18, 19)):
        for n in lengths:
            engine.add(Request(f"g{n}", prompt(n, n), params))
        while engine.has_work:
            engine.step()
    assert engine.stage_times.static_prefills == 15
    assert not [key for key in engine.graphs.late_keys if "prefill" in key], engine.graphs.late_keys   # no prefill's


def test_a_groups_greedy_first_tokens_come_from_one_argmax(tiny_models):
    """_greedy_firsts: the first tokens of the group's greedy requests that suppress nothing, the argmax of each one's
    row (as one device read, made after the step's round: FirstTokens.tokens); None for a request with min_tokens
    (its EOS suppressed first) or one that samples, which _start_decoding chooses alone."""
    plain, _ = engines(str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash"))
    ids = prompt(1, 9)
    for i, params in enumerate([SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, min_tokens=2),
                                SamplingParams(max_tokens=4, temperature=1.0, seed=1), SamplingParams(max_tokens=4)]):
        plain.add(Request(f"r{i}", ids, params))
    logits = torch.randn(4, plain.target.config.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[3, 7] = 100.0
    assert plain._greedy_firsts(list(plain.waiting), logits).tokens() == [int(logits[0].argmax()), None, None, 7]
    assert plain._greedy_firsts(list(plain.waiting)[1:3], logits[1:3]).tokens() == [None, None]
