"""What a masked GQA attention call costs the first time it sees a shape, against the call after, per SDPA backend.

PyTorch's cuDNN backend builds a plan for each new shape. A prefill is an eager call whose length is the prompt's, so
each prompt of a new length would pay that build. This times, for a run of new lengths (a SmolLM2-like call: 9 query
heads, 3 K/V heads, head dim 64, bf16, causal bool mask): PyTorch's own choice (`default`), cuDNN alone, and
ddtree.models.layers.sdpa's form on CUDA (`repeated`: K/V heads repeated, flash / memory-efficient / math).

    python perf/sdpa_probe.py --device cuda --name sdpa_probe_h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.layers import sdpa  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402


def call(form: str, q, k, v, mask) -> None:
    if form == "default":
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    elif form == "cudnn":
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        sdpa(q, k, v, mask, q.shape[-1] ** -0.5, repeat_kv=True)


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def probe(form: str, lengths: list[int], device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for n in lengths:
        q = torch.randn(1, 9, n, 64, device=device, dtype=dtype)
        k, v = (torch.randn(1, 3, n, 64, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
        try:
            first = timed(device, lambda: call(form, q, k, v, mask))
            again = timed(device, lambda: call(form, q, k, v, mask))
            rows.append({"length": n, "first_ms": first, "again_ms": again})
        except RuntimeError as e:   # a backend that cannot run this call
            rows.append({"length": n, "error": str(e)[:200]})
    return rows


def table(result: dict) -> str:
    lines = ["| form | lengths | first call ms (median, max) | the call after ms (median) |", "|---|---|---|---|"]
    for form, rows in result["forms"].items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            lines.append(f"| {form} | - | {rows[0]['error'][:60]} | - |")
            continue
        firsts = [r["first_ms"] for r in ok]
        lines.append(f"| {form} | {ok[0]['length']}-{ok[-1]['length']} | {statistics.median(firsts):.2f}, "
                     f"{max(firsts):.2f} | {statistics.median(r['again_ms'] for r in ok):.2f} |")
    return "\n".join(lines) + "\n\nEach form's lengths are new to the process (no form reuses another's)."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, default=8, help="new lengths per form")
    parser.add_argument("--forms", default="default,cudnn,repeated")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="sdpa_probe")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    probe("repeated", [40], device, dtype)   # the process's first call (library loads) is not any form's
    result = {"header": header(), "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "forms": {}}
    for i, form in enumerate(args.forms.split(",")):
        start = 130 + 40 * i
        result["forms"][form] = probe(form, list(range(start, start + args.lengths)), device, dtype)
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
