"""The draft tree and the verify's tree inputs built on the device (ddtree.tree.device, graphs.StaticTreeBuild), and
the round that uses them (Engine._round_on_device: draft, tree and verify queued back to back, one read).

The device build must give build_tree's tree (untied inputs: exact ties may order differently, which any tree
survives losslessly), its paths form gdn.tree_paths', and the engine with it must decode exactly the target's own
greedy tokens (fp32) in every drafting mode, the rounds that fall back to the host included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.models.gdn import tree_paths
from ddtree.models.qwen3_5 import PATHS_MAX_LEN
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, top_log_probs
from ddtree.tree.device import build_tree_device, fits_budget, tree_paths_device, verify_rows
from tests.unit.oracle import OracleDraftEngine, make_tiny_hybrid, serve_together


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid_device_tree"))


def random_case(seed: int):
    """(log-probs, ids on the host as build_tree reads them, the same on the device as a round has them, budget)."""
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = int(torch.randint(1, 16, (), generator=gen)), int(torch.randint(2, 80, (), generator=gen))
    budget = int(torch.randint(1, 100, (), generator=gen))
    k = 1 if seed % 4 == 0 else min(budget, vocab)   # every fourth a chain (dflash)
    logits = 3 * torch.randn(depth, vocab, generator=gen)
    top, ids = torch.topk(torch.log_softmax(logits, dim=-1), k)
    return top_log_probs(logits, k), (top, ids), budget


@pytest.mark.parametrize("seed", range(60))
def test_device_build_equals_the_host_build(seed):
    (log_probs, token_ids), (top, ids), budget = random_case(seed)
    tree = build_tree(log_probs, token_ids, budget)
    n = tree.num_nodes
    assert n == fits_budget(*top.shape, budget)
    # in a program of a larger width (a larger row bucket: ranks past the budget at -inf), the first n nodes
    width = budget + seed % 3
    extra = width - top.shape[1]
    padded = torch.cat([top, torch.full((top.shape[0], extra), float("-inf"))], dim=1)
    tokens, parents, depths = build_tree_device(padded, torch.cat([ids, torch.zeros(ids.shape[0], extra, dtype=torch.long)], dim=1),
                                                width)
    assert tokens[:n].tolist() == tree.tokens[1:]
    assert parents[:n].tolist() == tree.parents[1:] and depths[:n].tolist() == tree.depths[1:]
    head = verify_rows(torch.tensor(7), torch.tensor(30), torch.tensor(n + 1), tokens, parents, depths)
    pad = width - n
    assert head[0].tolist() == [7] + tree.tokens[1:] + [0] * pad
    assert head[1].tolist() == [30 + d for d in tree.depths] + [30] * pad
    assert head[2].tolist() == tree.parents + [-1] * pad


@pytest.mark.parametrize("seed", range(12))
def test_the_one_program_build_equals_the_tensor_build(seed):
    """ddtree.models.tree_build_kernel (Triton's interpreter here) == build_tree_device, all `width` nodes, exact ties
    (rounded log-probabilities), -0.0, ranks and whole levels at -inf included; twice in a row on one scratch (a
    replay's reuse)."""
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if not AVAILABLE:
        pytest.skip("needs triton (its interpreter runs the kernel on the CPU)")
    tree_kernel_module()   # the interpreter's patches
    from ddtree.models.tree_build_kernel import TreeBuildScratch, build_tree_kernel, tree_inputs_kernel
    from ddtree.tree.device import candidate_grid

    gen = torch.Generator().manual_seed(seed)
    depth, width = int(torch.randint(1, 16, (), generator=gen)), int(torch.randint(1, 70, (), generator=gen))
    k = 1 if seed % 4 == 0 else int(torch.randint(1, width + 1, (), generator=gen))
    grid = candidate_grid(width, k)
    scratch = TreeBuildScratch(depth, width, grid[0].shape[0], torch.device("cpu"))
    for trial in range(2):
        log_probs = torch.log_softmax(3 * torch.randn(depth, max(k, 2), generator=gen), dim=-1)[:, :k]
        log_probs = log_probs.sort(dim=-1, descending=True).values
        if seed % 3 == 1:      # exact ties within and across depths
            log_probs = (log_probs * 2).round() / 2
        if seed % 5 == 2:      # ranks past a budget at -inf, and -0.0
            log_probs[:, k // 2 + 1 :] = float("-inf")
            log_probs[0, 0] = -0.0
        if seed % 4 == 3:      # a whole level at -inf (the tree program's NaN draft levels)
            log_probs[int(torch.randint(0, depth, (), generator=gen))] = float("-inf")
        token_ids = torch.randint(0, 1000, (depth, k), generator=gen)
        want = build_tree_device(log_probs, token_ids, width, grid)
        got = build_tree_kernel(log_probs.contiguous(), token_ids, width, grid, scratch)
        for name, w, g in zip(("tokens", "parents", "depths"), want, got):
            assert g.tolist() == w.tolist(), (name, trial)
        # the verify's inputs and paths form from it (tree_inputs_kernel == verify_rows, tree_paths_device), for a
        # tree of the first n nodes (the rest padding), with and without the paths
        n = int(torch.randint(1, width + 1, (), generator=gen))
        inputs = torch.tensor([7, 30, n + 1])
        head = verify_rows(inputs[0], inputs[1], inputs[2], *want)
        num_paths = width + 1 if trial else 0
        got_head, got_paths = tree_inputs_kernel(inputs, scratch, num_paths, PATHS_MAX_LEN)
        assert got_head.tolist() == head.tolist(), trial
        if num_paths and int(want[2][:n].max()) < PATHS_MAX_LEN:
            assert got_paths.tolist() == tree_paths_device(head[2], n + 1, PATHS_MAX_LEN, num_paths).tolist()
        else:
            assert got_paths is None or int(want[2][:n].max()) >= PATHS_MAX_LEN


@pytest.mark.parametrize("seed", range(12))
def test_a_draft_with_nan_levels_still_builds_a_tree(seed):
    """A draft whose logits hold NaN at some levels (a drafter overflowing in bf16; a draft overwritten in memory)
    builds a well-formed tree all the same: each node's parent a row before it, one level up (the device builders
    order nodes by score, and a NaN score sorted first put nodes three levels down under the root, whose verify then
    committed a wrong token). Those levels' log-probabilities count as -inf: the tree is the one built from them."""
    from ddtree.models.graphs import GraphPool, StaticTreeBuild

    gen = torch.Generator().manual_seed(seed)
    levels, size, vocab, rows = 8, 8, 40, [16, 64][seed % 2]
    depth, budget, k = levels, rows - 1, 1 if seed % 3 == 0 else min(rows - 1, vocab)
    weight = 3 * torch.randn(vocab, size, generator=gen)
    hidden = torch.randn(levels, size, generator=gen)
    logits = hidden @ weight.T
    nan_levels = torch.randperm(levels, generator=gen)[: 1 + seed % 3]
    logits[nan_levels, :: 1 + seed % 4] = float("nan")
    program = StaticTreeBuild(GraphPool(torch.device("cpu"), capture=False), token_ids=lambda positions: positions)
    out, _ = program(hidden, lambda h: logits, k, budget, depth, 7, 30, rows, 0)
    n = fits_budget(depth, k, budget) + 1
    positions, parents = out[1, :n].tolist(), out[2, :n].tolist()
    assert parents[0] == -1 and positions[0] == 30
    for row in range(1, n):
        assert 0 <= parents[row] < row and positions[row] == positions[parents[row]] + 1, (row, parents, positions)
    log_probs = torch.log_softmax(logits, dim=-1)
    want = StaticTreeBuild(GraphPool(torch.device("cpu"), capture=False), token_ids=lambda positions: positions)(
        hidden, lambda h: log_probs.nan_to_num(nan=float("-inf")), k, budget, depth, 7, 30, rows, 0)[0]
    assert out[:, :n].tolist() == want[:, :n].tolist()


@pytest.mark.parametrize("device_tree", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_drafts_with_nan_levels_decode_the_targets_greedy_tokens(family, device_tree, tiny_models, hybrid, monkeypatch):
    """Trees from drafts whose logits are NaN at their third and fourth levels (the oracle's otherwise: its trees
    accepted deep) decode the target's greedy tokens in a chain and a tree of 64, built on the device (the tree program)
    or on the host (build_tree, which adds a node only under one already in the tree)."""
    plain, engine = engines(family, tiny_models, hybrid, device_tree=device_tree)
    assert (engine.static_tree is not None) == device_tree
    draft_logits = engine.draft_logits

    def broken(hidden, requests):
        logits = draft_logits(hidden, requests).clone()
        logits[:, 2:4] = float("nan")
        return logits

    monkeypatch.setattr(engine, "draft_logits", broken)
    prompt = list(range(3, 40))
    expected = plain.generate_ids(prompt, greedy("ar", 1)).output_ids
    for mode, budget in [("dflash", 1), ("ddtree", 64)]:
        request = engine.generate_ids(prompt, greedy(mode, budget))
        assert request.output_ids == expected, f"{family} {mode}-{budget}"
        assert max(request.acceptance_lengths) > 1


@pytest.mark.parametrize("seed", range(40))
def test_device_paths_equal_the_host_paths(seed):
    (log_probs, token_ids), _, budget = random_case(seed)
    tree = build_tree(log_probs, token_ids, budget)
    rows = tree.num_nodes + 1 + seed % 3
    expected = tree_paths(tree.parents, PATHS_MAX_LEN, rows, rows * PATHS_MAX_LEN, num_nodes=rows)
    parents = torch.tensor(tree.parents + [-1] * (rows - tree.num_nodes - 1))
    got = tree_paths_device(parents, tree.num_nodes + 1, PATHS_MAX_LEN, rows)
    assert got.tolist() == np.concatenate(expected).tolist()


def greedy(mode: str, budget: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, mode=mode, tree_budget=budget, ignore_eos=True)


@pytest.mark.parametrize("seed", range(24))
def test_the_tree_program_builds_the_host_tree_from_the_drafters_outputs(seed):
    """StaticTreeBuild takes the drafter's hidden states and runs the draft's head, log-softmax and top-k itself (one
    program between the drafter and the verify): its tree is build_tree's over the host's top k of the first `depth`
    levels, the ids mapped by the draft vocabulary, whatever the row bucket (a vocabulary narrower than it: tiny models)."""
    from ddtree.models.graphs import GraphPool, StaticTreeBuild

    gen = torch.Generator().manual_seed(seed)
    levels, size = 15, 8
    vocab = int(torch.randint(2, 90, (), generator=gen))
    rows = [16, 32, 64, 128][seed % 4]
    depth = int(torch.randint(1, levels + 1, (), generator=gen))
    budget = int(torch.randint(1, rows, (), generator=gen))
    k = 1 if seed % 5 == 0 else min(budget, vocab)
    weight = 3 * torch.randn(vocab, size, generator=gen)
    hidden = torch.randn(levels, size, generator=gen)
    program = StaticTreeBuild(GraphPool(torch.device("cpu"), capture=False), token_ids=lambda positions: positions * 3 + 1)
    out, paths = program(hidden, lambda h: h @ weight.T, k, budget, depth, 7, 30, rows, 0)
    log_probs, positions = top_log_probs(hidden[:depth] @ weight.T, k)
    tree = build_tree(log_probs, positions * 3 + 1, budget)
    n, pad = tree.num_nodes, rows - 1 - tree.num_nodes
    assert paths is None and n == fits_budget(depth, k, budget)
    assert out[0].tolist() == [7] + tree.tokens[1:] + [0] * pad
    assert out[1].tolist() == [30 + d for d in tree.depths] + [30] * pad
    assert out[2].tolist() == tree.parents + [-1] * pad


def engines(family: str, tiny_models, hybrid, **settings):
    """(target-only engine, engine with device trees) on the tiny dense target ("qwen3") or the tiny hybrid."""
    if family == "hybrid":
        root, reference = hybrid
        target, drafter = root / "target", root / "dflash"
    else:
        from transformers import AutoModelForCausalLM

        target, drafter = tiny_models / "qwen3-target", tiny_models / "qwen3-dflash"
        reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    base = dict(target_path=str(target), drafter_path=str(drafter), max_model_len=200, max_tree_budget=64, **settings)
    plain = OracleDraftEngine(EngineConfig(**base, static_forward="off"), reference=reference)
    return plain, OracleDraftEngine(EngineConfig(**{"device_tree": True, **base}, static_forward="on"), reference=reference)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_rounds_on_the_device_decode_the_targets_greedy_tokens(family, tiny_models, hybrid):
    plain, engine = engines(family, tiny_models, hybrid)
    assert engine.static_tree is not None
    for prompt in ([5, 9, 17, 33, 2, 71], list(range(3, 40))):
        expected = plain.generate_ids(prompt, greedy("ar", 1)).output_ids
        for mode, budget in [("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64), ("auto", 16)]:
            before = engine.stage_times.device_trees
            request = engine.generate_ids(prompt, greedy(mode, budget))
            assert request.output_ids == expected, f"{family} {mode}-{budget}"
            if mode != "auto":   # auto may run `ar` throughout
                assert engine.stage_times.device_trees > before, f"{mode}-{budget} never built on the device"
                assert max(request.acceptance_lengths) > 2, "the oracle drafter's trees were never accepted"


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_rounds_with_the_one_program_build_decode_the_targets_greedy_tokens(family, tiny_models, hybrid, monkeypatch):
    """The engine's tree programs run by tree_build_kernel's two launches (Triton's interpreter here; on CUDA by
    default) decode the target's greedy tokens, every tree built on the device; the hybrid's
    verify in the paths form on our kernel, so the programs make the paths too."""
    from ddtree.models import kernels, qwen3_5
    from ddtree.models.gdn import reference_recurrent
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if not AVAILABLE:
        pytest.skip("needs triton (its interpreter runs the kernel on the CPU)")
    tree_kernel_module()
    from ddtree.models.tree_build_kernel import tree_program

    calls = []
    monkeypatch.setattr(kernels, "tree_build_kernel", lambda device: lambda *a: calls.append(a[6]) or tree_program(*a))
    if family == "hybrid":
        monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
        monkeypatch.setattr(qwen3_5, "tree_gdn_kernel", lambda device: tree_kernel_module().batched_tree_paths)
    plain, engine = engines(family, tiny_models, hybrid)
    prompt = [5, 9, 17, 33, 2, 71]
    expected = plain.generate_ids(prompt, greedy("ar", 1, max_tokens=12)).output_ids
    for mode, budget in [("dflash", 1), ("ddtree", 16)]:
        before = engine.stage_times.device_trees
        assert engine.generate_ids(prompt, greedy(mode, budget, max_tokens=12)).output_ids == expected, f"{mode}-{budget}"
        assert engine.stage_times.device_trees > before
    assert calls and (all(calls) if family == "hybrid" else not any(calls))   # num_paths: the paths form's programs


@pytest.mark.parametrize("kernel", ["ours", "fla"])
def test_rounds_on_the_device_in_the_paths_form(kernel, hybrid, monkeypatch):
    """Where a hybrid's verify takes the paths form: on our kernel (here under Triton's interpreter; padding paths
    cost nothing, a program per row bucket) it reads the paths built on the device; on fla's (a program per leaf
    count) those rounds build their trees on the host. Greedy tokens are the target's either way."""
    from ddtree.models import qwen3_5
    from ddtree.models.gdn import reference_recurrent
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if kernel == "ours" and not AVAILABLE:
        pytest.skip("triton is not installed")
    plain, engine = engines("hybrid", None, hybrid)
    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    if kernel == "ours":
        monkeypatch.setattr(qwen3_5, "tree_gdn_kernel", lambda device: tree_kernel_module().batched_tree_paths)
    prompt = list(range(3, 40))
    expected = plain.generate_ids(prompt, greedy("ar", 1, max_tokens=24)).output_ids
    for mode, budget in [("dflash", 1), ("ddtree", 4), ("ddtree", 16)]:
        assert engine.generate_ids(prompt, greedy(mode, budget, max_tokens=24)).output_ids == expected, f"{mode}-{budget}"
    paths = [key[-1] for key in engine.graphs.programs if key[0] == "tree"]
    if kernel == "ours":
        assert paths and all(paths), engine.graphs.programs.keys()   # every device build made the paths too
    else:
        assert engine.stage_times.device_trees == 0 and not paths


def test_device_tree_is_on_by_default_only_for_cuda_graphs(tiny_models):
    """device_tree None ("auto" in config.pbtxt): the tree program where static forwards are CUDA graphs on CUDA;
    on the CPU (static forwards run eagerly) the host build unless asked for."""
    from ddtree.engine import Engine

    base = dict(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                max_model_len=64, static_forward="on")
    for raw, value in (("auto", None), ("on", True), ("0", False)):
        assert EngineConfig.from_dict({**base, "device_tree": raw}).device_tree is value
    with pytest.raises(ValueError, match="not a boolean"):
        EngineConfig.from_dict({**base, "device_tree": "sometimes"})
    assert EngineConfig(**base).device_tree is None and Engine(EngineConfig(**base)).static_tree is None
    assert Engine(EngineConfig(**base, device_tree=True)).static_tree is not None


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_drafts_launched_ahead_decode_the_targets_greedy_tokens(family, tiny_models, hybrid):
    """config.draft_ahead: a lone request's next draft launched before its round's commit (Engine._launch_draft_ahead)
    decodes the target's greedy tokens in every drafting mode, and the rounds take the drafts launched for them."""
    plain, engine = engines(family, tiny_models, hybrid, draft_ahead=True)
    assert engine.draft_ahead and not plain.draft_ahead
    for prompt in ([5, 9, 17, 33, 2, 71], list(range(3, 40))):
        expected = plain.generate_ids(prompt, greedy("ar", 1)).output_ids
        for mode, budget in [("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]:
            ahead, undone = engine.stage_times.drafts_ahead, engine.stage_times.drafts_ahead_undone
            request = engine.generate_ids(prompt, greedy(mode, budget))
            assert request.output_ids == expected, f"{family} {mode}-{budget}"
            assert max(request.acceptance_lengths) > 2, "the oracle drafter's trees were never accepted"
            taken = engine.stage_times.drafts_ahead - ahead
            # every round after the first drafts ahead of it, but the last (the request ends there)
            assert taken >= len(request.acceptance_lengths) - 2 > 0, (taken, request.acceptance_lengths)
            assert engine.stage_times.drafts_ahead_undone == undone


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_draft_ahead_outlives_the_commit_replayed_before_its_round(family, tiny_models, hybrid, monkeypatch):
    """A static program's outputs are valid only until the next replay of any program (GraphPool: one memory pool),
    and a draft launched ahead is read by the next round's tree program after this round's commit has replayed (on
    the H100 at 0d7f4dc a hybrid's commit overwrote it with DDTREE_DRAFT_TOP_KERNEL=1 and DDTREE_NORM_PARTS=1, and a
    ddtree-64 round decoded token 0 where the target's is 77: perf/results/draft_ahead_switches_h100_0d7f4dc.log).
    Likewise the verify's stash (a hybrid's GDN inputs of every row, what its commit replays from) must not wait for
    its commit behind the drafter's replay. Here every draft's output is overwritten with NaN once the commit after it
    is queued, and every pending stash as a draft starts, as such replays would; the tree programs still read finite
    drafts, and the tokens are the target's."""
    plain, engine = engines(family, tiny_models, hybrid, draft_ahead=True)
    drafts, read = [], []
    draft_hidden, commit, tree = engine._draft_hidden, engine._commit_caches, engine.static_tree

    def drafted(seqs):
        for cache in engine.caches:
            stash = getattr(cache, "pending", None)
            for name in ("qkv", "g", "beta", "x", "k", "v_new", "log_decay"):
                value = getattr(stash, name, None)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.fill_(float("nan"))
        drafts.append(draft_hidden(seqs))
        return drafts[-1]

    def committed(*args):
        commit(*args)
        while drafts:
            drafts.pop().fill_(float("nan"))

    def built(hidden, *args):
        read.append(bool(hidden.isfinite().all()))
        return tree(hidden, *args)

    monkeypatch.setattr(engine, "_draft_hidden", drafted)
    monkeypatch.setattr(engine, "_commit_caches", committed)
    monkeypatch.setattr(engine, "static_tree", built)
    prompt = list(range(3, 40))
    expected = plain.generate_ids(prompt, greedy("ar", 1)).output_ids
    for mode, budget in [("dflash", 1), ("ddtree", 64)]:
        ahead = engine.stage_times.drafts_ahead
        assert engine.generate_ids(prompt, greedy(mode, budget)).output_ids == expected, f"{family} {mode}-{budget}"
        assert engine.stage_times.drafts_ahead > ahead
    assert read and all(read), read


@pytest.mark.parametrize("device_tree", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_the_verifys_features_outlive_the_commit_replayed_after_it(family, device_tree, tiny_models, hybrid, monkeypatch):
    """Without a draft ahead too, the verify's taps (the target features the drafter's next context takes) are a
    static program's output, valid only until the next replay of any program (GraphPool), and the round's commit may
    replay one: they are kept before it. Here every verify's taps are overwritten with NaN once the commit has been
    queued, as such a replay would; the drafter still reads finite features, alone and batched, and the tokens are the
    target's (with the commit first, as until the 26th session, the drafts read NaN)."""
    from ddtree.request import Request

    plain, engine = engines(family, tiny_models, hybrid, draft_ahead=False, device_tree=device_tree, max_num_seqs=2)
    taps, finite = [], []
    verify, on_device, commit, draft_hidden = (engine._verify, engine._round_on_device, engine._commit_caches,
                                                engine._draft_hidden)

    def verified(*args, **kwargs):
        result = verify(*args, **kwargs)
        taps.append(result[1])
        return result

    def verified_on_device(*args, **kwargs):
        result = on_device(*args, **kwargs)
        taps.append(result[1][1])
        return result

    def committed(*args):
        commit(*args)
        while taps:
            out = taps.pop()
            if out is not None:
                out.fill_(float("nan"))

    def drafted(seqs):
        finite.extend(bool(t[lo:hi].isfinite().all()) for s in seqs for t, lo, hi in s.pending_taps)
        return draft_hidden(seqs)

    monkeypatch.setattr(engine, "_verify", verified)
    monkeypatch.setattr(engine, "_round_on_device", verified_on_device)
    monkeypatch.setattr(engine, "_commit_caches", committed)
    monkeypatch.setattr(engine, "_draft_hidden", drafted)
    prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    expected = [plain.generate_ids(p, greedy("ar", 1)).output_ids for p in prompts]
    for mode, budget in [("dflash", 1), ("ddtree", 16)]:
        assert engine.generate_ids(prompts[1], greedy(mode, budget)).output_ids == expected[1], f"{family} {mode}-{budget}"
    requests = [Request(request_id=str(i), prompt_ids=p, params=greedy("ddtree", 16)) for i, p in enumerate(prompts)]
    serve_together(engine, requests)
    assert [r.output_ids for r in requests] == expected
    assert finite and all(finite), finite


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_draft_ahead_is_undone_when_the_batch_changes_or_its_request_goes(family, tiny_models, hybrid):
    """A draft launched ahead for a lone request that the next round does not take is undone (a second request joins
    the batch: the drafter's context and the request's pending features as they were, its next draft writes them
    again) or dropped with its request (aborted: its slot's next request starts afresh); every request still decodes
    the target's greedy tokens."""
    from ddtree.request import Request

    plain, engine = engines(family, tiny_models, hybrid, draft_ahead=True, max_num_seqs=2)
    prompts = {"a": [5, 9, 17, 33, 2, 71], "b": list(range(3, 40)), "c": [11, 4, 8, 60, 2]}
    expected = {k: plain.generate_ids(p, greedy("ar", 1)).output_ids for k, p in prompts.items()}
    a = Request(request_id="a", prompt_ids=prompts["a"], params=greedy("ddtree", 16))
    b = Request(request_id="b", prompt_ids=prompts["b"], params=greedy("dflash", 1))
    engine.add(a)
    for _ in range(4):   # a decodes alone, its drafts ahead taken
        engine.step()
    serve_together(engine, [b])
    assert a.output_ids == expected["a"] and b.output_ids == expected["b"]
    assert engine.stage_times.drafts_ahead_undone >= 1, "the joined batch never undid a draft ahead"
    undone = engine.stage_times.drafts_ahead_undone
    gone = Request(request_id="gone", prompt_ids=prompts["b"], params=greedy("ddtree", 16))
    engine.add(gone)
    for _ in range(4):
        engine.step()
    assert engine._draft_ahead is not None and engine._draft_ahead.seq.request is gone
    assert engine.abort("gone")
    c = Request(request_id="c", prompt_ids=prompts["c"], params=greedy("ddtree", 16))
    serve_together(engine, [c])
    assert c.output_ids == expected["c"]
    assert engine.stage_times.drafts_ahead_undone == undone + 1 and engine._draft_ahead is None


def test_draft_ahead_is_off_by_default(tiny_models):
    from ddtree.engine import Engine

    base = dict(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                max_model_len=64, static_forward="on", device_tree=True)
    assert EngineConfig.from_dict({**base, "draft_ahead": "on"}).draft_ahead is True
    assert not Engine(EngineConfig(**base)).draft_ahead
    assert Engine(EngineConfig(**base, draft_ahead=True)).draft_ahead
    assert not Engine(EngineConfig(**{**base, "device_tree": False}, draft_ahead=True)).draft_ahead   # needs the device tree


@pytest.mark.parametrize("levels, vocab, top", [(2, 9000, 16), (1, 5000, 64), (2, 300, 5), (1, 70, 64), (2, 4096, 16),
                                                 (2, 5000, 1)])
def test_the_draft_top_k_kernel_equals_log_softmax_then_topk(levels, vocab, top):
    """tree_build_kernel.draft_top_k (Triton's interpreter here) == torch.topk(log_softmax(logits)): distinct logits,
    a vocabulary across several chunks, one not a multiple of the chunk, smaller than one, top = vocab and top = 1
    (a dflash chain's last levels; tl.topk takes no k of 1); with ties
    (logits on a grid of 0.25), the same values, each at a position holding it, ties in ascending positions."""
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if not AVAILABLE:
        pytest.skip("needs triton (its interpreter runs the kernel on the CPU)")
    tree_kernel_module()
    from ddtree.models.tree_build_kernel import draft_top_k

    gen = torch.Generator().manual_seed(vocab + top)
    top = min(top, vocab)
    logits = 3 * torch.randn(levels, vocab, generator=gen)
    log_probs, positions = draft_top_k(logits, top)
    want, want_positions = torch.topk(torch.log_softmax(logits, dim=-1, dtype=torch.float32), top)
    assert torch.equal(positions, want_positions)
    torch.testing.assert_close(log_probs, want, rtol=0, atol=2e-6)
    tied = (logits * 4).round() / 4
    assert_draft_top_k(tied, *draft_top_k(tied, top), atol=2e-6)


def assert_draft_top_k(logits: torch.Tensor, log_probs: torch.Tensor, positions: torch.Tensor, atol: float) -> None:
    """draft_top_k's outputs for logits whatever their ties: log_softmax then topk's values (to atol), each at a
    position holding its logit, ties in ascending positions."""
    top = positions.shape[1]
    want = torch.topk(torch.log_softmax(logits, dim=-1, dtype=torch.float32), top).values
    torch.testing.assert_close(log_probs, want, rtol=0, atol=atol)
    for level in range(logits.shape[0]):
        picked = logits[level, positions[level]]
        assert torch.equal(picked, logits[level].sort(descending=True).values[:top]), level
        for value in picked.unique():
            at = positions[level][picked == value]
            assert torch.equal(at, at.sort().values), level


def test_tree_programs_with_the_draft_top_k_kernel_decode_the_targets_greedy_tokens(tiny_models, hybrid, monkeypatch):
    """DDTREE_DRAFT_TOP_KERNEL's draft_top_k (Triton's interpreter here; kernels.draft_top_kernel) in the engine's
    tree programs: called on each draft's logits with the tree's top, it returns what log_softmax then torch.topk do,
    and the rounds decode the target's greedy tokens."""
    from ddtree.models import kernels
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if not AVAILABLE:
        pytest.skip("needs triton (its interpreter runs the kernel on the CPU)")
    tree_kernel_module()
    from ddtree.models.tree_build_kernel import draft_top_k

    calls = []

    def checked(logits, top):
        got = draft_top_k(logits, top)
        want = torch.topk(torch.log_softmax(logits, dim=-1, dtype=torch.float32), top)
        assert torch.equal(got[1], want.indices)
        torch.testing.assert_close(got[0], want.values, rtol=0, atol=2e-6)
        calls.append(top)
        return got

    monkeypatch.setattr(kernels, "draft_top_kernel", lambda device: checked)
    plain, engine = engines("qwen3", tiny_models, hybrid)
    prompt = [5, 9, 17, 33, 2, 71]
    expected = plain.generate_ids(prompt, greedy("ar", 1, max_tokens=12)).output_ids
    for mode, budget in [("dflash", 1), ("ddtree", 16)]:
        assert engine.generate_ids(prompt, greedy(mode, budget, max_tokens=12)).output_ids == expected, f"{mode}-{budget}"
    assert calls and max(calls) >= 16
