"""Training data: the target's own responses to the training prompts.

Prompts are rendered with the target's chat template (the serving tokenizer, so training sees
exactly what serving sends), answered by the target with batched generate(), and stored as
shards of token ids; a shard that exists is not generated again (resumable), and under
torchrun every process generates its own shards.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard_{index:05d}.pt"


def eos_ids(target_dir: Path, tokenizer: Tokenizer) -> list[int]:
    generation = target_dir / "generation_config.json"
    ids = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if ids is None:
        ids = tokenizer.backend.token_to_id(tokenizer.eos_token)
    return [ids] if isinstance(ids, int) else list(ids)


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, pad_id: int,
                   eos: list[int], generator_seed: int) -> list[list[int]]:
    """Responses (ending at and including the first EOS, or cut at max_new_tokens)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):                       # left padding
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    torch.manual_seed(generator_seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos, **sampling)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


def generate_data(model, tokenizer: Tokenizer, prompts: list[str], data_dir: Path, cfg, seed: int, eos: list[int],
                  rank: int = 0, world: int = 1) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    pad_id = eos[0]
    num_shards = -(-len(prompts) // cfg.shard_size)
    mine = [i for i in range(num_shards) if i % world == rank and not shard_path(data_dir, i).exists()]
    bar = tqdm(total=sum(len(prompts[i * cfg.shard_size:(i + 1) * cfg.shard_size]) for i in mine),
               desc=f"generating responses (rank {rank})", unit="prompt", disable=rank != 0 and world > 1)
    for index in mine:
        texts = prompts[index * cfg.shard_size:(index + 1) * cfg.shard_size]
        encoded = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
                   for t in texts]
        encoded = [ids[-cfg.max_prompt_tokens:] for ids in encoded]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))   # similar lengths batch together
        responses: list[list[int]] = [[] for _ in encoded]
        for start in range(0, len(order), cfg.batch_size):
            rows = order[start:start + cfg.batch_size]
            out = generate_batch(model, [encoded[i] for i in rows], cfg.max_new_tokens, cfg.temperature, pad_id,
                                 eos, generator_seed=seed * 100003 + index * 101 + start)
            for i, response in zip(rows, out):
                responses[i] = response
            bar.update(len(rows))
        shard = {"prompt_ids": encoded, "response_ids": responses}
        tmp = shard_path(data_dir, index).with_suffix(".tmp")
        torch.save(shard, tmp)
        tmp.replace(shard_path(data_dir, index))
    bar.close()


def load_sequences(data_dir: Path, max_seq_len: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) of every stored pair with 2+ response tokens within max_seq_len."""
    sequences = []
    for path in sorted(data_dir.glob("shard_*.pt")):
        shard = torch.load(path)
        for prompt, response in zip(shard["prompt_ids"], shard["response_ids"]):
            ids = (prompt + response)[:max_seq_len]
            if len(ids) >= len(prompt) + 2:       # room for an anchor and one label
                sequences.append((ids, len(prompt)))
    if not sequences:
        raise RuntimeError(f"no training data in {data_dir}")
    return sequences
