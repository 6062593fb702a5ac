"""A training run's configuration: one JSON file, copied into the run directory.

Every field has a default sized for the embedded default on one H200; larger targets change it
by configuration (batch, accumulation, precision, GPUs through torchrun).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass
class DataConfig:
    num_prompts: int = 6000
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    batch_size: int = 256            # prompts per generate() call
    temperature: float = 0.0         # 0 = the target's greedy responses
    shard_size: int = 1024           # prompts per data shard (the unit of resumption)


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    mask_token: str = "<empty_output>"
    target_layer_ids: list[int] | None = None     # None: evenly spaced, as the reference
    init_std: float = 0.02


@dataclass
class TrainConfig:
    steps: int = 3000
    batch_size: int = 32             # sequences per micro-batch (per process)
    grad_accum: int = 1
    blocks_per_seq: int = 16         # random anchors per sequence
    max_seq_len: int = 640
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_gamma: float = 7.0          # slot k's loss weight is exp(-(k-1)/gamma)
    mixed_precision: str = "bf16"    # bf16 | none (fp32); ignored on the CPU
    log_every: int = 20
    save_every: int = 500
    stop_at_step: int | None = None  # end this invocation early (a checkpoint is saved); rerun to resume
    time_limit_s: float | None = None  # likewise, once this much wall time has passed (time-boxed jobs)


@dataclass
class ExportConfig:
    dtype: str = "bfloat16"
    shard_mb: float = 15.0


@dataclass
class RunConfig:
    target: str
    out_dir: str
    seed: int = 0
    device: str = "auto"             # auto | cpu | cuda
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @classmethod
    def from_dict(cls, raw: dict) -> "RunConfig":
        sections = {"data": DataConfig, "drafter": DrafterConfig, "train": TrainConfig, "export": ExportConfig}
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown run config keys {sorted(unknown)}")
        values = {}
        for key, value in raw.items():
            if key in sections:
                section = sections[key]
                bad = set(value) - {f.name for f in fields(section)}
                if bad:
                    raise ValueError(f"unknown keys in {key!r}: {sorted(bad)}")
                values[key] = section(**value)
            else:
                values[key] = value
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path, overrides: dict | None = None) -> "RunConfig":
        raw = json.loads(Path(path).read_text())
        for dotted, value in (overrides or {}).items():
            node = raw
            *parents, leaf = dotted.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        return asdict(self)
