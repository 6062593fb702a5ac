"""Programs of several requests' drafting rounds made at warm-up: the drafter's pass of a round's rows and the
target's verify of each drafting arm's trees, for every padded batch size (Engine._warm_batched_drafts,
_warm_batched_verifies). A batch that would otherwise make a program on requests' time (a catch-up: `auto` drafting
after `ar` rounds; a group's first draft after its prompts) drafts through the round's program, the context before
its last rows written by the dynamic pass, and gives the dynamic pass's hidden states. The CPU runs the static
forwards eagerly (static_forward="on"), the same programs CUDA graphs capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.models.graphs import GraphPool, StaticDrafter, row_bucket
from ddtree.request import Request
from ddtree.sampling_params import SamplingParams
from tests.unit.oracle import make_tiny_hybrid, serve_together


def static_drafter(tmp_path, seed: int):
    """A drafter of the published Qwen3.6-27B-DFlash layout (5 layers, taps 1..61, sliding windows), its static pass on
    the CPU (static forwards run eagerly), and the pool of its programs."""
    from ddtree.models.dflash import DFlashDrafter
    from tests.unit.test_dflash_drafter import HIDDEN, write_published_checkpoint

    write_published_checkpoint(tmp_path / "d", [1, 16, 31, 46, 61], seed=seed, num_target_layers=64, sliding_window=6,
                               layer_types=["sliding_attention"] * 4 + ["full_attention"])
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d")
    embed = torch.nn.Embedding(50, HIDDEN)
    graphs = GraphPool(torch.device("cpu"), capture=False)
    return drafter, embed, graphs, StaticDrafter(drafter, embed, graphs)


def test_a_catch_up_drafts_through_the_rounds_program(tmp_path):
    """After warm-up, two requests appending 30 and 3 context rows (no program of 32 rows made) take the program of
    a round's rows (block + 1, made): the first 13 of the 30 rows written by the dynamic pass, the hidden states and
    context lengths those of the dynamic pass, no program made; before warm-up (and where it is made) a batch takes
    its own rows' program."""
    drafter, embed, graphs, static = static_drafter(tmp_path, seed=4)
    features_width, block = drafter.fc.in_features, drafter.block_size
    assert static.round_rows == row_bucket(block + 1) == 17
    gen = torch.Generator().manual_seed(7)
    ours, theirs = drafter.new_caches(2, 300), drafter.new_caches(2, 300)
    with torch.no_grad():
        for step, sizes in enumerate([(5, 9), (17, 2), (30, 3), (1, 40)]):
            features = [torch.randn(m, features_width, generator=gen) for m in sizes]
            blocks = [torch.randint(0, 50, (block,), generator=gen).tolist() for _ in sizes]
            made = set(graphs.programs)
            got = static.batch(ours, features, blocks)
            starts = [c.length + m for c, m in zip(theirs, sizes)]
            drafter.add_contexts(theirs, features)
            expected = drafter.forward_packed(theirs, embed(torch.tensor(blocks)), starts)
            assert [c.length for c in ours] == [c.length for c in theirs] == starts
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            new = {key[2] for key in set(graphs.programs) - made}
            if step < 2:   # before warm-up: each batch's own rows' program (9 rows, then 17)
                assert new == {row_bucket(max(sizes))}, new
            else:
                assert not new and not graphs.late_keys, graphs.late_keys
            if step == 1:
                graphs.warmed = True
    assert static.catch_up_rows == (30 - 17) + (40 - 17)



def test_a_catch_up_over_a_programs_rows_drafts_through_the_rounds_program(tmp_path):
    """A batch whose catch-up rows, padded for every request, are more than one program takes (StaticDrafter.MAX_ROWS:
    17-32 requests with one catch-up over 64 rows, `auto` drafting after `ar` rounds with its arrivals' prompt
    features pending) takes the round's program too, before warm-up as after, instead of running the whole drafter
    pass dynamically: the hidden states and context lengths of the dynamic pass. A lone request keeps the dynamic pass."""
    drafter, embed, graphs, static = static_drafter(tmp_path, seed=5)
    features_width, block = drafter.fc.in_features, drafter.block_size
    static.MAX_ROWS = 64   # 2 requests x 64 rows do not fit, 2 x 17 (a round's rows) do
    gen = torch.Generator().manual_seed(3)
    ours, theirs = drafter.new_caches(2, 300), drafter.new_caches(2, 300)
    with torch.no_grad():
        for warmed, sizes in ((False, (40, 3)), (True, (2, 50))):
            graphs.warmed = warmed
            features = [torch.randn(m, features_width, generator=gen) for m in sizes]
            blocks = [torch.randint(0, 50, (block,), generator=gen).tolist() for _ in sizes]
            got = static.batch(ours, features, blocks)
            starts = [c.length + m for c, m in zip(theirs, sizes)]
            drafter.add_contexts(theirs, features)
            expected = drafter.forward_packed(theirs, embed(torch.tensor(blocks)), starts)
            assert got is not None, sizes
            assert [c.length for c in ours] == [c.length for c in theirs] == starts
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert {key[2] for key in graphs.programs} == {static.round_rows}
        assert static.catch_up_rows == (40 - 17) + (50 - 17)
        lone = drafter.new_caches(1, 300)
        assert static.batch(lone, [torch.randn(70, features_width, generator=gen)], blocks[:1]) is None
        assert lone[0].length == 0   # nothing written: the caller's dynamic pass writes it all

def run_together(engine: Engine, lengths, modes) -> list[list[int]]:
    requests = [Request(f"r{i}", torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
                        SamplingParams(mode=mode, tree_budget=4, max_tokens=12, ignore_eos=True))
                for i, (n, mode) in enumerate(zip(lengths, modes))]
    return serve_together(engine, requests)


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_warm_up_prepares_the_drafting_rounds_of_several_requests(family, tiny_models, tmp_path):
    """Requests drafting together after warm-up (dflash chains and trees of the default arms' budgets, in groups of 2
    to 4, their first drafts after prompts of 12 to 40 tokens, their last rounds' trees cut together) make no program
    on their time, and decode the target's greedy tokens, dense and hybrid. With static_batch_memory 0 their verifies
    are made on first use (what the budget saves)."""
    if family == "hybrid":
        root, _ = make_tiny_hybrid(tmp_path)
        paths = dict(target_path=str(root / "target"), drafter_path=str(root / "dflash"))
    else:
        paths = dict(target_path=str(tiny_models / f"{family}-target"), drafter_path=str(tiny_models / f"{family}-dflash"))
    config = EngineConfig(**paths, max_model_len=160, max_num_seqs=4, static_forward="on")
    plain = Engine(dataclasses.replace(config, static_forward="off"))
    batches = [((30, 12, 25, 40), ("dflash", "ddtree", "dflash", "ddtree")), ((18, 33), ("ddtree", "ddtree")),
               ((14, 22, 35), ("dflash",) * 3)]
    for budget in (2048, 0):
        engine = Engine(dataclasses.replace(config, static_batch_memory=budget))
        engine.warm_up()
        for lengths, modes in batches:
            expected = [run_together(plain, (n,), ("ar",))[0] for n in lengths]
            assert run_together(engine, lengths, modes) == expected, (budget, lengths, modes)
        late = {key[0] for key in engine.graphs.late_keys}
        assert engine.static_drafter.catch_up_rows > 0   # the first drafts after 18-40-token prompts
        if budget:
            assert not engine.graphs.late_keys, engine.graphs.late_keys
        else:
            assert late == {"target" if family == "hybrid" else "batch"}, engine.graphs.late_keys


def test_first_drafts_of_several_long_prompts_take_the_rounds_program(tiny_models, monkeypatch):
    """Requests whose first drafts bring more prompt features than one drafter program takes for their batch (here
    MAX_ROWS 80: 4 padded requests x 64 rows; on the H200 2048: 9-32 requests after prompts of over 64 tokens)
    draft through the round's program after a dynamic write of the earlier context, not through the dynamic pass:
    no dynamic drafter pass, and the target's greedy tokens; a lone request's takes the dynamic pass, counted."""
    monkeypatch.setattr(StaticDrafter, "MAX_ROWS", 80)
    paths = dict(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"))
    config = EngineConfig(**paths, max_model_len=160, max_num_seqs=4, static_forward="on")
    plain = Engine(dataclasses.replace(config, static_forward="off"))
    engine = Engine(config)
    engine.warm_up()
    lengths = (30, 40, 25)
    expected = [run_together(plain, (n,), ("ar",))[0] for n in lengths]
    assert run_together(engine, lengths, ("dflash",) * 3) == expected
    assert engine.stage_times.dynamic_drafts == 0 and engine.static_drafter.catch_up_rows > 0
    assert engine.stage_times.draft_passes > 1
    # a lone request's first draft after a prompt of more rows than a program takes: the dynamic pass, counted
    assert run_together(engine, (100,), ("dflash",)) == [run_together(plain, (100,), ("ar",))[0]]
    assert engine.stage_times.dynamic_drafts == 1

@pytest.mark.parametrize("budget", [0, 3, 7, 2048])
def test_warm_up_makes_batched_verifies_within_their_memory(budget, tiny_models):
    """static_batch_memory bounds what the verifies of several requests' trees hold as programs (here 1/8 MiB a row,
    counted by a stand-in for CUDA's allocator): warm-up makes them smallest first while the next one fits by the bytes
    a row of those before it, so the last one made does not overshoot; every shape within 2048 MiB, none at 0."""
    config = EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                          max_model_len=160, max_num_seqs=4, static_forward="on", static_batch_memory=budget)
    engine = Engine(config)
    verifies = lambda: [key for key in engine.graphs.programs if key[0] == "batch" and key[1] > 1 and key[2] > 1]  # noqa: E731
    engine._allocated_bytes = lambda: 2**20 * sum(key[1] * key[2] for key in verifies()) // 8
    engine._warm_batched_verifies([20])
    rows = sorted(key[1] * key[2] for key in verifies())
    assert engine._allocated_bytes() <= budget * 2**20, (budget, rows)
    if budget == 0:
        assert not rows
    elif budget == 2048:
        assert len(rows) == 12, rows   # 2 and 4 requests x the row buckets of dflash and ddtree-4 ... ddtree-64
    else:
        assert rows and rows[-1] < 8 * budget, rows
