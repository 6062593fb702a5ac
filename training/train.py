"""The training loop: frozen target for taps, embeddings and lm_head; AdamW on the drafter only.

Deterministic for a given config (batches come from a generator seeded by seed, step and rank),
resumable from the newest checkpoint, mixed precision on the GPU, gradient accumulation, and
data parallel under torchrun (DistributedDataParallel; every process draws its own batches).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.models.dflash import DFlashConfig, DFlashDrafter, init_random_drafter
from training.objective import BlockDiffusionModel, block_loss, slot_weights

logger = logging.getLogger(__name__)


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_drafter(hf_config: dict, seed: int, std: float, device) -> DFlashDrafter:
    drafter = DFlashDrafter(DFlashConfig.from_hf(hf_config))
    drafter.load_state_dict(init_random_drafter(hf_config, seed=seed, std=std))
    return drafter.to(device)


def sample_batch(sequences: list[tuple[list[int], int]], cfg, block_size: int, pad_id: int,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """input_ids/attention [B, T], anchors [B, K], labels [B, K, bs-1] for random sequences and anchors."""
    picks = torch.randint(len(sequences), (cfg.batch_size,), generator=generator).tolist()
    width = max(len(sequences[i][0]) for i in picks)
    input_ids = torch.full((cfg.batch_size, width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    anchors = torch.empty((cfg.batch_size, cfg.blocks_per_seq), dtype=torch.long)
    for row, i in enumerate(picks):
        ids, prompt_len = sequences[i]
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention[row, :len(ids)] = 1
        # the root of a serving round is a generated token: anchors lie in the response
        low, high = prompt_len, len(ids) - 1          # an anchor needs at least one label after it
        anchors[row] = low + torch.randint(high - low, (cfg.blocks_per_seq,), generator=generator)
    offsets = torch.arange(1, block_size)
    label_pos = anchors[:, :, None] + offsets
    lengths = attention.sum(1)[:, None, None]
    labels = torch.where(label_pos < lengths, input_ids.gather(1, label_pos.clamp(max=width - 1).flatten(1))
                         .view_as(label_pos), torch.full_like(label_pos, -100))
    return {"input_ids": input_ids, "attention": attention, "anchors": anchors, "labels": labels}


class Trainer:
    def __init__(self, target, drafter: DFlashDrafter, hf_config: dict, sequences, cfg, run_dir: Path, seed: int,
                 pad_id: int, rank: int = 0, world: int = 1) -> None:
        self.target, self.cfg, self.run_dir, self.seed = target, cfg, run_dir, seed
        self.hf_config, self.sequences, self.pad_id, self.rank, self.world = hf_config, sequences, pad_id, rank, world
        self.device = next(drafter.parameters()).device
        self.drafter = drafter
        model = BlockDiffusionModel(drafter)
        if world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model = model
        decay = [p for p in drafter.parameters() if p.dim() >= 2]
        no_decay = [p for p in drafter.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.tap_ids = DFlashConfig.from_hf(hf_config).target_layer_ids
        self.block_size = drafter.block_size
        self.mask_id = DFlashConfig.from_hf(hf_config).mask_token_id
        self.weights = slot_weights(self.block_size, cfg.loss_gamma, self.device)
        self.step = 0
        self.seconds_before = 0.0       # training time of earlier invocations (resumed runs)
        self.ckpt_dir = run_dir / "checkpoints"
        self.log_path = run_dir / "train_log.jsonl"

    # ---- checkpoints -------------------------------------------------------------------------
    def resume(self) -> None:
        ckpts = sorted(self.ckpt_dir.glob("step_*.pt"))
        if not ckpts:
            return
        state = torch.load(ckpts[-1], map_location=self.device)
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.rank == 0 and self.log_path.exists():   # drop log lines written after that checkpoint
            lines = [ln for ln in self.log_path.read_text().splitlines() if json.loads(ln)["step"] <= self.step]
            self.log_path.write_text("".join(ln + "\n" for ln in lines))
            self.seconds_before = json.loads(lines[-1])["seconds"] if lines else 0.0
        logger.info("resumed from %s (step %d)", ckpts[-1].name, self.step)

    def save(self) -> None:
        if self.rank != 0:
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = self.ckpt_dir / f"step_{self.step:07d}.pt"
        torch.save({"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "step": self.step, "hf_config": self.hf_config}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        for old in sorted(self.ckpt_dir.glob("step_*.pt"))[:-2]:
            old.unlink()

    # ---- one step ----------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.mixed_precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _target_inputs(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.target.model(input_ids=batch["input_ids"], attention_mask=batch["attention"],
                                output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i + 1] for i in self.tap_ids], dim=-1)
        roots = batch["input_ids"].gather(1, batch["anchors"])
        block = torch.full((*roots.shape, self.block_size), self.mask_id, device=self.device, dtype=torch.long)
        block[..., 0] = roots
        return taps, self.target.get_input_embeddings()(block)

    def train_step(self) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        totals = {"loss": 0.0, "acc1": 0.0, "tau_chain": 0.0}
        for micro in range(self.cfg.grad_accum):
            generator = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.step) * 64 + micro) * 1024
                                                      + self.rank)
            batch = {k: v.to(self.device) for k, v in
                     sample_batch(self.sequences, self.cfg, self.block_size, self.pad_id, generator).items()}
            with self._autocast():
                taps, embeds = self._target_inputs(batch)
                hidden = self.model(taps, embeds, batch["anchors"])
                logits = self.target.get_output_embeddings()(hidden[:, :, 1:])
            loss, stats = block_loss(logits, batch["labels"], self.weights)
            (loss / self.cfg.grad_accum).backward()
            totals["loss"] += loss.item() / self.cfg.grad_accum
            totals["acc1"] += stats["acc1"] / self.cfg.grad_accum
            totals["tau_chain"] += stats["tau_chain"] / self.cfg.grad_accum
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        return {**totals, "lr": lr}

    def run(self) -> bool:
        """Train to cfg.steps (or until paused); True when the run is complete."""
        self.resume()
        self.target.requires_grad_(False)
        self.model.train()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="training drafter", unit="step",
                   disable=self.rank != 0)
        window: list[dict] = []
        start = time.perf_counter()
        while self.step < self.cfg.steps:
            if self._should_pause(start):
                logger.info("pausing at step %d (stop_at_step/time_limit_s); rerun to resume", self.step)
                self.save()
                break
            window.append(self.train_step())
            bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                record = {"step": self.step, **{k: sum(w[k] for w in window) / len(window) for k in window[0]},
                          "seconds": self.seconds_before + time.perf_counter() - start}
                window = []
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['acc1']:.2f}",
                                tau=f"{record['tau_chain']:.2f}")
                if self.rank == 0:
                    with self.log_path.open("a") as log:
                        log.write(json.dumps(record) + "\n")
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save()
        bar.close()
        return self.step >= self.cfg.steps

    def _should_pause(self, start: float) -> bool:
        if self.cfg.stop_at_step is not None and self.step >= self.cfg.stop_at_step:
            return True
        over = self.cfg.time_limit_s is not None and time.perf_counter() - start > self.cfg.time_limit_s
        if self.world > 1:   # every process must stop at the same step
            flag = torch.tensor([float(over)], device=self.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        return over
