"""python -m training --config training/configs/smollm2_135m.json [--stage all|prompts|generate|train|export]
[--set train.steps=100 ...] [--export-to DIR]

Each stage skips what is already done in the run directory, so a cut run resumes by rerunning
the same command. Under torchrun, generation and training are spread over the processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.models.dflash import dflash_hf_config  # noqa: E402
from ddtree.models.loader import read_config  # noqa: E402
from ddtree.tokenizer import Tokenizer  # noqa: E402
from training.config import RunConfig  # noqa: E402
from training.data import eos_ids, generate_data, load_sequences  # noqa: E402
from training.export import export  # noqa: E402
from training.prompts import make_prompts  # noqa: E402
from training.train import Trainer, make_drafter  # noqa: E402

logger = logging.getLogger("training")
STAGES = ("prompts", "generate", "train", "export")


def parse_override(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def distributed() -> tuple[int, int, torch.device | None]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = None
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    return torch.distributed.get_rank(), world, device


def barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def load_target(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a DFlash drafter for a target (see training/__init__.py).")
    parser.add_argument("--config", required=True)
    parser.add_argument("--stage", default="all", choices=("all", *STAGES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--export-to", default=None, help="drafter directory (default: <out_dir>/drafter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = RunConfig.load(args.config, dict(parse_override(s) for s in args.set))
    rank, world, device = distributed()
    if device is None:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if cfg.device == "auto" else cfg.device)
    torch.manual_seed(cfg.seed)
    run_dir, target_dir = Path(cfg.out_dir), Path(cfg.target)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (run_dir / "training_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    stages = STAGES if args.stage == "all" else (args.stage,)
    tokenizer = Tokenizer(target_dir)
    eos = eos_ids(target_dir, tokenizer)
    target_hf = read_config(target_dir)
    mask_id = tokenizer.backend.token_to_id(cfg.drafter.mask_token)
    if mask_id is None:
        raise SystemExit(f"mask token {cfg.drafter.mask_token!r} is not in the target's vocabulary")
    hf = dflash_hf_config(target_hf, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                          mask_token_id=mask_id, target_layer_ids=cfg.drafter.target_layer_ids)

    prompts_file = run_dir / "prompts.jsonl"
    if "prompts" in stages and rank == 0 and not prompts_file.exists():
        prompts = make_prompts(cfg.data.num_prompts, cfg.seed)
        prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        logger.info("%d prompts from the standard library of Python %s", len(prompts), platform.python_version())
    barrier(world)
    target = None
    if "generate" in stages or "train" in stages:
        target = load_target(target_dir, device)
    if "generate" in stages:
        prompts = [json.loads(line) for line in prompts_file.read_text().splitlines()]
        generate_data(target, tokenizer, prompts, run_dir / "data", cfg.data, cfg.seed, eos, rank, world)
        barrier(world)
    if "train" in stages:
        sequences = load_sequences(run_dir / "data", cfg.train.max_seq_len)
        logger.info("training on %d sequences (%d tokens)", len(sequences), sum(len(s) for s, _ in sequences))
        drafter = make_drafter(hf, cfg.seed, cfg.drafter.init_std, device)
        with torch.no_grad():   # its output feeds the target's lm_head: start from the target's final norm
            drafter.norm.weight.copy_(target.model.norm.weight.float())
        finished = Trainer(target, drafter, hf, sequences, cfg.train, run_dir, cfg.seed, eos[0], rank, world).run()
        barrier(world)
        if not finished:
            logger.info("training paused before its last step: not exporting")
            stages = ()
    if "export" in stages and rank == 0:
        sequences = load_sequences(run_dir / "data", 1 << 30)
        data = {"num_prompts": len(prompts_file.read_text().splitlines()), "python": platform.python_version(),
                "temperature": cfg.data.temperature, "max_new_tokens": cfg.data.max_new_tokens,
                "num_sequences": len(sequences), "response_tokens": sum(len(s) - p for s, p in sequences)}
        out = Path(args.export_to) if args.export_to else run_dir / "drafter"
        card = {"name": out.name, "target": target_dir.name, "data": data, "train": cfg.train.__dict__,
                "world": world, "device": str(device.type if world == 1 else f"{world} x {device.type}"),
                "dtype": cfg.export.dtype}
        export(run_dir, out, hf, cfg.export.shard_mb, cfg.export.dtype, card)
        (out / "training_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        logger.info("drafter written to %s", out)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
