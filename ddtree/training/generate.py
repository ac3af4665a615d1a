"""Self-distillation data: the target's own greedy responses, with its hidden states, appended resumably.

Layout of a data directory:
  prompts.jsonl           the training prompts (`Prompt` records), made once by the `prompts` step
  responses.jsonl         one line per finished prompt: ids, shard name, number of tokens
  features/NNNNNN.safetensors  per batch: for each prompt id, the target's hidden states at the stored layers for
                          every token of prompt + response except the last, [num_tokens - 1, num_layers, hidden]
  manifest.json           sources, counts, seeds, commands, dropped overlaps

The hidden states come from the generation itself (`output_hidden_states`): the step that produces token t ran the
target on token t-1, so its hidden state is exactly the drafter's context feature of position t-1. This saves a
second target forward per sequence.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ddtree.training.prompts import Prompt

# Stored hidden_states indices are layer_id + 1 for these target layers; the drafter picks a subset.
DEFAULT_STORED_LAYER_IDS = (1, 4, 8, 14, 20, 24, 27, 28)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a crash is the last one; the prompt is generated again
    return records


def write_prompts(data_dir: Path, prompts: list[Prompt]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p)) + "\n")


def _pending(data_dir: Path) -> list[Prompt]:
    prompts = [Prompt(**r) for r in read_jsonl(data_dir / "prompts.jsonl")]
    if not prompts:
        raise ValueError(f"no prompts in {data_dir}/prompts.jsonl: run the prompts step first")
    done = {r["prompt_id"] for r in read_jsonl(data_dir / "responses.jsonl")}
    return [p for p in prompts if p.prompt_id not in done]


@torch.no_grad()
def generate_responses(
    data_dir: Path,
    target: str,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    max_prompts: int | None = None,
    stored_layer_ids: tuple[int, ...] = DEFAULT_STORED_LAYER_IDS,
    num_threads: int = 1,
    max_seconds: float | None = None,
) -> int:
    """Generate greedy responses for the pending prompts; returns the number of responses written."""
    from safetensors.torch import save_file

    from ddtree.training.target import chat_prompt_ids, load_target

    if batch_size <= 0 or max_new_tokens <= 0:
        raise ValueError("batch_size and max_new_tokens must be positive")
    torch.set_num_threads(num_threads)
    pending = _pending(data_dir)[:max_prompts]
    if not pending:
        return 0
    model, tokenizer = load_target(target)
    num_layers = model.config.num_hidden_layers
    if any(not 0 <= i < num_layers for i in stored_layer_ids):
        raise ValueError(f"stored_layer_ids {stored_layer_ids} outside the target's {num_layers} layers")
    eos_ids = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    features_dir = data_dir / "features"
    features_dir.mkdir(parents=True, exist_ok=True)
    shard_index = len(list(features_dir.glob("*.safetensors")))
    start = time.time()
    num_written = 0
    # Prompts of similar length share a batch so left padding stays short; chunks keep the category interleave.
    chunk_size = batch_size * 4
    for chunk_start in range(0, len(pending), chunk_size):
        chunk = sorted(pending[chunk_start : chunk_start + chunk_size], key=lambda p: len(p.text))
        for batch_start in range(0, len(chunk), batch_size):
            if max_seconds is not None and time.time() - start > max_seconds:
                return num_written
            batch = chunk[batch_start : batch_start + batch_size]
            prompt_ids = [chat_prompt_ids(tokenizer, p.text) for p in batch]
            max_len = max(len(ids) for ids in prompt_ids)
            input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)  # [B, P] left padded
            attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
            for row, ids in enumerate(prompt_ids):
                input_ids[row, max_len - len(ids) :] = torch.tensor(ids)
                attention_mask[row, max_len - len(ids) :] = 1
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, output_hidden_states=True, return_dict_in_generate=True, pad_token_id=pad_id,
                temperature=None, top_p=None, top_k=None,
            )
            new_tokens = out.sequences[:, max_len:]  # [B, N]
            # hidden states per step: step 0 covers the whole (padded) prompt, later steps one token each
            stacked = [
                torch.stack([step[i + 1] for i in stored_layer_ids], dim=2).to(torch.bfloat16)  # [B, T, Ls, H]
                for step in out.hidden_states
            ]
            all_features = torch.cat(stacked, dim=1)  # [B, P + N - 1, Ls, H]
            shard_name = f"{shard_index:06d}.safetensors"
            tensors, records = {}, []
            for row, p in enumerate(batch):
                response = new_tokens[row].tolist()
                is_finished = False
                for k, token in enumerate(response):
                    if token in eos_ids:
                        response, is_finished = response[: k + 1], True
                        break
                num_tokens = len(prompt_ids[row]) + len(response)
                pad = max_len - len(prompt_ids[row])
                tensors[p.prompt_id] = all_features[row, pad : pad + num_tokens - 1].contiguous()
                records.append({
                    "prompt_id": p.prompt_id, "category": p.category, "prompt_ids": prompt_ids[row],
                    "response_ids": response, "is_finished": is_finished, "shard": shard_name,
                })
            save_file(tensors, str(features_dir / shard_name))
            with open(data_dir / "responses.jsonl", "a") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
                f.flush()
                os.fsync(f.fileno())
            shard_index += 1
            num_written += len(batch)
            num_new = sum(len(r["response_ids"]) for r in records)
            elapsed = time.time() - start
            print(f"[generate] batch {shard_name}: {len(batch)} prompts, {num_new} new tokens, "
                  f"{num_written} written, {elapsed:.0f}s", flush=True)
    return num_written


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
