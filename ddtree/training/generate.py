"""Self-distillation data: the target's own greedy responses, with its hidden states, appended resumably.

Layout of a data directory:
  prompts.jsonl           the training prompts (`Prompt` records), made once by the `prompts` step
  responses.jsonl         one line per finished prompt: ids, shard name, number of tokens
  features/NNNNNN.safetensors  per batch: for each prompt id, the target's hidden states at the stored layers for
                          every token of prompt + response except the last, [num_tokens - 1, num_layers, hidden];
                          with soft targets (`soft_target_top_k` K > 0), also "<id>/topk_ids" [R, K] int32 and
                          "<id>/topk_logprobs" [R, K] float16: for each of the R response tokens, the K most
                          likely tokens of the target's distribution there (log-softmax of the logits at T = 1)
  manifest.json           sources, counts, seeds, commands, dropped overlaps

The hidden states come from the generation itself (forward hooks on the stored layers): the step that produces token t
ran the target on token t-1, so its hidden state is exactly the drafter's context feature of position t-1, and its
logits are the target's distribution at token t (the soft targets). This saves a second target forward per sequence.

Both engines run the target on `device` in `dtype` (on a GPU: bfloat16, as DFlash/SpecForge run it); the stored
features are bfloat16 CPU tensors whatever the device, so data made on a GPU trains anywhere.
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
# Tokens of the target's distribution kept per response token (the drafter's auxiliary soft-target loss)
DEFAULT_SOFT_TARGET_TOP_K = 32


def soft_target_keys(prompt_id: str) -> tuple[str, str]:
    """The shard keys of a response's soft targets: token ids [R, K] and their log-probabilities [R, K]."""
    return f"{prompt_id}/topk_ids", f"{prompt_id}/topk_logprobs"


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logits -> the k most likely tokens' ids [N, k] int32 and log-probabilities [N, k] float16, on the
    CPU (log-softmax in float32 over the whole vocabulary, so the values are the target's own at T = 1)."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return ids.to(torch.int32).cpu(), values.to(torch.float16).cpu()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file. A last line without its newline was cut by a crash while being appended:
    it is left out (its prompt is generated again; `append_jsonl` cuts it off before appending). Any other line
    that does not parse is an error."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # the cut last line (or "" for an empty file)
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc}); only a cut last line is tolerated") from None
    return records


def append_jsonl(path: Path, records: list[dict]) -> None:
    """Append records durably, first cutting off a last line that a crash left without its newline (appended to,
    it would hide every record after it)."""
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
        f.seek(0, os.SEEK_END)
        f.write("".join(json.dumps(r) + "\n" for r in records).encode())
        f.flush()
        os.fsync(f.fileno())


def write_prompts(data_dir: Path, prompts: list[Prompt]) -> None:
    """Written to a temporary file and renamed, so that a generator starting meanwhile reads the old or new list."""
    data_dir.mkdir(parents=True, exist_ok=True)
    partial = data_dir / "prompts.jsonl.partial"
    with open(partial, "w") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p)) + "\n")
    os.replace(partial, data_dir / "prompts.jsonl")


def interleave_pending(prompts: list[Prompt], done_ids: set[str], added: list[Prompt]) -> list[Prompt]:
    """The prompt list after adding `added`: the finished prompts first, then the pending and the added ones spread
    evenly through each other (generation runs in file order, so any prefix of what remains mixes both)."""
    done = [p for p in prompts if p.prompt_id in done_ids]
    pending = [p for p in prompts if p.prompt_id not in done_ids]
    # stable merge by relative position; ties go to the pending prompts
    keyed = [((i + 0.5) / len(pending), 0, i, p) for i, p in enumerate(pending)]
    keyed += [((j + 0.5) / len(added), 1, j, p) for j, p in enumerate(added)]
    return done + [p for *_, p in sorted(keyed, key=lambda k: k[:3])]


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
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    soft_target_top_k: int = 0,
) -> int:
    """Generate greedy responses for the pending prompts; returns the number of responses written. With
    `soft_target_top_k`, also each response token's top-k log-probabilities (the module docstring's layout)."""
    from safetensors.torch import save_file
    from transformers import LogitsProcessorList

    from ddtree.training.target import chat_prompt_ids, load_target, resolve_device

    if batch_size <= 0 or max_new_tokens <= 0:
        raise ValueError("batch_size and max_new_tokens must be positive")
    device = resolve_device(device)
    torch.set_num_threads(num_threads)
    pending = _pending(data_dir)[:max_prompts]
    if not pending:
        return 0
    model, tokenizer = load_target(target, dtype=dtype)
    model.to(device)
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
            captured: dict[int, list[torch.Tensor]] = {i: [] for i in stored_layer_ids}
            # Hugging Face's hidden_states[-1] is after the final norm: the last layer's feature is taken there
            hooks = [
                (model.model.norm if i == num_layers - 1 else model.model.layers[i]).register_forward_hook(
                    _capture_into(captured[i])
                )
                for i in stored_layer_ids
            ]
            keep_top = _KeepTop(soft_target_top_k)
            try:
                sequences = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_id,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    logits_processor=LogitsProcessorList([keep_top] if soft_target_top_k else []),
                )
            finally:
                for hook in hooks:
                    hook.remove()
            new_tokens = sequences[:, max_len:].cpu()  # [B, N]
            # one captured output per forward: the first covers the whole (padded) prompt, later ones a token each
            stacked = [
                torch.stack([captured[i][step] for i in stored_layer_ids], dim=2)  # [B, T, Ls, H]
                for step in range(len(captured[stored_layer_ids[0]]))
            ]
            all_features = torch.cat(stacked, dim=1).cpu()  # [B, P + N - 1, Ls, H], stored from the CPU
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
                if soft_target_top_k:
                    ids_key, logprobs_key = soft_target_keys(p.prompt_id)
                    tensors[ids_key] = torch.stack([ids[row] for ids, _ in keep_top.steps[: len(response)]])
                    tensors[logprobs_key] = torch.stack([lp[row] for _, lp in keep_top.steps[: len(response)]])
                records.append(
                    {
                        "prompt_id": p.prompt_id,
                        "category": p.category,
                        "prompt_ids": prompt_ids[row],
                        "response_ids": response,
                        "is_finished": is_finished,
                        "shard": shard_name,
                    }
                )
            save_file(tensors, str(features_dir / shard_name))
            append_jsonl(data_dir / "responses.jsonl", records)
            shard_index += 1
            num_written += len(batch)
            num_new = sum(len(r["response_ids"]) for r in records)
            elapsed = time.time() - start
            print(
                f"[generate] batch {shard_name}: {len(batch)} prompts, {num_new} new tokens, "
                f"{num_written} written, {elapsed:.0f}s",
                flush=True,
            )
    return num_written


class _KeepTop:
    """A logits processor for transformers' `generate` that keeps each step's top-k log-probabilities and passes
    the logits on unchanged (greedy: no other processor runs, so they are the model's own)."""

    def __init__(self, k: int):
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # per generated token: ([B, K], [B, K])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(top_logprobs(scores, self.k))
        return scores


def _capture_into(outputs: list[torch.Tensor]):
    """A forward hook keeping a decoder layer's output (hidden_states[layer + 1]) in bfloat16."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        outputs.append(hidden.detach().to(torch.bfloat16))

    return hook


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@torch.no_grad()
def generate_responses_continuous(
    data_dir: Path,
    target: str,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    max_prompts: int | None = None,
    stored_layer_ids: tuple[int, ...] = DEFAULT_STORED_LAYER_IDS,
    num_threads: int = 1,
    max_seconds: float | None = None,
    shard_size: int = 32,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    soft_target_top_k: int = 0,
) -> int:
    """Like `generate_responses`, on the project's target runner with continuous batching: a finished request
    leaves the decode batch at once and a new prompt takes its place (HF `generate` keeps computing finished rows
    and pads prompts). Features are the runner's hidden states, the same quantities as Hugging Face's
    hidden_states[layer + 1]."""
    from safetensors.torch import save_file

    from ddtree.models.target import TargetModel, kv_budget_bytes_per_token
    from ddtree.training.target import DEFAULT_TARGET, chat_prompt_ids, resolve_device

    if batch_size <= 0 or max_new_tokens <= 0:
        raise ValueError("batch_size and max_new_tokens must be positive")
    device = resolve_device(device)
    torch.set_num_threads(num_threads)
    pending = _pending(data_dir)[:max_prompts]
    if not pending:
        return 0
    source = "default" if target == DEFAULT_TARGET else target
    typical_prompt_tokens = 512  # the KV pool's sizing; longer prompts (whole, as the hf engine) just fit fewer at once
    # the KV pool is sized from the config, read alone (loading the weights twice would cost an 8B target minutes)
    config = _runner_config(source)
    bytes_per_token = kv_budget_bytes_per_token(config, dtype, len(stored_layer_ids))
    model = TargetModel.load(
        source,
        device=device,
        dtype=dtype,
        feature_layer_ids=stored_layer_ids,
        max_kv_bytes=batch_size * (typical_prompt_tokens + max_new_tokens) * bytes_per_token,
    )
    tokenizer = model.tokenizer
    # the tokenizer's end token and the checkpoint's (generation) end tokens, as in the hf engine
    eos_ids = {tokenizer.eos_token_id} | set(_as_list(getattr(model.config, "eos_token_ids", None)))
    features_dir = data_dir / "features"
    features_dir.mkdir(parents=True, exist_ok=True)
    shard_index = len(list(features_dir.glob("*.safetensors")))
    num_layers, hidden = len(stored_layer_ids), model.config.hidden_size
    start = time.time()
    queue = list(reversed(pending))
    active: dict[int, dict] = {}  # seq id -> prompt, prompt ids, response ids, features list
    finished: list[dict] = []
    num_written, next_seq_id = 0, 0

    def flush() -> None:
        nonlocal shard_index, num_written, finished
        if not finished:
            return
        shard_name = f"{shard_index:06d}.safetensors"
        tensors = {r["prompt_id"]: r.pop("features") for r in finished}
        for r in finished:
            top = r.pop("top")
            if soft_target_top_k:
                ids_key, logprobs_key = soft_target_keys(r["prompt_id"])
                tensors[ids_key] = torch.cat([ids for ids, _ in top])  # [R, K]
                tensors[logprobs_key] = torch.cat([lp for _, lp in top])
        save_file(tensors, str(features_dir / shard_name))
        append_jsonl(data_dir / "responses.jsonl", [{**r, "shard": shard_name} for r in finished])
        num_written += len(finished)
        num_new = sum(len(r["response_ids"]) for r in finished)
        print(
            f"[generate] shard {shard_name}: {len(finished)} prompts, {num_new} new tokens, {num_written} written,"
            f" {time.time() - start:.0f}s",
            flush=True,
        )
        shard_index += 1
        finished = []

    try:
        while queue or active:
            is_out_of_time = max_seconds is not None and time.time() - start > max_seconds
            new_ids, new_prompts = [], []
            while queue and len(active) + len(new_ids) < batch_size and not is_out_of_time:
                p = queue.pop()
                ids = chat_prompt_ids(tokenizer, p.text)
                if model.kv.allocate(next_seq_id, len(ids) + max_new_tokens) is None:  # the pool is full: later
                    if not active and not new_ids:
                        raise ValueError(
                            f"prompt {p.prompt_id} has {len(ids)} tokens: with --max-new-tokens "
                            f"{max_new_tokens} it does not fit the KV pool of --batch-size {batch_size} "
                            f"sequences of {typical_prompt_tokens} + {max_new_tokens} tokens"
                        )
                    queue.append(p)
                    break
                new_ids.append(next_seq_id)
                new_prompts.append((p, ids))
                next_seq_id += 1
            if new_ids:
                logits, prompt_features = model.prefill(new_ids, [ids for _, ids in new_prompts])
                tops = _top_rows(logits, soft_target_top_k)
                for seq_id, (p, ids), row, feats, top in zip(
                    new_ids, new_prompts, logits.argmax(-1).tolist(), prompt_features, tops
                ):
                    active[seq_id] = {
                        "prompt": p,
                        "prompt_ids": ids,
                        "response_ids": [row],
                        "features": [feats.to(torch.bfloat16).cpu()],
                        "top": [top],
                    }
            # requests whose last token ends them leave before the decode step
            for seq_id in list(active):
                a = active[seq_id]
                last = a["response_ids"][-1]
                if last in eos_ids or len(a["response_ids"]) >= max_new_tokens:
                    del active[seq_id]
                    model.free(seq_id)
                    feats = torch.cat(a["features"]).view(-1, num_layers, hidden)  # [N - 1, Ls, H]
                    finished.append(
                        {
                            "prompt_id": a["prompt"].prompt_id,
                            "category": a["prompt"].category,
                            "prompt_ids": a["prompt_ids"],
                            "response_ids": a["response_ids"],
                            "is_finished": last in eos_ids,
                            "features": feats.contiguous(),
                            "top": a["top"],
                        }
                    )
                    if len(finished) >= shard_size:
                        flush()
            if not active:
                if is_out_of_time:
                    break
                continue
            seq_ids = list(active)
            logits, feats = model.decode(seq_ids, [active[s]["response_ids"][-1] for s in seq_ids])
            # the argmax already waits for the step: one small copy of all rows' features to the host joins it
            tops = _top_rows(logits, soft_target_top_k)
            for seq_id, token, f, top in zip(seq_ids, logits.argmax(-1).tolist(), feats.to(torch.bfloat16).cpu(), tops):
                active[seq_id]["response_ids"].append(token)
                # a copy of the row: a view would keep the whole batch's step tensor alive as long as this request
                active[seq_id]["features"].append(f.clone().unsqueeze(0))
                active[seq_id]["top"].append(top)
    except KeyboardInterrupt:  # Ctrl-C: the finished responses are kept (the unfinished are pending again)
        flush()
        raise
    flush()
    return num_written


def _top_rows(logits: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per row of [R, V] logits, its top-k ids and log-probabilities as ([1, k], [1, k]) copies (a row must not
    keep the step's tensor alive); [None] * R without soft targets."""
    if not k:
        return [None] * logits.shape[0]
    ids, logprobs = top_logprobs(logits, k)
    return [(i.clone().unsqueeze(0), lp.clone().unsqueeze(0)) for i, lp in zip(ids, logprobs)]


def _runner_config(source: str):
    """The target runner's config without its weights: config.json of a folder, the header of a GGUF file."""
    from ddtree.models.config import TargetConfig
    from ddtree.models.loader import read_gguf_config, resolve_source

    if source == "default":
        from ddtree.models.default import default_target_dir

        path = default_target_dir()
    else:
        path = resolve_source(source)
    if path.is_dir() and (path / "config.json").is_file():
        return TargetConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path] if path.suffix == ".gguf" else []
    if len(ggufs) != 1:
        raise ValueError(f"{path} is neither a checkpoint folder nor a .gguf file")
    import gguf

    return read_gguf_config(gguf.GGUFReader(str(ggufs[0])))
