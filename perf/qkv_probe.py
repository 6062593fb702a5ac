"""Where our q/k/v prepare kernel (attention_kernel.prepare_qkv, DDTREE_QKV_KERNEL=1) faults: the 27B-shaped random
target's static verify (perf/hybrid_verify.measure_verify: an `ar` step, then each budget's tree) at several layer
counts, each configuration in a process of its own (a fault ends the process), on the GPU.

On the H200 at c92c6f8 the 64-layer forward faulted inside prepare_qkv (an illegal memory access) while 8 layers ran
(perf/results/qkv_fault_h200.log). Each run prints its stages as they pass; with TRITON_DEBUG=1 the kernel checks each
K/V write's slot and position against the pool (a device assert); `--sanitize` runs each child under
compute-sanitizer's memcheck (slow: few layers). Writes perf/results/<name>.md.

    python perf/qkv_probe.py --layers 8,64 --budgets 16,64 --name qkv_probe_h200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402

CONFIGS = {   # name: environment on top of the caller's (DDTREE_QKV_KERNEL=1 in all but "chains")
    "kernel": {"DDTREE_QKV_KERNEL": "1"},
    "kernel+debug": {"DDTREE_QKV_KERNEL": "1", "TRITON_DEBUG": "1", "CUDA_LAUNCH_BLOCKING": "1"},
    "chains": {"DDTREE_QKV_KERNEL": "0"},
}


def child(layers: int, budgets: list[int], prompt_len: int) -> None:
    import torch

    from perf import hybrid_verify

    hybrid_verify.SHAPES["qwen36-27b"]["num_hidden_layers"] = layers
    target = hybrid_verify.random_target("qwen36-27b", torch.bfloat16, "cuda")
    print("built", flush=True)
    result = hybrid_verify.measure_verify(target, "cuda", budgets, prompt_len, 2, static=True)
    print("RESULT " + json.dumps({"ar": result["ar_step_ms"],
                                  **{str(b): e["verify_ms"] for b, e in result["budgets"].items()}}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="8,64")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--configs", default="kernel,kernel+debug,chains")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per child")
    parser.add_argument("--sanitize", action="store_true", help="each child under compute-sanitizer --tool memcheck")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="qkv_probe")
    parser.add_argument("--child", nargs=2, metavar=("LAYERS", "BUDGETS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), [int(b) for b in args.child[1].split(",")], args.prompt_len)
        return
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        for name in args.configs.split(","):
            command = [sys.executable, __file__, "--child", str(layers), args.budgets, "--prompt-len", str(args.prompt_len)]
            if args.sanitize:
                command = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5", *command]
            start = time.perf_counter()
            try:
                run = subprocess.run(command, env={**os.environ, **CONFIGS[name]}, capture_output=True, text=True,
                                     timeout=args.timeout)
                text, rc = run.stdout + run.stderr, str(run.returncode)
            except subprocess.TimeoutExpired as exc:
                text = "".join(s.decode() if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr))
                rc = "timeout"
            lines = [line for line in text.splitlines() if line.strip() and "frame #" not in line and "warn" not in line.lower()]
            passed = [line for line in lines if line.startswith(("built", "budget", "RESULT"))]
            tail = [] if rc == "0" else lines[-25:]
            rows.append((layers, name, rc, time.perf_counter() - start, passed, tail))
            print(f"== {layers} layers, {name}: rc {rc}", *passed, *tail, sep="\n  ", flush=True)
    md = ["| layers | config | exit | s | stages passed |", "|---|---|---|---|---|"]
    md += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {'; '.join(r[4]) or '-'} |" for r in rows]
    for layers, name, rc, _, _, tail in rows:
        if tail:
            md += ["", f"{layers} layers, {name} (exit {rc}), the output's last lines:", "", "```", *tail, "```"]
    result = {"header": header(), "runs": [{"layers": r[0], "config": r[1], "exit": r[2], "seconds": r[3],
                                            "passed": r[4], "tail": r[5]} for r in rows]}
    write_results(Path(args.out), args.name, result, "\n".join(md))


if __name__ == "__main__":
    main()
