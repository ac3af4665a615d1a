"""The DFlash drafter at serving time: per-request context KV caches and one batched draft forward.

The drafter shares the target's `embed_tokens` and `lm_head` (the same tensors, frozen). A request's drafter
context is every token in the target's KV cache (positions 0..n-1); for each drafter layer its cache holds K/V of
the projected target features (fc + hidden_norm, then k_proj/k_norm/rope at the context positions, and v_proj).
Since the projected context feeds every layer unchanged, these entries never need recomputing: after each verify
the engine appends the accepted tokens' target features with `add_context`.

A draft is one forward for all requests: block position 0 holds the last committed token (the root of the next
tree, not yet in the target's KV cache) at position = context length, positions 1..L hold `mask_token_id`; the
block is bidirectional and sees all of its request's context. Block positions 1..L give the top-K log-probs.

With a draft vocabulary (`draft_vocab.json` in the drafter folder, see ddtree.models.dflash) the log-probs are
over those tokens only: the LM head is the largest cost of a draft on a CPU, and the drafter never learned to
propose tokens it did not see in training. Verification is untouched, so outputs stay exactly the target's.

Public API:
    DFlashDrafter.load(path, target, device=None, dtype=None, use_draft_vocab=True) -> DFlashDrafter
                                                               (device/dtype default: the target's)
    drafter.draft_token_ids                                    [Vd] target ids the drafter proposes, None: all
    drafter.block_len                                          L = block_size - 1 drafted positions
    drafter.add_request(seq_id)                                optional; add_context creates the request too
    drafter.add_context(seq_id, features [n, F], positions [n] | None)   None: continue after the last position
    drafter.add_contexts(seq_ids, features list, positions list | None)  several requests, one projection
    drafter.draft(seq_ids, last_token_ids, max_k) -> (topk_logprobs [R, L, K] float32, topk_token_ids [R, L, K])
    drafter.free(seq_id) -> bool
    drafter.context_len(seq_id) -> int;  drafter.num_cache_bytes -> int
    drafter.measure_draft_cost(batch_sizes, max_k, num_context_tokens=128) -> list[(batch_size, seconds)]
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.models.dflash import DFlashConfig, DFlashDraftModel, attend_with_context, load_dflash, load_draft_vocab

MIN_CONTEXT_CAPACITY = 64


@dataclass
class _Context:
    # [num_layers, 2, kv_heads, capacity, head_dim], the first `length` slots valid; a draft writes its block's own
    # keys/values in the slots after them (scratch), so each head's context and block are one contiguous view
    kv: torch.Tensor
    length: int = 0
    next_position: int = 0  # position of the next token (the block's anchor)


class DFlashDrafter:
    def __init__(
        self,
        config: DFlashConfig,
        model: DFlashDraftModel,
        target,
        device=None,
        dtype=None,
        draft_token_ids: list[int] | None = None,
        cpu_kernels: bool = True,
        kernel_weight_dtype: torch.dtype | None = None,
    ):
        """`cpu_kernels` (CPU, float32): the drafter's linears and its draft-vocabulary head run on the native panel
        GEMM (ddtree.kernels), which reads each weight once per forward; a draft forward is a few rows per request,
        where torch's GEMMs run far below the memory's read rate. `kernel_weight_dtype` bfloat16 (the default where
        the CPU has AVX-512 bf16 dot products): those products take bf16-rounded inputs and weights (float32 sums;
        the shipped drafter's weights are bf16 values already), 1.3-2.1x faster than float32 panels here
        (benchmarks/bench_panel_dtype.py); the drafts' numbers move by that rounding, the output never does (the
        target's verify decides every token); float32 (the default elsewhere, where bf16 panels run a slower
        portable loop): the float32 products. Without the native kernels (or no compiler) torch's kernels. The
        `model` given is converted in place (its linears replaced): the drafter owns it, for inference only."""
        device = torch.device(device) if device is not None else target.device
        dtype = dtype or target.dtype
        tc = target.config
        if config.hidden_size != tc.hidden_size:
            raise ValueError(f"drafter hidden size {config.hidden_size} != target hidden size {tc.hidden_size}")
        if list(target.feature_layer_ids) != list(config.target_layer_ids):
            raise ValueError(
                f"the target produces features of layers {target.feature_layer_ids}, the drafter needs "
                f"{config.target_layer_ids}: load the target with feature_layer_ids=drafter target_layer_ids"
            )
        if config.vocab_size != tc.vocab_size:
            raise ValueError(
                f"drafter vocabulary size {config.vocab_size} != target vocabulary size {tc.vocab_size}: "
                f"the drafter was made for another target"
            )
        if config.num_target_layers is not None and config.num_target_layers != tc.num_hidden_layers:
            raise ValueError(
                f"the drafter was made for a target of {config.num_target_layers} layers (its "
                f"num_target_layers); this target has {tc.num_hidden_layers}"
            )
        if not 0 <= config.mask_token_id < tc.vocab_size:
            raise ValueError(f"mask_token_id {config.mask_token_id} outside the target vocabulary ({tc.vocab_size})")
        self.config = config
        self.model = model.to(device=device, dtype=dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.target = target
        self.device = device
        self.dtype = dtype
        self.block_len = config.block_size - 1
        # The block's attention: per request over its cache in place on a CPU (measured faster at every size,
        # docs/engine.md); one padded batch elsewhere (one kernel per layer rather than one per request)
        self.attends_in_place = device.type == "cpu"
        self._contexts: dict[Hashable, _Context] = {}
        self.draft_token_ids: torch.Tensor | None = None  # [Vd] int64 target token ids; None: the full vocabulary
        # [H, Vd], a copy of those columns of the target's head (a PanelLinear of it with the native ops)
        self._draft_lm_head: torch.Tensor | torch.nn.Module | None = None
        if draft_token_ids is not None:
            ids = torch.as_tensor(draft_token_ids, dtype=torch.int64)
            if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= tc.vocab_size:
                raise ValueError(f"draft_token_ids must be a non-empty list of ids in [0, {tc.vocab_size})")
            if ids.unique().numel() != ids.numel():  # two draft positions of one token: sibling nodes alike
                raise ValueError("draft_token_ids must be distinct")
            self.draft_token_ids = ids.to(device)
            self._draft_lm_head = target.lm_head[:, self.draft_token_ids].contiguous()
        self._cpu_ops = None
        if cpu_kernels and device.type == "cpu" and dtype == torch.float32 and target.dtype == torch.float32:
            from ddtree.kernels import PanelLinear, bf16_panels_pay, cpu_ops, use_panel_linears

            self._cpu_ops = cpu_ops()
            if self._cpu_ops is not None:
                if kernel_weight_dtype is None:
                    kernel_weight_dtype = torch.bfloat16 if bf16_panels_pay() else torch.float32
                use_panel_linears(self.model, self._cpu_ops, kernel_weight_dtype)
                if self._draft_lm_head is not None:
                    self._draft_lm_head = PanelLinear(self._draft_lm_head, None, self._cpu_ops, kernel_weight_dtype)

    @property
    def uses_cpu_kernels(self) -> bool:
        return self._cpu_ops is not None

    @classmethod
    def load(
        cls,
        path: str | Path,
        target,
        device=None,
        dtype=None,
        use_draft_vocab: bool = True,
        cpu_kernels: bool = True,
        kernel_weight_dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """`use_draft_vocab=False` ignores the folder's draft vocabulary (drafts over the full vocabulary)."""
        device = torch.device(device) if device is not None else target.device
        dtype = dtype or target.dtype
        config, model = load_dflash(path, device=device, dtype=dtype)
        draft_token_ids = load_draft_vocab(path, target.config.vocab_size) if use_draft_vocab else None
        return cls(config, model, target, device, dtype, draft_token_ids, cpu_kernels, kernel_weight_dtype)

    # ---- per-request context -----------------------------------------------------------------------------------
    def add_request(self, seq_id: Hashable, capacity: int = MIN_CONTEXT_CAPACITY) -> None:
        if seq_id in self._contexts:
            raise ValueError(f"request {seq_id!r} already has a drafter context")
        self._contexts[seq_id] = _Context(self._empty_kv(max(capacity, 1)))

    def context_len(self, seq_id: Hashable) -> int:
        return self._get(seq_id).length

    @property
    def num_contexts(self) -> int:
        """Requests with a context cache here."""
        return len(self._contexts)

    @property
    def num_cache_bytes(self) -> int:
        return sum(c.kv.numel() * c.kv.element_size() for c in self._contexts.values())

    def add_context(self, seq_id: Hashable, features: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append target features [n, F] of tokens now in the target's KV cache (positions default to the next
        ones after the request's context)."""
        self.add_contexts([seq_id], [features], None if positions is None else [positions])

    @torch.inference_mode()
    def add_contexts(self, seq_ids: list, features: list[torch.Tensor], positions: list | None = None) -> None:
        """`add_context` for several requests at once: one projection (fc, norm, every layer's K/V) over all their
        new tokens, which are independent rows (a round extends every drafting request by a few tokens: one small
        projection per request cost ~0.3 ms each on a CPU). Everything is checked before anything is added."""
        if len(features) != len(seq_ids) or (positions is not None and len(positions) != len(seq_ids)):
            raise ValueError(
                f"{len(seq_ids)} requests, {len(features)} feature tensors"
                + ("" if positions is None else f", {len(positions)} position lists")
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a request appears twice in one context extension")
        width = self.config.num_target_features
        for f in features:
            if f.dim() != 2 or (f.shape[0] and f.shape[1] != width):  # no rows: nothing to add, any width
                raise ValueError(f"features must be [n, {width}], got {tuple(f.shape)}")
        # Per request with new tokens: its positions on the host (given, or the next ones: no device sync).
        new: list[tuple[Hashable, torch.Tensor, torch.Tensor]] = []
        for i, (seq_id, f) in enumerate(zip(seq_ids, features)):
            ctx = self._contexts.get(seq_id)
            start = 0 if ctx is None else ctx.next_position
            if positions is None or positions[i] is None:
                pos = torch.arange(start, start + f.shape[0])
            else:
                pos = torch.as_tensor(positions[i], dtype=torch.int64).flatten().cpu()
                if pos.numel() != f.shape[0]:
                    raise ValueError(f"{f.shape[0]} features but {pos.numel()} positions")
            if f.shape[0]:
                new.append((seq_id, f, pos))
        layers_kv = []
        if new:
            rows = torch.cat([f.to(self.device, self.dtype) for _, f, _ in new]).unsqueeze(0)  # [1, T, F]
            context = self.model.project_context(rows)  # [1, T, H]
            layers_kv = self.model.context_kv(context, torch.cat([p for _, _, p in new]).to(self.device).unsqueeze(0))
        for seq_id, f in zip(seq_ids, features):  # after the projection: a failure there adds nothing
            if seq_id not in self._contexts:
                self.add_request(seq_id, max(MIN_CONTEXT_CAPACITY, 2 * f.shape[0]))
        offset = 0
        for seq_id, f, pos in new:
            ctx, n = self._contexts[seq_id], f.shape[0]
            self._ensure_capacity(ctx, ctx.length + n)
            for layer, (k, v) in enumerate(layers_kv):  # [1, T, kv_heads, head_dim]
                ctx.kv[layer, 0, :, ctx.length : ctx.length + n] = k[0, offset : offset + n].transpose(0, 1)
                ctx.kv[layer, 1, :, ctx.length : ctx.length + n] = v[0, offset : offset + n].transpose(0, 1)
            ctx.length += n
            ctx.next_position = int(pos[-1]) + 1  # a host tensor: no device sync
            offset += n

    def free(self, seq_id: Hashable) -> bool:
        return self._contexts.pop(seq_id, None) is not None

    # ---- drafting -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, seq_ids: list, last_token_ids: list[int], max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward for all requests: top-`max_k` log-probs and token ids [R, L, K] at block positions 1..L."""
        if len(seq_ids) != len(last_token_ids) or not seq_ids:
            raise ValueError("draft needs one last token per request")
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        contexts = [self._get(s) for s in seq_ids]
        num_requests, block = len(seq_ids), self.config.block_size
        ids = torch.full((num_requests, block), self.config.mask_token_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor(last_token_ids, dtype=torch.int64)
        starts = torch.tensor([c.next_position for c in contexts], dtype=torch.int64)
        block_positions = (starts.unsqueeze(1) + torch.arange(block)).to(self.device)  # [R, S]
        block_hidden = self.target.embed(ids.to(self.device)).to(self.dtype)  # [R, S, H]
        if self.attends_in_place:
            for c in contexts:
                self._ensure_capacity(c, c.length + block)  # room for the block's keys/values after the context
            attends = [self._cached_attention(layer, contexts) for layer in range(self.config.num_hidden_layers)]
        else:
            attends = self._padded_attention(contexts)
        h = self.model.forward_with_attention(block_hidden, block_positions, attends)  # [R, S, H]
        hidden = h[:, 1:].to(self.target.dtype)  # [R, L, H]
        if self._draft_lm_head is None:
            logits = self.target.project_logits(hidden).float()  # [R, L, V]
        elif isinstance(self._draft_lm_head, torch.Tensor):
            logits = (hidden @ self._draft_lm_head).float()  # [R, L, Vd]
        else:
            logits = self._draft_lm_head(hidden)  # [R, L, Vd], the native panel GEMM
        # A NaN (an overflow in a low-precision drafter) becomes a zero-probability draft: the request's tree is
        # worthless that round but still verified exactly, instead of the tree builder failing every request.
        logprobs = torch.log_softmax(logits, dim=-1).nan_to_num_(nan=float("-inf"))
        top = torch.topk(logprobs, min(max_k, logprobs.shape[-1]), dim=-1)
        if self.draft_token_ids is None:
            return top.values, top.indices
        return top.values, self.draft_token_ids[top.indices]  # draft-vocab positions -> target token ids

    def _padded_attention(self, contexts: list[_Context]) -> list:
        """Per layer, the block's attention over the requests' contexts copied into one padded batch ([R, C_max]
        keys, masked where a context is shorter): one attention call per layer, where `_cached_attention` makes
        one per request (a GPU would launch R small kernels per layer; not measured on one)."""
        lengths = [c.length for c in contexts]
        max_len, cfg = max(lengths), self.config
        padded = torch.zeros(
            cfg.num_hidden_layers,
            2,
            len(contexts),
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
        )  # [L, 2, R, kv_heads, C_max, head_dim]
        for r, c in enumerate(contexts):
            padded[:, :, r, :, : c.length] = c.kv[:, :, :, : c.length]
        mask = None
        if min(lengths) != max_len:
            block = cfg.block_size
            cols = torch.arange(max_len + block, device=self.device)
            lens = torch.tensor(lengths, device=self.device).view(-1, 1)
            visible = (cols.unsqueeze(0) < lens) | (cols.unsqueeze(0) >= max_len)  # [R, C_max + S]
            mask = visible.unsqueeze(1).expand(len(contexts), block, max_len + block)
        keys_values = padded.transpose(3, 4)  # [L, 2, R, C_max, kv_heads, head_dim]
        return [attend_with_context(keys_values[i, 0], keys_values[i, 1], mask) for i in range(cfg.num_hidden_layers)]

    def _cached_attention(self, layer: int, contexts: list[_Context]):
        """The block's attention for one layer, per request over its cache read in place: the block's keys/values
        go in the slots after the context, and the block (bidirectional, seeing its whole context) attends to the
        view of both, with no mask. Padding the requests' contexts to one batch would copy every context each draft,
        and its masked attention runs slower (docs/engine.md)."""
        gqa = self.config.num_attention_heads != self.config.num_key_value_heads

        def attend(q: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor) -> torch.Tensor:
            s = q.shape[1]
            outs = []
            for r, c in enumerate(contexts):
                cache = c.kv[layer]  # [2, kv_heads, capacity, head_dim]
                cache[0, :, c.length : c.length + s] = block_k[r].transpose(0, 1)
                cache[1, :, c.length : c.length + s] = block_v[r].transpose(0, 1)
                keys, values = cache[:, :, : c.length + s].unsqueeze(1)  # [1, kv_heads, C + S, head_dim] each
                outs.append(
                    F.scaled_dot_product_attention(q[r : r + 1].transpose(1, 2), keys, values, enable_gqa=gqa)
                )  # [1, heads, S, head_dim]
            return torch.cat(outs).transpose(1, 2)  # [R, S, heads, head_dim]

        return attend

    def measure_draft_cost(
        self, batch_sizes: list[int], max_k: int, num_context_tokens: int = 128, num_repeats: int = 3
    ) -> list[tuple[int, float]]:
        """Seconds of one draft forward per batch size, with random contexts of `num_context_tokens` tokens."""
        gen = torch.Generator().manual_seed(0)
        curve = []
        for size in batch_sizes:
            ids = [("__cost__", i) for i in range(size)]
            try:
                for s in ids:
                    feats = torch.randn(num_context_tokens, self.config.num_target_features, generator=gen)
                    self.add_context(s, feats)
                best = float("inf")
                for _ in range(num_repeats):
                    start = time.perf_counter()
                    self.draft(ids, [0] * size, max_k)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - start)
                curve.append((size, best))
            finally:
                for s in ids:
                    self.free(s)
        return curve

    # ---- internals ----------------------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Context:
        ctx = self._contexts.get(seq_id)
        if ctx is None:
            raise ValueError(f"request {seq_id!r} has no drafter context")
        return ctx

    def _empty_kv(self, capacity: int) -> torch.Tensor:
        cfg = self.config
        return torch.empty(
            cfg.num_hidden_layers,
            2,
            cfg.num_key_value_heads,
            capacity,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
        )

    def _ensure_capacity(self, ctx: _Context, needed: int) -> None:
        capacity = ctx.kv.shape[3]
        if needed <= capacity:
            return
        grown = self._empty_kv(max(needed, 2 * capacity))  # doubling: amortised O(1) copies per token
        grown[:, :, :, : ctx.length] = ctx.kv[:, :, :, : ctx.length]
        ctx.kv = grown
