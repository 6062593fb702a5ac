"""Through the Triton stream: perf_analyzer over gRPC streaming against the ensemble, concurrency 1.

Every request asks for exactly max_tokens tokens (ignore_eos), so tokens/s of a request is
max_tokens / (last response - request start), read from perf_analyzer's profile export.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ddtree.config import EngineConfig
from perf.common import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from triton_env import TritonServer  # noqa: E402

PERF_ANALYZER = ROOT / ".deps" / "bin" / "perf_analyzer"


def set_parameter(config: Path, key: str, value: str) -> None:
    """Set a model parameter of config.pbtxt (appended where the file does not name it)."""
    pattern = rf'(key: "{key}", value: {{ string_value: )"[^"]*"'
    text = config.read_text()
    if re.search(pattern, text):
        config.write_text(re.sub(pattern, rf'\1"{value}"', text))
    else:
        config.write_text(text.rstrip("\n") + f'\nparameters {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n')


def set_gpu_replicas(config: Path, gpus: list[int]) -> None:
    """One engine replica per listed GPU (Triton KIND_GPU instances; each engine runs on its instance's GPU)."""
    text = config.read_text()
    group = f"instance_group [ {{ count: 1, kind: KIND_GPU, gpus: [ {', '.join(str(g) for g in gpus)} ] }} ]"
    updated = re.sub(r"^instance_group \[.*\]$", group, text, count=1, flags=re.MULTILINE)
    if updated == text:
        raise ValueError(f"{config}: no instance_group line to replace")
    config.write_text(updated)


def make_repository(config: EngineConfig, workdir: Path, extra: dict[str, str] | None = None,
                    gpus: list[int] | None = None) -> Path:
    """A copy of model_repository/ serving `config` (and, with `gpus`, one replica per listed GPU)."""
    repo = workdir / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo)
    for model in ("preprocessing", "postprocessing"):
        set_parameter(repo / model / "config.pbtxt", "tokenizer_path", config.target_path)
    ddtree = repo / "ddtree" / "config.pbtxt"
    for key in ("target_path", "drafter_path", "device", "dtype"):
        set_parameter(ddtree, key, str(getattr(config, key)))
    set_parameter(ddtree, "max_tree_budget", str(config.max_tree_budget))
    for key, value in (extra or {}).items():
        set_parameter(ddtree, key, value)
    if gpus:
        set_gpu_replicas(ddtree, gpus)
    return repo


STAGE_METRICS = {"batch_rounds": "ddtree_batch_rounds_total", "rounds": "ddtree_rounds_total",
                 "draft": "ddtree_draft_seconds_total", "verify": "ddtree_verify_seconds_total",
                 "host": "ddtree_host_seconds_total", "serve": "ddtree_serve_seconds_total",
                 "verify_gpu": "ddtree_verify_gpu_seconds_total", "draft_gpu": "ddtree_draft_gpu_seconds_total"}


# the generation model's per-request histograms (seconds, from the request's arrival in the model's process): their
# _sum and _count give the means of a window (request_split)
REQUEST_HISTOGRAMS = {"ttft": "ddtree_time_to_first_token_seconds", "queue": "ddtree_request_queue_seconds",
                      "take": "ddtree_request_take_seconds", "prefill": "ddtree_request_prefill_seconds",
                      "latency": "ddtree_request_latency_seconds"}


def request_sums(metrics_url: str) -> dict[str, float]:
    """The per-request histograms' sums and counts (summed over instances), for request_split."""
    names = {f"{name}_{part}" for name in REQUEST_HISTOGRAMS.values() for part in ("sum", "count")}
    return scrape_metrics(metrics_url, names)


def request_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean ms per request between two readings of request_sums: ttft (arrival in the model -> first response
    queued), queue (-> prefill start), take (-> the engine thread took it), prefill, latency (-> final response queued)."""
    split = {}
    for key, name in REQUEST_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        split[f"{key}_ms"] = 1e3 * total / count if count else None
    return split


def scrape_metrics(metrics_url: str, names) -> dict[str, float]:
    """Counters and gauges from Triton's /metrics, each summed over its label sets (models, instances); a name that
    is not exported is absent."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


AUTO_ARM_FAMILIES = {"rounds": "ddtree_auto_arm_rounds_total", "seconds": "ddtree_auto_arm_seconds_total"}


def auto_arms(metrics_url: str) -> dict[str, dict[str, float]]:
    """Mode auto's per-arm counters from one scrape, summed over instances: {"rounds": {arm: batch rounds it ran},
    "seconds": {arm: time charged to them}} (ddtree_auto_arm_rounds_total / _seconds_total{arm=...})."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counters: dict[str, dict[str, float]] = {key: {} for key in AUTO_ARM_FAMILIES}
    for line in text.splitlines():
        for key, family in AUTO_ARM_FAMILIES.items():
            if line.startswith(family + "{") and 'arm="' in line:
                arm = line.split('arm="', 1)[1].split('"', 1)[0]
                counters[key][arm] = counters[key].get(arm, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def triton_stages(metrics_url: str) -> dict:
    """The engine's stage counters from Triton's metrics, summed over instances (keys as per_round_ms reads them)."""
    values = scrape_metrics(metrics_url, set(STAGE_METRICS.values()))
    return {key: values.get(name, 0.0) for key, name in STAGE_METRICS.items()}


def wait_stages(metrics_url: str, before: dict, timeout_s: float = 5.0) -> dict:
    """Triton's stage counters once the engine has published its last rounds (it publishes when idle)."""
    deadline, after = time.monotonic() + timeout_s, triton_stages(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = triton_stages(metrics_url)
        if again == after:
            break
        after = again
    return after


def model_stats(http_url: str, model: str) -> dict:
    """Triton's cumulative statistics of one model: executions, and queue / compute nanoseconds summed."""
    stats = json.loads(urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=10).read())
    inference = stats["model_stats"][0]["inference_stats"]
    return {"count": inference["success"]["count"], "queue_ns": inference["queue"]["ns"],
            "compute_ns": inference["compute_infer"]["ns"]}


def input_data(prompts: list[str], sampling: dict) -> dict:
    rows = []
    for prompt in prompts:
        rows.append({"text_input": [""], "messages": [json.dumps([{"role": "user", "content": prompt}])],
                     "stream": [True], "exclude_input_in_output": [True],
                     "sampling_parameters": [json.dumps(sampling)]})
    return {"data": rows}


def run_perf_analyzer(server: TritonServer, data: dict, workdir: Path, num_requests: int,
                      concurrency: int = 1, model: str = "ensemble") -> list[dict]:
    """perf_analyzer's requests (timestamps of each response) over gRPC streaming; `model`: the ensemble, or the
    generation model alone (the same inputs: it tokenizes the prompt and detokenizes the output itself)."""
    data_file, export = workdir / "input.json", workdir / "profile.json"
    data_file.write_text(json.dumps(data))
    export.unlink(missing_ok=True)
    cmd = [str(PERF_ANALYZER), "-m", model, "-u", server.grpc_url, "-i", "grpc", "--streaming",
           "--input-data", str(data_file), "--concurrency-range", str(concurrency), "--measurement-mode", "count_windows",
           "--measurement-request-count", str(num_requests), "--stability-percentage", "999",
           "--profile-export-file", str(export)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    profile = json.loads(export.read_text())
    return [r for experiment in profile["experiments"] for r in experiment["requests"]]


def bench_triton(config: EngineConfig, prompts: list[str], methods: list[tuple[str, int, str]], max_tokens: int,
                 temperature: float, num_requests: int | None = None) -> dict:
    if not PERF_ANALYZER.exists():
        raise FileNotFoundError(f"{PERF_ANALYZER} is missing: run `make perf-tools`")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        repo = make_repository(config, workdir)
        with TritonServer(str(repo), log_path=str(workdir / "server.log")) as server:
            for mode, budget, name in methods:
                sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature,
                            "mode": mode, "tree_budget": budget, "seed": 0}
                requests = run_perf_analyzer(server, input_data(prompts, sampling), workdir,
                                             num_requests or len(prompts))
                rates, ttfts = [], []
                for r in requests:
                    times = r["response_timestamps"]
                    if not times:
                        continue
                    rates.append(max_tokens / ((times[-1] - r["timestamp"]) / 1e9))
                    ttfts.append((times[0] - r["timestamp"]) / 1e6)
                results[name] = {"tokens_per_s": statistics.mean(rates), "ttft_ms": statistics.median(ttfts),
                                 "num_requests": len(rates)}
                print(f"triton {name}: {results[name]}", flush=True)
    return results
