"""Static forwards (ddtree.models.graphs), run eagerly on the CPU: the code a CUDA graph captures.

They pad rows and keys to buckets and derive the tree structure on the device from static buffers, so
they must give the dynamic forward's logits, taps and committed state for the real rows, and the engine
with them must still decode exactly the target's greedy tokens (fp32). tests/gpu captures them as graphs.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.models.dense import DenseTarget
from ddtree.models.gdn import _root_path, ancestors_from_parents, conv_window_index
from ddtree.models.graphs import GraphPool, StaticTarget, key_bucket, row_bucket
from ddtree.models.qwen3_5 import HybridTarget
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, compile_tree, top_log_probs
from ddtree.tree.compile import ancestor_matrix
from tests.triton_interpreter import AVAILABLE, tree_kernel_module
from tests.unit.oracle import OracleDraftEngine, make_tiny_hybrid, serve_together


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid_static"))


def test_buckets():
    for n in range(1, 1100):
        rows = row_bucket(n)
        assert rows >= n and (rows - 1 == 0 or (rows & (rows - 1)) == 0 or ((rows - 1) & (rows - 2)) == 0), (n, rows)
        assert rows <= 2 * n, (n, rows)       # never more than twice the work
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 6, 17, 18, 65)] == [1, 2, 3, 4, 5, 8, 17, 32, 65]
    assert key_bucket(10, 4096) == 256 and key_bucket(257, 4096) == 512 and key_bucket(3000, 3100) == 3100
    assert key_bucket(300, 299) is None


def random_tree(vocab: int, budget: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    log_probs, token_ids = top_log_probs(torch.randn(7, vocab, generator=gen), min(budget, vocab))
    return build_tree(log_probs, token_ids, budget)


@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_device_tree_structure_matches_host(budget):
    tree = random_tree(64, budget, budget)
    parents = torch.tensor(tree.parents)
    assert torch.equal(ancestors_from_parents(parents), ancestor_matrix(tree.parents, tree.depths))
    # padding rows (parent -1) are roots of their own
    padded = torch.cat([parents, torch.full((3,), -1)])
    anc = ancestors_from_parents(padded)
    assert torch.equal(anc[-3:], torch.eye(len(padded), dtype=torch.bool)[-3:])
    window = conv_window_index(padded, 4)
    assert window.shape == (len(padded), 4) and window[:, -1].tolist() == [4 + i for i in range(len(padded))]


@torch.inference_mode()
def check_static_equals_dynamic(model, cache_a, cache_b, vocab: int, taps: list[int], prompt: int = 21,
                                tolerance: float = 1e-5) -> StaticTarget:
    """Prefill both caches alike, then verify several trees: the static forward on cache_a (captured as CUDA graphs
    on CUDA), the dynamic one on cache_b; logits and taps agree, and so does every later forward after committing
    a path. Shapes recur, so a captured graph is replayed on new inputs."""
    device = next(model.parameters()).device
    static = StaticTarget(model, taps, GraphPool(device, capture=True))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (prompt,), generator=gen)
    causal = torch.ones(prompt, prompt, dtype=torch.bool, device=device).tril()
    for cache in (cache_a, cache_b):
        model(ids.to(device), torch.arange(prompt, device=device), cache, 0, causal, tap_layers=taps)
        cache.compact(0, list(range(prompt)))
    start = prompt
    for round_, budget in enumerate([1, 4, 12, 30, 0, 4, 12, 1]):
        tree = random_tree(vocab, budget, round_) if budget else random_tree(vocab, 1, 0).truncated(0)
        batch = compile_tree(tree, root_token=int(ids[round_]), start=start)
        got = static(cache_a, start, batch.input_ids, batch.positions, tree.parents)
        assert got is not None
        expected = model(batch.input_ids.to(device), batch.positions.to(device), cache_b, start,
                         batch.visibility.to(device), tap_layers=taps)
        torch.testing.assert_close(got[0], expected[0], rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got[1], expected[1], rtol=tolerance, atol=tolerance)
        path = _root_path(tree.parents, max(range(tree.num_nodes + 1), key=lambda i: tree.depths[i]))
        cache_a.compact(start, path)
        cache_b.compact(start, path)
        start += len(path)
    assert len(static.graphs.programs) == 5          # one program per shape (rows 2, 5, 16, 32, 1), each used again
    return static


def through_the_qkv_kernel(monkeypatch) -> list[int]:
    """Packed forwards' q/k norms, rotary and K/V writes through our kernel (attention_kernel.prepare_qkv, Triton's
    interpreter here; the default on CUDA): the rows of each call. A static forward's one request has its slot
    broadcast over its rows (a stride-0 view), which the kernel once read as contiguous."""
    from ddtree.models import dense
    from tests.triton_interpreter import attention_kernel_module

    kernel, calls = attention_kernel_module().prepare_qkv, []
    monkeypatch.setattr(dense, "qkv_kernel", lambda device: lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    return calls


QKV_KERNEL = [False, pytest.param(True, marks=pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter)"))]


@pytest.mark.parametrize("qkv_kernel", QKV_KERNEL)
def test_static_hybrid_equals_dynamic(hybrid, qkv_kernel, monkeypatch):
    calls = through_the_qkv_kernel(monkeypatch) if qkv_kernel else None
    root, _ = hybrid
    model = HybridTarget.from_pretrained(root / "target")
    check_static_equals_dynamic(model, model.new_cache(400), model.new_cache(400), model.config.vocab_size, [1, 2])
    assert calls is None or max(calls, default=0) > 1, calls   # every static forward of several rows went through it


@pytest.mark.parametrize("family", ["qwen3", "llama"])   # llama: no q/k norms (SmolLM2), rotary only in the kernel
@pytest.mark.parametrize("qkv_kernel", QKV_KERNEL)
def test_static_dense_equals_dynamic(tiny_models, qkv_kernel, family, monkeypatch):
    calls = through_the_qkv_kernel(monkeypatch) if qkv_kernel else None
    if family == "llama":
        monkeypatch.setenv("DDTREE_QKV_KERNEL", "all")   # heads without norms take it only with "all"
    model = DenseTarget.from_pretrained(tiny_models / f"{family}-target")
    a, b = model.new_caches(2, 400)      # two slots of one pool: the static forward writes only its own
    check_static_equals_dynamic(model, a, b, model.config.vocab_size, [0, 1])
    assert calls is None or max(calls, default=0) > 1, calls


def test_static_forward_declines_when_the_cache_is_too_short(tiny_models):
    model = DenseTarget.from_pretrained(tiny_models / "qwen3-target")
    static = StaticTarget(model, [], GraphPool(torch.device("cpu"), capture=False))
    cache = model.new_cache(40)
    assert static(cache, 30, [1] * 17, list(range(30, 47)), [-1] + [0] * 16) is None   # 30 + 17 > 40
    # from position 0 (no prefix): a dense target's prefill (EngineConfig.static_prefill: tests/unit/test_static_prefill.py)
    assert static(cache, 0, [1], [0], [-1]) is not None


def family_engine(family: str, tiny_models, hybrid, **settings):
    """An engine on the tiny dense target ("qwen3") or the tiny hybrid (its oracle drafter) with these settings."""
    from ddtree.engine import Engine

    if family == "hybrid":
        root, reference = hybrid
        return OracleDraftEngine(EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"),
                                              **settings), reference=reference)
    return Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                               **settings))


def greedy(mode: str, budget: int, max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, mode=mode, tree_budget=budget, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_engine_with_static_forward_decodes_the_targets_greedy_tokens(family, tiny_models, hybrid):
    if family == "hybrid":
        root, reference = hybrid
        target, drafter = root / "target", root / "dflash"
        prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    else:
        from transformers import AutoModelForCausalLM

        target, drafter = tiny_models / "qwen3-target", tiny_models / "qwen3-dflash"
        reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    base = dict(target_path=str(target), drafter_path=str(drafter), max_model_len=160, max_tree_budget=64)
    dynamic = OracleDraftEngine(EngineConfig(**base, static_forward="off"), reference=reference)
    static = OracleDraftEngine(EngineConfig(**base, static_forward="on"), reference=reference)
    assert dynamic.static_target is None and static.static_target is not None
    static.warm_up()   # what serving does at load: leaves programs, no counts, no held slot, no effect on outputs
    assert static.graphs.programs and static.stage_times.batch_rounds == 0 and not static.has_work
    assert static.free_slots == list(range(static.config.max_num_seqs))
    for ids in prompts:
        expected = dynamic.generate_ids(ids, greedy("ar", 1)).output_ids
        for mode, budget in [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]:
            request = static.generate_ids(ids, greedy(mode, budget))
            assert request.output_ids == expected, f"{family} {mode}-{budget}"
    assert static.graphs.programs, "the static forward never ran"


def test_static_drafter_equals_dynamic(tmp_path):
    """Context rows padded to a bucket and keys to a power of two, sliding windows that cut: the static drafter
    pass gives the dynamic pass's hidden states round after round, and leaves the same context length."""
    from ddtree.models.dflash import DFlashDrafter
    from ddtree.models.graphs import StaticDrafter
    from tests.unit.test_dflash_drafter import BLOCK, HIDDEN, write_published_checkpoint

    taps = [1, 16, 31, 46, 61]
    write_published_checkpoint(tmp_path / "d", taps, seed=4, num_target_layers=64, sliding_window=6,
                               layer_types=["sliding_attention"] * 4 + ["full_attention"])
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d")
    embed = torch.nn.Embedding(50, HIDDEN)
    static = StaticDrafter(drafter, embed, GraphPool(torch.device("cpu"), capture=False))
    gen = torch.Generator().manual_seed(6)
    ours, theirs = drafter.new_caches(2, 300)
    with torch.no_grad():
        for m in (13, 1, 3, 7, 2, 6):
            features = torch.randn(m, HIDDEN * len(taps), generator=gen)
            ids = torch.randint(0, 50, (BLOCK,), generator=gen).tolist()
            got = static(ours, features, ids)
            start = theirs.length + m
            drafter.add_context(theirs, features)
            expected = drafter(theirs, embed(torch.tensor(ids)), start)
            assert ours.length == theirs.length == start
            torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    assert static(ours, None, ids) is None


def test_paths_form_decodes_the_targets_greedy_tokens(hybrid, monkeypatch):
    """With a fused chain kernel (on CUDA: fla; here its interface in plain torch) trees go through the paths form
    and commits replay the accepted path: greedy tokens equal those of the ancestor-masked form, with the dynamic
    and with the static forward."""
    from ddtree.models import qwen3_5
    from ddtree.models.gdn import reference_recurrent

    root, reference = hybrid
    base = dict(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=160,
                max_tree_budget=64)
    prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    plain = OracleDraftEngine(EngineConfig(**base, static_forward="off"), reference=reference)
    expected = [plain.generate_ids(ids, greedy("ar", 1)).output_ids for ids in prompts]
    replays, replay = [], qwen3_5.replay_path
    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    monkeypatch.setattr(qwen3_5, "replay_path", lambda *args: replays.append(args[1]) or replay(*args))
    for static in ("off", "on"):
        engine = OracleDraftEngine(EngineConfig(**base, static_forward=static), reference=reference)
        for ids, tokens in zip(prompts, expected):
            for mode, budget in [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]:
                assert engine.generate_ids(ids, greedy(mode, budget)).output_ids == tokens, f"{static} {mode}-{budget}"
    assert len(replays) > 50 and max(len(path) for path in replays) > 2   # trees were verified and committed so
    assert any(key[0] == "commit" for key in engine.graphs.programs)      # with the static forward: by a static commit
    # static programs per (rows, keys, number of paths): padded rows take no path, path counts go to buckets
    shapes = [key[2:5] for key in engine.graphs.programs if key[0] == "target"]   # ("target", requests, rows, keys, paths, ...)
    assert any(paths and paths < rows for rows, _, paths in shapes), shapes
    assert len({(rows, paths) for rows, _, paths in shapes}) > len({rows for rows, _, _ in shapes}), shapes


@pytest.mark.parametrize("in_place", [False, True])
def test_static_commit_equals_the_dynamic_replay(hybrid, monkeypatch, in_place):
    """A lone request's commit as a static program (its path padded to a bucket: padding rows with zero decay and
    zero beta, padding K/V moves of the root's row onto itself) leaves exactly the K/V, recurrent states and conv
    windows of the dynamic commit (HybridCache.compact), at every path length and for a view of a batch's stash;
    any other pending state (and, where programs are captured, a stash not from a captured verify) is left to the
    dynamic commit. in_place: both commits' recurrence through our replay kernel (kernels.replay_kernel, Triton's
    interpreter here), its states also within float32 rounding of the chain kernel's replay."""
    from ddtree.models import qwen3_5
    from ddtree.models.gdn import ReplayStash, reference_recurrent, replay_path
    from ddtree.models.graphs import StaticCommit, path_bucket

    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    if in_place:
        if not AVAILABLE:
            pytest.skip("needs triton (its interpreter runs our kernel on the CPU)")
        monkeypatch.setattr(qwen3_5, "replay_kernel", lambda device: tree_kernel_module().replay_in_place)
    root, _ = hybrid
    target = HybridTarget.from_pretrained(root / "target")
    c, gen = target.config, torch.Generator().manual_seed(0)
    dynamic, static = target.new_caches(2, 64)[1], target.new_caches(2, 64)[1]   # slot 1 of two pools
    for t in (dynamic.kv.k, dynamic.kv.v, dynamic.state, dynamic.conv):
        t.copy_(torch.randn(t.shape, generator=gen))
    for a, b in ((dynamic.kv.k, static.kv.k), (dynamic.kv.v, static.kv.v), (dynamic.state, static.state),
                 (dynamic.conv, static.conv)):
        b.copy_(a)
    chain = dynamic.state.clone(), dynamic.conv.clone()   # the same commits through the chain kernel (in_place)
    n, start = 20, 10
    batch = ReplayStash.empty(len(dynamic.gdn_layers), n + 7, c.linear_num_value_heads, c.linear_key_head_dim,
                              c.linear_value_head_dim, c.conv_dim, torch.float32, "cpu", key_heads=c.linear_num_key_heads)
    batch.qkv.copy_(torch.randn(batch.qkv.shape, generator=gen))
    batch.g.copy_(-torch.rand(batch.g.shape, generator=gen))
    batch.beta.copy_(torch.rand(batch.beta.shape, generator=gen))
    batch.x.copy_(torch.randn(batch.x.shape, generator=gen))
    commit = StaticCommit(GraphPool(torch.device("cpu"), capture=False))
    for length, stash in [(1, batch.rows(0, n)), (2, batch.rows(3, n)), (3, batch), (5, batch.rows(7, n)), (9, batch),
                          (12, batch.rows(7, n))]:
        accepted = [0] + sorted(torch.randperm(n - 1, generator=gen)[: length - 1].add(1).tolist())
        dynamic.pending = static.pending = stash
        dynamic.compact(start, accepted)
        assert commit(static, start, accepted) and static.pending is None
        for a, b in ((dynamic.kv.k, static.kv.k), (dynamic.kv.v, static.kv.v), (dynamic.state, static.state),
                     (dynamic.conv, static.conv)):
            assert torch.equal(a, b), length
        if in_place:
            replay_path(stash, accepted, *chain, reference_recurrent)
            torch.testing.assert_close(dynamic.state, chain[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(dynamic.conv, chain[1])
        start += length
    assert not dynamic.state.equal(static.state.zero_())    # the comparison can fail
    assert sorted({key[2] for key in commit.graphs.programs}) == [path_bucket(n) for n in (1, 2, 3, 5, 9)]
    static.pending = {}
    assert not commit(static, start, [0])                  # not a paths-form stash: the dynamic commit's
    # where programs are captured (CUDA), only a captured verify's stash (fixed memory, named in the key) commits so
    capturing = StaticCommit(GraphPool(torch.device("cpu"), capture=False))
    capturing.graphs.capture = True
    static.pending, static.static_stash = batch, None
    assert not capturing(static, start, [0]) and static.pending is batch and not capturing.graphs.programs


@pytest.mark.parametrize("family", ["hybrid", "qwen3"])
def test_a_lone_request_in_another_slot_reads_its_own_cache(family, tiny_models, hybrid):
    """A lone request runs a program made for its slot, which reads that slot's K/V as views of the pool (a hybrid's
    recurrent state through its cache's views): a request left alone in slot 1, after its neighbour in slot 0
    finished, decodes what it decodes alone in slot 0 (reading slot 0's K/V fails it)."""
    from ddtree.request import Request

    engine = family_engine(family, tiny_models, hybrid, max_model_len=160, max_tree_budget=16, static_forward="on",
                           max_num_seqs=2)
    prompt, other = list(range(3, 30)), [5, 9, 17, 33, 2, 71]
    for mode, budget in [("ar", 1), ("ddtree", 8)]:
        params = SamplingParams(max_tokens=24, temperature=0.0, mode=mode, tree_budget=budget, ignore_eos=True)
        alone = engine.generate_ids(prompt, params).output_ids
        first = Request(request_id="first", prompt_ids=other, params=SamplingParams(max_tokens=2, ignore_eos=True))
        second = Request(request_id="second", prompt_ids=prompt, params=params)
        engine.add(first)
        engine.add(second)
        while engine.has_work:
            engine.step()
        assert second.output_ids == alone, f"{family} {mode}-{budget}"
    lone_slots = {key[-1] for key in engine.graphs.programs if key[0] in ("target", "batch") and key[1] == 1}
    assert lone_slots == {0, 1}, engine.graphs.programs.keys()   # the second request ran alone in slot 1


def test_warm_up_prepares_the_shapes_a_lone_request_meets(tiny_models):
    """After warm_up, requests served alone in every mode run on programs it made (none is made, i.e. captured on
    a GPU, while serving them): full dflash chains, the smaller trees of a request's last rounds, every context-row
    bucket of the drafter, at the key buckets of short and longer prompts."""
    from ddtree.engine import Engine

    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                                 max_model_len=600, max_tree_budget=64, static_forward="on"))
    engine.warm_up()
    prepared = set(engine.graphs.programs)
    assert any(key[0] == "batch" and key[2] == 16 for key in prepared)     # a whole dflash block's chain
    for prompt in (list(range(3, 40)), [7 + i % 80 for i in range(300)]):
        for mode, budget in [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]:
            engine.generate_ids(prompt, greedy(mode, budget))
    assert set(engine.graphs.programs) == prepared, set(engine.graphs.programs) - prepared
    assert engine.graphs.warmed and engine.graphs.late_keys == []



@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_warm_up_prepares_plain_decoding_at_every_batch_size(family, tiny_models, hybrid):
    """Plain decoding of several concurrent requests (what `ar`, and `auto` on `ar`, run under load) steps on
    programs the warm-up made, at every padded batch size up to max_num_seqs and at the key buckets of short and
    longer prompts, and decodes what each request decodes alone (the warm-up's writes in slots 0.. are replaced by
    the requests' own prefills); so do trees of several requests (Engine._warm_batched_verifies: the default arms'
    row buckets), which made on first use were kept as late."""
    from ddtree.request import Request

    engine = family_engine(family, tiny_models, hybrid, max_model_len=300, max_tree_budget=4, default_tree_budget=4,
                           static_forward="on", max_num_seqs=3)
    if family == "hybrid":   # its whole warm-up (every mode's trees, eagerly on the CPU) is slow: the steps' part
        for start in (20, 260):    # the key buckets of the prompts below
            engine._warm_batched_steps(start)
        engine.graphs.warmed = True
    else:
        engine.warm_up()
    assert {key[1] for key in engine.graphs.programs if key[0] in ("target", "batch")} >= {1, 2, 4}
    prompts = [[3 + (7 * i + j) % 60 for j in range(10 + 3 * i)] for i in range(2)] + [[5 + j % 70 for j in range(262)]]

    def together(mode: str, budget: int) -> list[list[int]]:
        requests = [Request(request_id=f"r{i}", prompt_ids=prompt, params=SamplingParams(
            max_tokens=3 + 2 * i, temperature=0.0, mode=mode, tree_budget=budget, ignore_eos=True))   # 3, 2, 1 left
            for i, prompt in enumerate(prompts)]
        return serve_together(engine, requests)

    outputs = together("ar", 1)
    assert engine.graphs.late_keys == [], engine.graphs.late_keys
    alone = [engine.generate_ids(prompt, SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, mode="ar", ignore_eos=True)).output_ids
             for i, prompt in enumerate(prompts)]
    assert outputs == alone
    together("ddtree", 4)
    if family == "hybrid":   # its warm-up above made the steps alone: its trees of several requests are made now
        assert any(key[1] > 1 for key in engine.graphs.late_keys), engine.graphs.late_keys   # the check can fail
    else:
        assert not any(key[1] > 1 for key in engine.graphs.late_keys), engine.graphs.late_keys

def test_graph_pool_records_the_programs_made_after_warm_up():
    """What a served request had to compile and capture itself is logged and kept (perf/serve_overhead.py reports it)."""
    from ddtree.models.graphs import Program

    pool = GraphPool(torch.device("cpu"), capture=False)
    made = []

    def make():
        made.append(1)
        return Program(body=lambda: None, host=torch.zeros(1, dtype=torch.long), inputs=torch.zeros(1, dtype=torch.long))

    pool.program(("a",), make)
    assert pool.late_keys == []            # before warm-up ends: preparing, not late
    pool.warmed = True
    pool.program(("a",), make)
    pool.program(("b",), make)
    assert pool.late_keys == [("b",)] and len(made) == 2


def test_warm_up_prepares_a_hybrids_trees_too(hybrid, monkeypatch):
    """A hybrid target on our paths kernel (here Triton's interpreter): its static programs pad the paths to the
    rows, so the trees that warm-up builds stand for every tree of their row bucket, whatever its leaves."""
    from tests.triton_interpreter import AVAILABLE, tree_kernel_module

    if not AVAILABLE:
        pytest.skip("triton is not installed")
    from ddtree.models import qwen3_5
    from ddtree.models.gdn import reference_recurrent

    root, reference = hybrid
    kernel = tree_kernel_module().batched_tree_paths
    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    monkeypatch.setattr(qwen3_5, "tree_gdn_kernel", lambda device: kernel)
    engine = OracleDraftEngine(EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"),
                                            max_model_len=200, max_tree_budget=16, static_forward="on"), reference=reference)
    engine.warm_up()
    prepared = set(engine.graphs.programs)
    for mode, budget in [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16)]:
        # 16 tokens: full trees, then the shorter ones of the last rounds (each verify runs the interpreted kernel)
        engine.generate_ids(list(range(3, 40)), greedy(mode, budget, max_tokens=16))
    assert set(engine.graphs.programs) == prepared, set(engine.graphs.programs) - prepared
