"""DFlash drafter training on the target's own responses (the SpecForge recipe), resumable.

Per step: a few sequences, many random anchors each (all blocks of a sequence in one forward, see blocks.py),
cross-entropy of the frozen target lm_head's logits against the token at each block position k >= 1, weighted
exp(-(k - 1) / gamma) and normalised. With `soft_target_weight` w > 0, plus w times the cross-entropy against the
target's own distribution there (its top-k tokens, stored by `generate`, renormalised over those the step's softmax
holds), weighted alike: the greedy label stays the main term (it is what verification accepts), and the soft term
tells the drafter which other tokens the target found likely, which a tree's second branches draft. AdamW, linear
warmup then cosine decay, gradient clipping. The logged `loss` is the cross-entropy on the greedy labels alone, so
runs with and without the soft term compare.

Device and precision: the drafter, the frozen embedding / LM head and each batch live on `device`. Parameters,
gradients and the AdamW state are float32; with `dtype` bfloat16 the forward runs under autocast (bf16 matmuls,
float32 softmax / cross-entropy) and the frozen embedding / head are stored in bf16. That is SpecForge's DFlash
recipe in single-device form: bf16 compute (FSDP MixedPrecision param_dtype bf16) over float32 master weights and
optimiser (its BF16Optimizer), target in bf16. A step waits for the device once, to log its statistics.
Checkpoints hold CPU tensors, so a run resumes (or `init_from` starts) on any device.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.models.dflash import DFlashConfig, DFlashDraftModel, save_dflash
from ddtree.training.blocks import BlockBatch, build_block_batch, default_gamma, sample_anchors
from ddtree.training.data import DataSetReader, FeatureReader, Sequence, is_validation, pad_features, read_sequences
from ddtree.training.generate import read_jsonl


@dataclass
class TrainConfig:
    out_dir: str
    num_draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 14, 27])
    mask_token_id: int = 16  # SmolLM2 `<empty_output>`: a Jupyter marker never produced in chat (docs/drafter.md)
    max_anchors: int = 32  # per sequence and step
    batch_size: int = 4  # sequences per step
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04
    max_steps: int = 4000
    max_hours: float | None = None  # a time budget: training stops and the schedule anneals by then
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    validation_fraction: float = 0.0  # sequences held out of training (the tau evaluation uses its own prompts)
    checkpoint_every: int = 100
    is_softmax_restricted: bool = True  # sampled softmax: data tokens + random negatives (see FrozenTargetHead)
    num_negatives: int = 8192
    init_from: str | None = None  # a DFlash drafter to start from (same shape or smaller: grow_drafter)
    seed: int = 0
    soft_target_weight: float = 0.0  # the auxiliary soft-target term's weight (module docstring); 0: off


def drafter_config_for(target_config, train_config: TrainConfig) -> DFlashConfig:
    """A drafter of the target's width: same heads, head_dim, MLP size and rope as the target."""
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=train_config.num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=float(_rope_theta(target_config)),
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        block_size=train_config.block_size,
        num_target_layers=target_config.num_hidden_layers,
        mask_token_id=train_config.mask_token_id,
        target_layer_ids=list(train_config.target_layer_ids),
    )


def _rope_theta(target_config) -> float:
    theta = getattr(target_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return theta


class FrozenTargetHead:
    """The target's input embedding and LM head (frozen), the only target parts the drafter uses.

    Training softmax on a CPU: the LM head is most of a step's cost. With `restrict_softmax(token_ids,
    num_negatives)` the softmax of each step runs over the tokens present in the training responses (every label is
    one; the draft vocabulary is made from them) plus `num_negatives` other tokens drawn afresh every step (a
    sampled softmax). The negatives are needed: a
    softmax over the data tokens alone never pushes the other ~45k logits down, and at inference (full head) those
    untrained logits win the argmax (measured: 0% full-vocabulary accuracy). Evaluation and serving draft over the
    draft vocabulary (`vocab` step) by default; the negatives keep the full head usable too (other DFlash loaders,
    `use_draft_vocab=False`).
    """

    def __init__(self, target_model, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        embed = target_model.get_input_embeddings().weight.detach()  # [V, H]
        lm_head = target_model.get_output_embeddings().weight.detach()  # [V, H]
        is_tied = lm_head.data_ptr() == embed.data_ptr() and lm_head.shape == embed.shape
        self.embed_weight = embed.to(self.device)
        self.lm_head_weight = self.embed_weight if is_tied else lm_head.to(self.device)  # tied: one copy
        self.vocab_size = self.lm_head_weight.shape[0]
        self.data_token_ids: torch.Tensor | None = None  # [V_data] sorted
        self.other_token_ids: torch.Tensor | None = None  # [V - V_data]
        self.num_negatives = 0

    def restrict_softmax(self, token_ids: torch.Tensor | None, num_negatives: int = 8192) -> None:
        if token_ids is None:
            self.data_token_ids = self.other_token_ids = None
            return
        self.data_token_ids = torch.unique(token_ids.to(self.device))  # sorted
        is_other = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
        is_other[self.data_token_ids] = False
        self.other_token_ids = is_other.nonzero().squeeze(1)
        self.num_negatives = min(num_negatives, self.other_token_ids.numel())

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V]."""
        return hidden @ self.lm_head_weight.T

    def columns_of(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [...] as columns of `training_logits` (a data token's column; clamped for the others) and
        whether each is a data token [...] bool (under the full softmax: the ids themselves, all found). Other
        tokens may be among a step's random negatives, but never at a known column."""
        if self.data_token_ids is None:
            return token_ids, torch.ones_like(token_ids, dtype=torch.bool)
        columns = torch.searchsorted(self.data_token_ids, token_ids).clamp(max=self.data_token_ids.numel() - 1)
        return columns, self.data_token_ids[columns] == token_ids

    def training_logits(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over this step's softmax vocabulary [M, V'] and the labels as columns of it [M]."""
        if self.data_token_ids is None:
            return hidden @ self.lm_head_weight.T, labels
        pick = torch.randperm(self.other_token_ids.numel(), device=self.device)[: self.num_negatives]
        columns = torch.cat([self.data_token_ids, self.other_token_ids[pick]])  # [V'] (data tokens first)
        label_columns, found = self.columns_of(labels)
        if labels.device.type == "cpu":
            if not bool(found.all()):
                raise ValueError("a label is outside the training data's vocabulary")
        else:  # checked on the device: reading `found` back would stall every step
            torch._assert_async(found.all(), "a label is outside the training data's vocabulary")
        return hidden @ self.lm_head_weight[columns].T, label_columns


def label_is_top(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[M] bool: the label's logit is its row's maximum (a tie counts as correct). Not `argmax() == labels`: on CPU
    bfloat16 logits argmax took 7% of a training step, amax 0.4%."""
    return logits.gather(1, labels.unsqueeze(1)).squeeze(1) >= logits.amax(-1)


def block_loss(
    drafter: DFlashDraftModel,
    head: FrozenTargetHead,
    features: torch.Tensor,
    batch: BlockBatch,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    soft_target_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted cross-entropy over the labelled block positions (plus `soft_target_weight` x the soft-target term,
    given `soft_targets`: the target's top-k ids and log-probabilities at each labelled row, [M, K] each), and
    statistics as 0-d tensors on the batch's device (`loss`: the cross-entropy on the labels alone, `acc`, `acc_k1`:
    read them back together, once; nothing here waits for the device)."""
    context = drafter.project_context(features)  # [B, C, H]
    hidden = drafter(
        head.embed(batch.block_token_ids), context, batch.block_positions, batch.context_positions, batch.attention_mask
    )  # [B, S, H]
    rows = batch.labelled_rows  # [M]
    # only where there is a label: the LM head dominates the cost
    logits, labels = head.training_logits(
        hidden.flatten(0, 1).index_select(0, rows), batch.labels.reshape(-1).index_select(0, rows)
    )  # [M, V'], [M]
    weights = batch.loss_weights.reshape(-1).index_select(0, rows)  # [M]
    ce = F.cross_entropy(logits, labels, reduction="none")  # [M]
    label_loss = (ce * weights).sum() / weights.sum()
    loss = label_loss
    if soft_targets is not None and soft_target_weight > 0:
        loss = loss + soft_target_weight * (soft_target_ce(logits, head, *soft_targets) * weights).sum() / weights.sum()
    with torch.no_grad():
        is_correct = label_is_top(logits, labels)  # [M]
        is_k1 = batch.block_offsets.reshape(-1).index_select(0, rows) == 1  # [M]
        stats = {
            "loss": label_loss.detach().float(),
            "acc": is_correct.float().mean(),
            "acc_k1": (is_correct & is_k1).sum() / is_k1.sum().clamp(min=1),  # 0 when no block position 1
        }
    return loss, stats


def soft_target_ce(
    logits: torch.Tensor, head: FrozenTargetHead, top_ids: torch.Tensor, top_logprobs: torch.Tensor
) -> torch.Tensor:
    """[M] cross-entropy of the drafter's softmax (`logits` [M, V'] over the step's columns) against the target's
    distribution, known at its top-k tokens (`top_ids`, `top_logprobs` [M, K]) and renormalised over those the
    softmax holds. The greedy label is the target's top token and always a data token, so no row is left empty."""
    columns, found = head.columns_of(top_ids)  # [M, K]
    target = torch.softmax(top_logprobs.masked_fill(~found, float("-inf")), dim=-1)  # [M, K]
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, columns)  # [M, K]
    return -(target * log_q.masked_fill(~found, 0.0)).sum(-1)


def make_batch(
    sequences: list[Sequence],
    reader: FeatureReader | DataSetReader,
    config: DFlashConfig,
    max_anchors: int,
    rng: random.Random,
    gamma: float | None,
    with_soft_targets: bool = False,
) -> tuple[torch.Tensor, BlockBatch, tuple[torch.Tensor, torch.Tensor] | None]:
    """Features [B, C, F], the blocks, and (`with_soft_targets`) the target's top-k at each labelled row, in the
    order of `batch.labelled_rows` ([M, K] ids, [M, K] log-probabilities)."""
    anchors = [sample_anchors(s.prompt_length, len(s.token_ids), max_anchors, rng) for s in sequences]
    features = pad_features([reader(s) for s in sequences])  # [B, C, F]
    batch = build_block_batch([s.token_ids for s in sequences], anchors, config.block_size, config.mask_token_id, gamma)
    if not with_soft_targets:
        return features, batch, None
    tops = [reader.soft_targets(s) for s in sequences]  # per sequence ([R_b, K], [R_b, K])
    num_responses, k = max(ids.shape[0] for ids, _ in tops), tops[0][0].shape[1]
    top_ids = torch.zeros((len(sequences), num_responses, k), dtype=torch.long)  # [B, R, K] padded
    top_logprobs = torch.zeros((len(sequences), num_responses, k))
    for b, (ids, logprobs) in enumerate(tops):
        top_ids[b, : ids.shape[0]], top_logprobs[b, : ids.shape[0]] = ids, logprobs
    rows = batch.labelled_rows  # [M] into B * S
    owner = rows // batch.labels.shape[1]  # [M]
    prompt_lengths = torch.tensor([s.prompt_length for s in sequences])
    response_index = batch.label_positions.reshape(-1)[rows] - prompt_lengths[owner]  # [M]
    return features, batch, (top_ids[owner, response_index], top_logprobs[owner, response_index])


def compute_precision(device: torch.device, dtype: torch.dtype):
    """The context of a training forward: autocast to `dtype` (float32 master weights), or plain float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def to_cpu(value):
    """Tensors (in dicts, lists, tuples) moved to the CPU: checkpoints load on any device."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def lr_factor(progress: float, warmup_fraction: float) -> float:
    """Linear warmup over the first `warmup_fraction` of training, then cosine decay to 0 at progress 1."""
    if progress < warmup_fraction:
        return max(progress, 1e-3) / warmup_fraction
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup_fraction) / (1.0 - warmup_fraction))))


def training_progress(step: int, hours: float, train_config: TrainConfig) -> float:
    """Fraction of training done: by steps, or by time when a time budget is set and runs out first (on a shared
    CPU the step rate is unknown in advance; the schedule still anneals by the deadline)."""
    progress = step / train_config.max_steps
    if train_config.max_hours is not None:
        progress = max(progress, hours / train_config.max_hours)
    return min(1.0, progress)


# Keys of a DFlash config that differ between a drafter and the same drafter grown by layers.
_DEPTH_KEYS = {"num_hidden_layers": 0, "layer_types": 0, "max_window_layers": 0, "block_size": 0}


def _differences(theirs: dict, ours: dict) -> str:
    """'key: theirs (there) vs ours (now)' for every key whose value differs, for an error message."""
    keys = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    return "; ".join(f"{k} {theirs.get(k)!r} there vs {ours.get(k)!r} now" for k in keys)


# What may change between a training run and its resumption: where it is (a moved folder), how often it saves, and
# its budget (a longer run continues the same schedule's arithmetic).
RESUMABLE_KEYS = ("out_dir", "checkpoint_every", "max_steps", "max_hours")

# Written next to the exported drafter at every save: which step its weights are from, and their hash, so that
# the eval step's tau and the ship step's manifest can name the weights they describe.
TRAINING_STATE_NAME = "training_state.json"


def weights_sha256(drafter_dir: Path) -> str:
    import hashlib

    return hashlib.sha256((Path(drafter_dir) / "model.safetensors").read_bytes()).hexdigest()


def grow_drafter(drafter: DFlashDraftModel, init: DFlashDraftModel, name: str) -> None:
    """`drafter` starts as `init`: the same weights, and where `drafter` is larger, new parts that add nothing yet,
    so that the grown drafter computes exactly what `init` does and training starts from there. The block size may
    differ (the weights do not depend on it). Two ways to grow, alone or together:
    - more layers ("--num-draft-layers 3 --init-from <a 2-layer drafter>"): the extra layers (after init's) get zero
      output projections (o_proj, down_proj), so they add nothing to the residual stream;
    - more target layers to condition on ("--target-layer-ids 1 4 8 14 20 27 --init-from <a drafter on 1 14 27>";
      init's target layers must all be among them): `fc` takes init's columns for init's layers, wherever they now
      sit in the concatenated features, and zero columns for the new ones, so the context projection is unchanged."""
    init_ids = list(init.config.target_layer_ids)
    own_ids = list(drafter.config.target_layer_ids)
    if init_ids != own_ids and not set(init_ids) < set(own_ids):
        raise ValueError(
            f"{name} is conditioned on target layers {init_ids}: a drafter grown from it must condition on all of "
            f"them (and may add others), not on {own_ids}"
        )
    init_keys, own_keys = _shape_keys(init.config), _shape_keys(drafter.config)
    if init_keys != own_keys:
        raise ValueError(f"{name} does not match the drafter being trained: {_differences(init_keys, own_keys)}")
    num_init, num_layers = init.config.num_hidden_layers, drafter.config.num_hidden_layers
    if num_init > num_layers:
        raise ValueError(f"{name} has {num_init} layers, more than the {num_layers} of the drafter being trained")
    init_state = dict(init.state_dict())
    init_fc = init_state.pop("fc.weight")  # [H, len(init_ids) * H]
    missing, unexpected = drafter.load_state_dict(init_state, strict=False)
    if unexpected or any(
        k != "fc.weight" and (not k.startswith("layers.") or int(k.split(".")[1]) < num_init) for k in missing
    ):
        raise ValueError(f"{name}: weights do not match the drafter being trained ({missing}, {unexpected})")
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        for i, layer_id in enumerate(init_ids):
            j = own_ids.index(layer_id)
            drafter.fc.weight[:, j * hidden : (j + 1) * hidden] = init_fc[:, i * hidden : (i + 1) * hidden]
        for layer in drafter.layers[num_init:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _shape_keys(config: DFlashConfig) -> dict:
    """A drafter's config without what `grow_drafter` may change (its depth, block size and target layers)."""
    keys = config.to_dict() | _DEPTH_KEYS
    dflash = dict(keys.get("dflash_config") or {})
    dflash.pop("target_layer_ids", None)
    return keys | {"dflash_config": dflash}


def train(
    data_dirs: Path | list[Path],
    target: str,
    train_config: TrainConfig,
    num_threads: int = 1,
    max_seconds: float | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Train (or resume) a drafter on `device`, computing in `dtype` (see the module docstring), on the responses of
    one data directory or of several together; writes out_dir/checkpoint.pt, out_dir/log.jsonl and
    out_dir/drafter/."""
    from tqdm import tqdm

    from ddtree.training.target import load_target, resolve_device

    device = resolve_device(device)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    torch.set_num_threads(num_threads)
    data_dirs = [Path(data_dirs)] if isinstance(data_dirs, (str, Path)) else [Path(d) for d in data_dirs]
    for data_dir in data_dirs:
        if "stored_layer_ids" not in _read_json(data_dir / "manifest.json"):
            raise ValueError(f"{data_dir} holds no generated data: run the prompts and generate steps first")
        if not read_sequences(data_dir):
            raise ValueError(f"no responses in {data_dir}: run the generate step first")
    out_dir = Path(train_config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_model, _ = load_target(target, dtype=dtype)
    head = FrozenTargetHead(target_model, device)
    config = drafter_config_for(target_model.config, train_config)
    target_final_norm = target_model.model.norm.weight.detach().float().clone()  # [H]
    del target_model
    gamma = train_config.gamma if train_config.gamma is not None else default_gamma(train_config.block_size)
    if not train_config.soft_target_weight >= 0:
        raise ValueError(f"soft_target_weight must be >= 0, got {train_config.soft_target_weight}")
    with_soft_targets = train_config.soft_target_weight > 0
    without = [d for d in data_dirs if not _read_json(d / "manifest.json").get("soft_target_top_k")]
    if with_soft_targets and without:
        raise ValueError(
            f"{without[0]} holds no soft targets (made without them): train without --soft-target-weight, or "
            f"generate data with --soft-target-top-k into a new --data-dir"
        )

    torch.manual_seed(train_config.seed)
    drafter = DFlashDraftModel(config)  # made on the CPU: the same initial weights on every device
    if train_config.init_from is not None:
        from ddtree.models.dflash import load_dflash

        _, init_drafter = load_dflash(train_config.init_from)
        grow_drafter(drafter, init_drafter, str(train_config.init_from))
    else:
        with torch.no_grad():
            # The drafter's output feeds the target's LM head: start at the scale the head expects (the target's
            # final norm) rather than unit scale.
            drafter.norm.weight.copy_(target_final_norm)
    drafter.to(device)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=train_config.lr, betas=(0.9, 0.95), weight_decay=train_config.weight_decay
    )
    step, seconds_trained, epoch = 0, 0.0, 0
    checkpoint_path = out_dir / "checkpoint.pt"
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        # (a setting added since the checkpoint was written had its default then)
        theirs = asdict(TrainConfig(out_dir=train_config.out_dir)) | state["train_config"]
        theirs = {k: v for k, v in theirs.items() if k not in RESUMABLE_KEYS}
        ours = {k: v for k, v in asdict(train_config).items() if k not in RESUMABLE_KEYS}
        if theirs != ours:
            raise ValueError(
                f"{checkpoint_path} was trained with other settings ({_differences(theirs, ours)}): "
                f"resume with the same ones, or train into a new --out-dir"
            )
        drafter.load_state_dict(state["model"])  # copied onto the device
        optimizer.load_state_dict(state["optimizer"])  # moves the moments to the parameters' device
        # a resumed run starts a fresh epoch: the data set may have grown, so the old order cannot be continued
        step, seconds_trained, epoch = state["step"], state["seconds_trained"], state["epoch"] + 1
        print(f"[train] resumed at step {step} ({seconds_trained / 3600:.2f} h trained)", flush=True)
        log_path = out_dir / "log.jsonl"
        if log_path.exists():  # steps logged after the last checkpoint are trained again: drop their lines
            kept = [r for r in read_jsonl(log_path) if r["step"] <= step]  # (and a line cut by a crash)
            log_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    else:
        (out_dir / "log.jsonl").unlink(missing_ok=True)  # a run stopped before its first checkpoint starts over

    # off the CPU, features travel as the stored bf16 (half the bytes) and become float32 on the device
    reader = DataSetReader(
        data_dirs, config.target_layer_ids, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16
    )
    drafter.train()
    start = time.time()
    progress = tqdm(total=train_config.max_steps, initial=step, desc="train", dynamic_ncols=True)
    log_file = open(out_dir / "log.jsonl", "a")
    running: dict[str, float] = {}
    # The last step's log record, its statistics still on the device: they are read back after the next step is
    # queued, so on a GPU the host builds the next batch while the device computes (the only wait is for a step
    # that has already finished). On a CPU it changes nothing but when the line is written.
    pending: tuple[dict, list[torch.Tensor]] | None = None

    def write_pending_log() -> None:
        nonlocal pending
        if pending is None:
            return
        record, values = pending
        pending = None
        loss_value, acc, acc_k1, grad_norm_value = torch.stack(values).tolist()  # the one wait for the device
        stats = {"loss": loss_value, "acc": acc, "acc_k1": acc_k1, "num_labels": record.pop("num_labels")}
        for key in ("loss", "acc", "acc_k1"):
            running[key] = stats[key] if key not in running else 0.98 * running[key] + 0.02 * stats[key]
        progress.update(1)
        progress.set_postfix(
            loss=f"{running['loss']:.3f}",
            acc=f"{running['acc']:.3f}",
            acc1=f"{running['acc_k1']:.3f}",
            ep=record["epoch"],
            n=record["num_sequences"],
        )
        log_file.write(
            json.dumps(
                {
                    "step": record["step"],
                    "epoch": record["epoch"],
                    "num_sequences": record["num_sequences"],
                    "lr": record["lr"],
                    "grad_norm": grad_norm_value,
                    "hours": record["hours"],
                    **stats,
                }
            )
            + "\n"
        )
        log_file.flush()

    def save_checkpoint() -> None:
        write_pending_log()  # a checkpoint's log holds every step it has trained
        tmp = checkpoint_path.with_suffix(".tmp")
        torch.save(
            {
                "model": to_cpu(drafter.state_dict()),
                "optimizer": to_cpu(optimizer.state_dict()),
                "step": step,
                "epoch": epoch,
                "seconds_trained": seconds_trained + time.time() - start,
                "train_config": asdict(train_config),
                "drafter_config": config.to_dict(),
            },
            tmp,
        )
        tmp.replace(checkpoint_path)
        save_dflash(drafter, config, out_dir / "drafter")
        hours_now = (seconds_trained + time.time() - start) / 3600
        (out_dir / "drafter" / TRAINING_STATE_NAME).write_text(
            json.dumps(
                {"step": step, "hours": round(hours_now, 4), "weights_sha256": weights_sha256(out_dir / "drafter")}
            )
            + "\n"
        )

    first_step = step
    try:
        while training_progress(step, (seconds_trained + time.time() - start) / 3600, train_config) < 1.0:
            # The data set is read again every epoch: generation may still be appending to it.
            sequences = [
                s
                for data_dir in data_dirs
                for s in read_sequences(data_dir)
                if not is_validation(s.prompt_id, train_config.validation_fraction)
            ]
            if len(sequences) < train_config.batch_size:
                raise ValueError(
                    f"{len(sequences)} training sequences in {', '.join(map(str, data_dirs))}, fewer than one batch "
                    f"(--train-batch-size {train_config.batch_size}): generate more first"
                )
            if train_config.is_softmax_restricted:
                # every label is a response token; at inference the drafter drafts over them (the draft vocabulary)
                labels = sorted({t for s in sequences for t in s.token_ids[s.prompt_length :]})
                head.restrict_softmax(torch.tensor(labels), train_config.num_negatives)
            rng = random.Random(train_config.seed * 1_000_003 + epoch)
            rng.shuffle(sequences)
            for first in range(0, len(sequences) - train_config.batch_size + 1, train_config.batch_size):
                hours = (seconds_trained + time.time() - start) / 3600
                progress_done = training_progress(step, hours, train_config)
                if progress_done >= 1.0 or (max_seconds is not None and time.time() - start > max_seconds):
                    break
                for group in optimizer.param_groups:
                    group["lr"] = train_config.lr * lr_factor(progress_done, train_config.warmup_fraction)
                features, batch, soft = make_batch(
                    sequences[first : first + train_config.batch_size],
                    reader,
                    config,
                    train_config.max_anchors,
                    rng,
                    gamma,
                    with_soft_targets,
                )
                features, batch = features.to(device, non_blocking=True).float(), batch.to(device)
                if soft is not None:
                    soft = tuple(t.to(device, non_blocking=True) for t in soft)
                with compute_precision(device, dtype):
                    loss, stats = block_loss(drafter, head, features, batch, soft, train_config.soft_target_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), train_config.grad_clip)
                optimizer.step()
                step += 1
                write_pending_log()  # the previous step's, finished while this step's batch was built
                pending = (
                    {
                        "step": step,
                        "epoch": epoch,
                        "num_sequences": len(sequences),
                        "lr": optimizer.param_groups[0]["lr"],
                        "hours": (seconds_trained + time.time() - start) / 3600,
                        "num_labels": int(batch.labelled_rows.numel()),
                    },
                    [stats["loss"], stats["acc"], stats["acc_k1"], grad_norm.float()],
                )
                if step % train_config.checkpoint_every == 0:
                    save_checkpoint()
            else:
                epoch += 1
                continue
            break
        save_checkpoint()
    except KeyboardInterrupt:  # Ctrl-C: keep what this run trained; the next run resumes from it
        if step > first_step:
            save_checkpoint()
            print(f"\n[train] interrupted: checkpoint and drafter saved at step {step}", flush=True)
        else:  # nothing trained: no checkpoint that a corrected rerun would have to match
            print("\n[train] interrupted before a step was trained: nothing saved", flush=True)
        raise
    finally:
        progress.close()
        log_file.close()
    return out_dir / "drafter"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
