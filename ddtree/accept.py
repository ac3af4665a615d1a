"""Acceptance: walk every request's tree along the target's tokens, all requests at once.

The target's token at each packed token is its argmax (temperature 0) or one sample from its own (temperature,
top-k, top-p filtered) distribution, drawn independently per packed token. A node is accepted iff its token equals
the target's token at its parent and its parent is accepted (the root always is). The target's token at the deepest
accepted node is the bonus token.

Sample-and-match is lossless: the target's sample at the root is the first emitted token whatever the tree holds;
if it matches a child, the walk continues at that child, whose own independent sample is drawn from the target's
distribution given the path, and so on. Every emitted token is therefore a fresh sample from the target given
everything emitted before it, exactly as autoregressive sampling; the draft's probabilities are never used.

The randomness of a sample (one uniform number, turned into a token by the distribution's inverse CDF) is keyed by
(request seed, position of the packed token): every node at the same position shares it, and only one of them (the
one on the accepted path) ever decides an emitted token, so each position's token is still an independent sample.
The emitted text is then a function of the seed alone: the same with any tree, any budget, or no speculation at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddtree.packing import PackedBatch
from ddtree.sampling_params import GREEDY_TEMPERATURE

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class AcceptResult:
    """Per request: the accepted path (root excluded) and the bonus token. Emitted tokens = accepted + bonus."""

    accepted_nodes: list[list[int]]  # node indices in the request's tree, in depth order
    accepted_packed: list[list[int]]  # packed indices of the root and the accepted nodes (the KV and features kept)
    accepted_token_ids: list[list[int]]  # tokens of the accepted nodes
    bonus_token_ids: list[int]  # the target's token at the last accepted node (the root when none)

    @property
    def num_accepted(self) -> list[int]:
        """Accepted draft nodes per request (the emitted token count is one more)."""
        return [len(nodes) for nodes in self.accepted_nodes]

    def emitted_token_ids(self, r: int) -> list[int]:
        return self.accepted_token_ids[r] + [self.bonus_token_ids[r]]


def target_tokens_greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the target's argmax at every packed token (first index on ties)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    return logits.argmax(dim=-1)


def target_tokens_sampled(
    logits: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    temperature: torch.Tensor | Sequence[float],
    top_p: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int],
    seeds: Sequence[int],
) -> torch.Tensor:
    """[N, V] -> [N] int64: one independent sample per packed token from its request's filtered distribution.

    seq_index [N] gives each token's request, positions [N] its position in the sequence; temperature, top_p, top_k
    and seeds have one entry per request.
    Temperature 0 (or below GREEDY_TEMPERATURE) means greedy (argmax); top_k 0 and top_p 1.0 disable those filters
    (applied in that order, after the temperature; top-k keeps ties at the k-th logit, top-p keeps the most probable
    tokens until their mass reaches top_p). The random number behind a token is keyed by (its request's seed, its
    position): a seeded request draws the same tokens whatever else is in the batch and whatever its tree looks like.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    num_tokens, vocab = logits.shape
    num_requests = len(seeds)
    if seq_index.shape != (num_tokens,):
        raise ValueError(f"seq_index must be [{num_tokens}], got shape {tuple(seq_index.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got shape {tuple(positions.shape)}")
    temps = _per_request("temperature", temperature, num_requests, float)
    top_ps = _per_request("top_p", top_p, num_requests, float)
    top_ks = _per_request("top_k", top_k, num_requests, int)
    for r in range(num_requests):
        if not temps[r] >= 0:
            raise ValueError(f"temperature must be >= 0, got {temps[r]} for request {r}")
        if not 0 < top_ps[r] <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_ps[r]} for request {r}")
        if top_ks[r] < 0:
            raise ValueError(f"top_k must be >= 0, got {top_ks[r]} for request {r}")

    device = logits.device
    seq_index = seq_index.to(device)
    is_sampled_request = [t >= GREEDY_TEMPERATURE for t in temps]
    if not any(is_sampled_request):
        return logits.argmax(dim=-1)
    if all(is_sampled_request):
        return _sample(logits, seq_index, positions, temps, top_ps, top_ks, seeds)
    # Mixed batch: sample only the rows of sampling requests, argmax elsewhere. The rows given may all be greedy
    # requests' (the on-demand walk asks for the rows it reaches, pass by pass).
    tokens = logits.argmax(dim=-1)  # [N]
    rows = torch.tensor(is_sampled_request, device=device)[seq_index].nonzero().squeeze(1)
    if rows.numel():
        tokens[rows] = _sample(logits[rows], seq_index[rows], positions[rows], temps, top_ps, top_ks, seeds)
    return tokens


def _sample(
    logits: torch.Tensor,  # [n, V]
    seq_index: torch.Tensor,  # [n]
    positions: torch.Tensor,  # [n]
    temps: list[float],
    top_ps: list[float],
    top_ks: list[int],
    seeds: Sequence[int],
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    logits = logits.float()
    # (A temperature beyond float32's range divides by its largest value: every score ~0, the uniform limit.)
    temp_t = torch.tensor(
        [min(t, FLOAT32_MAX) if t >= GREEDY_TEMPERATURE else 1.0 for t in temps], dtype=torch.float32, device=device
    )  # [R]
    scores = logits / temp_t[seq_index, None]  # [n, V]
    # Top-k and top-p rank tokens by their logits (a temperature does not change the order, and at a huge one the
    # scores would round to ties).
    if any(k > 0 for k in top_ks):
        k_t = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=device)[seq_index]  # [n]
        top_values = logits.topk(min(max(top_ks), vocab), dim=-1).values  # [n, k_max]
        kth = top_values.gather(1, (k_t.clamp(max=top_values.shape[1]) - 1)[:, None])  # [n, 1]
        is_kept = (logits >= kth) | (k_t == vocab)[:, None]
        scores = scores.masked_fill(~is_kept, float("-inf"))
    if any(p < 1 for p in top_ps):
        p_t = torch.tensor(top_ps, dtype=torch.float32, device=device)[seq_index]  # [n]
        order = logits.argsort(dim=-1, descending=True, stable=True)  # [n, V]
        sorted_probs = scores.gather(1, order).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, V]
        is_dropped_sorted = (mass_before >= p_t[:, None]) & (p_t < 1)[:, None]
        is_dropped_sorted[:, 0] = False  # the most likely token always stays (a top_p below float32's range is 0)
        is_dropped = torch.zeros_like(is_dropped_sorted).scatter_(1, order, is_dropped_sorted)
        scores = scores.masked_fill(is_dropped, float("-inf"))
    return _inverse_cdf_sample(scores, seq_index, positions, seeds)


# Tokens per block of the inverse CDF's two-level search (a multiple of the vector width)
CDF_BLOCK = 256


def _inverse_cdf_sample(
    scores: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, seeds: Sequence[int]
) -> torch.Tensor:
    """[n, V] scores (log-probabilities up to a constant per row; -inf: filtered out) -> [n] one sample per row: the
    first token whose cumulative probability exceeds u times the row's total, where u in [0, 1) is keyed by (the row's
    request's seed, its position). One uniform per row, where an exponential race draws V of them.

    The search runs in two levels: the running sum of block sums (blocks of CDF_BLOCK tokens) finds the block, and a
    running sum inside that block finds the token. A float32 running sum over the whole vocabulary would move each
    token's share by up to an ulp of the sum (~1e-7 of the total, more than many tokens' whole probability), and a
    float64 one is a serial loop over it. Here the running sums are float64; each block's sum is a float32 one, off by
    a few ulps of the block's own mass, and that difference falls on the block's last kept token. A filtered token
    adds nothing to a sum, so it is never chosen."""
    num_rows, vocab = scores.shape
    rows_of, row_positions = torch.stack([seq_index, positions.to(seq_index.device)]).tolist()  # one host copy
    keys = [(seeds[r], position) for r, position in zip(rows_of, row_positions)]
    # 52 bits: u <= 1 - 2^-52, so u x total rounds below the total, and some block's running sum exceeds it
    uniforms = torch.tensor([_mix_seed(s, p) >> 12 for s, p in keys], dtype=torch.float64) * 2.0**-52  # [n]
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp_()  # [n, V], the largest 1
    if vocab % CDF_BLOCK:
        weights = torch.nn.functional.pad(weights, (0, -vocab % CDF_BLOCK))  # zeros: never chosen
    blocks = weights.view(num_rows, -1, CDF_BLOCK)  # [n, C, CDF_BLOCK]
    ends = blocks.sum(dim=-1).double().cumsum_(dim=-1)  # [n, C]: the mass up to each block's end
    thresholds = uniforms.to(scores.device)[:, None] * ends[:, -1:]  # [n, 1]
    block = torch.searchsorted(ends, thresholds, right=True)  # [n, 1]: first end > threshold (a block of mass)
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)  # [n, 1], <= threshold
    rows = blocks[torch.arange(num_rows, device=scores.device), block.squeeze(1)]  # [n, CDF_BLOCK]
    inside = torch.searchsorted(rows.double().cumsum(dim=-1).add_(start), thresholds, right=True)  # [n, 1]
    # The block's end (a sum) and its running sum differ in their last bits: a threshold between the two lands past
    # the block's last token, and belongs to its last token kept.
    offsets = torch.arange(CDF_BLOCK, device=scores.device)
    last_kept = torch.where(rows > 0, offsets, 0).amax(dim=-1, keepdim=True)  # [n, 1]
    return (block * CDF_BLOCK + torch.minimum(inside, last_kept)).squeeze(1)


def _mix_seed(seed: int, position: int) -> int:
    """64 random bits from (request seed, position), SplitMix64 style: nearby inputs give unrelated values."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def accept(packed: PackedBatch, target_tokens: torch.Tensor) -> AcceptResult:
    """Walk all trees at once; target_tokens [N] holds the target's token at every packed token.

    A node's "on path" flag is the AND of the matches of all its ancestors; pointer jumping computes it in
    ceil(log2(longest segment)) vectorised steps. One host transfer at the end.
    """
    num_tokens = packed.num_tokens
    if target_tokens.shape != (num_tokens,):
        raise ValueError(f"target_tokens must be [{num_tokens}], got shape {tuple(target_tokens.shape)}")
    device = packed.input_ids.device
    target_tokens = target_tokens.to(device=device, dtype=torch.int64)
    token_index = torch.arange(num_tokens, device=device)  # [N]
    seg_start = torch.tensor(packed.query_starts[:-1], device=device)[packed.seq_index]  # [N]
    is_root = packed.local_parents < 0
    jump = torch.where(is_root, token_index, seg_start + packed.local_parents)  # [N] parent (root: itself)
    is_on_path = is_root | (packed.input_ids == target_tokens[jump])  # [N] matches its parent's target token
    max_seg_len = max(packed.segment_len(r) for r in range(packed.num_requests))
    for _ in range(math.ceil(math.log2(max_seg_len))):
        is_on_path = is_on_path & is_on_path[jump]
        jump = jump[jump]

    host = torch.stack([is_on_path.long(), packed.depths, packed.input_ids, target_tokens]).cpu()  # [4, N]
    on_path = host[0].nonzero().squeeze(1)  # ancestors precede descendants: depth order within each request
    on_index = on_path.tolist()
    on_depth = host[1, on_path].tolist()
    on_token = host[2, on_path].tolist()
    on_target = host[3, on_path].tolist()

    # Split the accepted packed indices (sorted) at the segment starts.
    bounds = torch.searchsorted(on_path, torch.tensor(packed.query_starts)).tolist()
    result = AcceptResult([], [], [], [])
    for r in range(packed.num_requests):
        i, j = bounds[r], bounds[r + 1]
        if on_depth[i:j] != list(range(j - i)):
            raise ValueError(f"request {r}: siblings in its tree share a token, the accepted path is ambiguous")
        start = packed.query_starts[r]
        result.accepted_packed.append(on_index[i:j])
        result.accepted_nodes.append([p - start - 1 for p in on_index[i + 1 : j]])
        result.accepted_token_ids.append(on_token[i + 1 : j])
        result.bonus_token_ids.append(on_target[j - 1])
    return result


def accept_on_demand(
    packed: PackedBatch, target_tokens_of: Callable[[list[int]], list[int]]
) -> tuple[AcceptResult, list[int]]:
    """The walk of `accept`, asking for the target's token only at the packed tokens it reaches, so that the LM head
    runs on those rows only. Each pass asks `target_tokens_of(packed indices)`, for every request still walking, for
    its current node and the chain of first children below it (nodes are in best-first pop order, so that chain is
    the draft's most likely continuation); the walk goes on where the asked tokens take it, and a request that
    leaves the chain for another child is asked for again in the next pass. The same result as `accept` given the
    same tokens at the reached nodes. Returns it and the packed indices asked, in order (every accepted node and
    each request's root among them)."""
    num_requests, starts = packed.num_requests, packed.query_starts
    parents_local, tokens = torch.stack([packed.local_parents, packed.input_ids]).tolist()  # one host copy
    children: dict[int, dict[int, int]] = {}  # packed node -> {token: packed child}
    first_child: dict[int, int] = {}
    ambiguous: set[tuple[int, int]] = set()  # (parent, token) of siblings sharing a token
    for r in range(num_requests):
        for p in range(starts[r] + 1, starts[r + 1]):
            parent = starts[r] + parents_local[p]
            kids = children.setdefault(parent, {})
            if tokens[p] in kids:
                ambiguous.add((parent, tokens[p]))
            kids.setdefault(tokens[p], p)
            first_child.setdefault(parent, p)
    known: dict[int, int] = {}
    asked: list[int] = []
    at = [starts[r] for r in range(num_requests)]  # each walk's node whose target token is next needed
    paths = [[starts[r]] for r in range(num_requests)]
    bonus = [0] * num_requests
    walking = list(range(num_requests))
    while walking:
        need = []
        for r in walking:
            p = at[r]
            while p is not None and p not in known:
                need.append(p)
                p = first_child.get(p)
        known.update(zip(need, target_tokens_of(need)))
        asked += need
        still_walking = []
        for r in walking:
            p = at[r]
            while p in known:
                child = children.get(p, {}).get(known[p])
                if child is None:
                    bonus[r] = known[p]
                    break
                if (p, known[p]) in ambiguous:
                    raise ValueError(f"request {r}: siblings in its tree share a token, the accepted path is ambiguous")
                paths[r].append(child)
                p = child
            else:
                at[r] = p
                still_walking.append(r)
        walking = still_walking
    result = AcceptResult([], [], [], bonus)
    for r, path in enumerate(paths):
        result.accepted_packed.append(path)
        result.accepted_nodes.append([p - starts[r] - 1 for p in path[1:]])
        result.accepted_token_ids.append([tokens[p] for p in path[1:]])
    return result, asked


def _per_request(name: str, values, num_requests: int, kind: type) -> list:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    values = list(values)
    if len(values) != num_requests:
        raise ValueError(f"{name} needs one entry per request ({num_requests}), got {len(values)}")
    if kind is int and any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must hold integers, got {values!r}")
    return [kind(v) for v in values]
