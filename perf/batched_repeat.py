"""The batched-requests scenario of tests/gpu/test_cuda_graphs.py (test_batched_graphs_decode_what_requests_decode_alone:
ten requests of mixed modes on the tiny hybrid or dense pair, arriving while others decode, static forwards captured
after warm-up) repeated over many prompt seeds under sets of engine switches: how often a batched request's greedy
tokens differ from the target's own (`ar` alone, dynamic forward). One failing run of that test cannot tell a race or
a read of memory no kernel wrote (a mismatch that comes and goes) from a wrong kernel (one that stays); a rate over
seeds and engines can, and each differing request's top-two logit gap at its first differing token (the target's,
on the device) tells a near-tie that two kernel orders break either way from a wrong computation. --nan-fill: torch's
deterministic mode fills each uninitialized allocation with NaN (a fill launched during a graph's capture is recorded
with it, so it runs at each replay), so a read of unwritten memory poisons the tokens instead of passing on whatever
the memory held.

Each switch set runs in a process of its own (graphs capture under its environment); its engine is built and warmed
up again every --rebuild seeds. The results are written after each set, and with --set-seconds a set's process is
stopped after that long and counted by the seeds it finished (exit "timeout"), so a device call cut off at its limit
keeps what ran. Writes perf/results/<name>.{json,md}.

    python perf/batched_repeat.py --device cuda --seeds 20 --sets "none;DDTREE_ROWS_GLU=0,DDTREE_TREE_GATES=0" \\
        --set-seconds 150 --name batched_repeat_h200
    python perf/batched_repeat.py --seeds 1 --sets none --name batched_repeat_cpu   # a CPU smoke run (eager)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402

MODES = [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]


def parse_set(spec: str) -> dict[str, str]:
    """"none" -> {}; "DDTREE_A=1,TRITON_B=x" -> {"DDTREE_A": "1", "TRITON_B": "x"}: engine switches, and Triton's
    (TRITON_F32_DEFAULT=ieee: float32 dots that name no precision, fla's, multiply in IEEE instead of TF32)."""
    spec = spec.strip()
    if spec in ("", "none"):
        return {}
    pairs = [item.split("=", 1) for item in spec.split(",")]
    if any(len(p) != 2 or not p[0].startswith(("DDTREE_", "TRITON_")) for p in pairs):
        raise SystemExit(f"a switch set is DDTREE_X=v[,TRITON_Y=w] or none, got {spec!r}")
    return dict(pairs)


def tiny_pair(family: str, root: Path) -> tuple[str, str]:
    """(target, drafter) paths of the tests' tiny hybrid (tests.unit.oracle) or dense pair (scripts/make_tiny_models)."""
    if family == "hybrid":
        from tests.unit.oracle import make_tiny_hybrid
        make_tiny_hybrid(root)
        return str(root / "target"), str(root / "dflash")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(root)], check=True,
                   capture_output=True)
    return str(root / "qwen3-target"), str(root / "qwen3-dflash")


def scenario_jobs(seed: int) -> list:
    """The scenario's ten (prompt ids, greedy SamplingParams): MODES twice, prompts of 3-59 random ids below 90, 24
    tokens each, drawn from `seed`."""
    import torch

    from ddtree.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 90, (int(torch.randint(3, 60, (1,), generator=gen)),), generator=gen).tolist(),
             SamplingParams(mode=mode, tree_budget=budget, max_tokens=24, ignore_eos=True)) for mode, budget in MODES * 2]


def decode_arriving(engine, requests: list) -> None:
    """The requests decoded by `engine`, one arriving before each round while the earlier ones decode."""
    pending = list(requests)
    while pending or engine.has_work:
        if pending:
            engine.add(pending.pop(0))
        engine.step()


def top_two_gap(target, ids: list[int]) -> dict:
    """The target's next-token logits after `ids` (one dynamic forward from an empty cache on its device): the gap
    between its two highest and their ids. At a request's first differing token a gap near the device's rounding
    says a near-tie that two kernel orders may break either way; a wide one says a wrong computation."""
    import torch

    device, n = target.embed_tokens.weight.device, len(ids)
    with torch.inference_mode():
        logits, _ = target(torch.tensor(ids, device=device), torch.arange(n, device=device), target.new_cache(n + 1), 0,
                           torch.ones(n, n, dtype=torch.bool, device=device).tril(),
                           logit_rows=torch.tensor([n - 1], device=device))
    top = logits[0].float().topk(2)
    return {"gap": float(top.values[0] - top.values[1]), "top": int(top.indices[0]), "second": int(top.indices[1])}


def worker(args, save) -> None:
    """One switch set (this process's environment): every seed's requests batched, each against `ar` alone; the runs
    so far saved (save(runs)) after each seed."""
    import torch

    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.request import Request
    from ddtree.sampling_params import SamplingParams

    if args.nan_fill:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = tiny_pair(args.family, Path(tmp))
        base = {"target_path": target, "drafter_path": drafter, "max_model_len": 300, "max_tree_budget": 64,
                "device": args.device}
        plain = Engine(EngineConfig(**base, static_forward="off", max_num_seqs=1))
        graphed, runs = None, []
        for seed in range(args.seeds):
            if graphed is None or seed % args.rebuild == 0:
                graphed = Engine(EngineConfig(**base, static_forward="auto", max_num_seqs=8))
                graphed.warm_up()
            jobs = scenario_jobs(seed)
            requests = [Request(request_id=f"s{seed}-r{i}", prompt_ids=p, params=params)
                        for i, (p, params) in enumerate(jobs)]
            decode_arriving(graphed, requests)
            for request, (prompt, params) in zip(requests, jobs):
                want = plain.generate_ids(prompt, SamplingParams(mode="ar", max_tokens=24, ignore_eos=True)).output_ids
                got, equal = request.output_ids, request.output_ids == want
                # where they part: the first differing token, else (one a prefix of the other) the shorter's end
                first = None if equal else next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                                                min(len(got), len(want)))
                runs.append({"seed": seed, "request": request.request_id, "mode": f"{params.mode}-{params.tree_budget}",
                             "prompt_len": len(prompt), "equal": equal, "first_difference": first})
                if first is not None:   # the target's logits there: a near-tie or a wrong computation
                    runs[-1].update(top_two_gap(plain.target, prompt + want[:first]),
                                    batched=got[first] if first < len(got) else None)
            save(runs)
            print(f"seed {seed}: {sum(not r['equal'] for r in runs if r['seed'] == seed)} of {len(jobs)} differ",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--family", choices=["hybrid", "qwen3"], default="hybrid")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--rebuild", type=int, default=5, help="a fresh engine (built, warmed up) every this many seeds")
    parser.add_argument("--sets", default="none", help='switch sets, ";"-separated: none or DDTREE_X=v[,TRITON_Y=w]')
    parser.add_argument("--nan-fill", action="store_true")
    parser.add_argument("--set-seconds", type=float, default=0.0,
                        help="stop a switch set's process after this long, keeping the seeds it finished (0: no limit)")
    parser.add_argument("--out", default=str(ROOT / "perf" / "results"))
    parser.add_argument("--name", default="batched_repeat")
    parser.add_argument("--worker", help=argparse.SUPPRESS)   # a switch set's process: write its runs here
    args = parser.parse_args()
    if args.rebuild < 1 or args.seeds < 1:
        parser.error("--seeds and --rebuild must be at least 1")
    if args.worker:
        worker(args, lambda runs: Path(args.worker).write_text(json.dumps({"runs": runs})))
        return
    results, rows = [], []
    for spec in args.sets.split(";"):
        env = parse_set(spec)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            command = [sys.executable, __file__, "--device", args.device, "--family", args.family, "--seeds",
                       str(args.seeds), "--rebuild", str(args.rebuild), "--worker", f.name] + (["--nan-fill"] * args.nan_fill)
            t0 = time.perf_counter()
            try:
                returncode = subprocess.run(command, env={**os.environ, **env}, timeout=args.set_seconds or None).returncode
            except subprocess.TimeoutExpired:   # the process killed: the seeds it finished are in its file
                returncode = "timeout"
            seconds = time.perf_counter() - t0
            written = Path(f.name).read_text()
            runs = json.loads(written)["runs"] if written and returncode in (0, "timeout") else []
        differ = [r for r in runs if not r["equal"]]
        by_mode = dict(Counter(r["mode"] for r in differ))
        gaps = [f"{r['gap']:.1e}" + ("" if r["batched"] == r["second"] else " (not 2nd)") for r in differ if "gap" in r]
        results.append({"set": env, "returncode": returncode, "seconds": round(seconds, 1), "requests": len(runs),
                        "differ": len(differ), "differ_by_mode": by_mode, "runs": runs})
        rows.append(f"| {spec.strip() or 'none'} | {returncode} | {len(runs)} | {len(differ)} | "
                    f"{', '.join(f'{m}: {n}' for m, n in sorted(by_mode.items())) or '-'} | "
                    f"{', '.join(sorted({str(r['seed']) for r in differ})) or '-'} | {', '.join(gaps) or '-'} | "
                    f"{seconds:.0f} |")
        # after each set: a call cut off at its time limit keeps the sets it finished
        table = (f"{args.family}, {args.seeds} seeds x {len(MODES) * 2} requests per switch set, engine rebuilt every "
                 f"{args.rebuild} seeds{', uninitialized memory NaN-filled' if args.nan_fill else ''}; a request differs "
                 f"when its batched greedy tokens are not the target's own (`ar` alone, dynamic forward)\n\n"
                 "gaps: the target's top-two logit gap at each differing request's first differing token (not 2nd: the batched "
                 "token was not the runner-up)\n\n"
                 "| switch set | exit | requests | differ | by mode | seeds | gaps | s |\n|---|---|---|---|---|---|---|---|\n"
                 + "\n".join(rows))
        write_results(Path(args.out), args.name, {"header": header(), "family": args.family, "seeds": args.seeds,
                                                  "rebuild": args.rebuild, "nan_fill": args.nan_fill, "sets": results}, table)
    if any(r["returncode"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
