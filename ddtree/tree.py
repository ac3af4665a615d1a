"""Optimal draft trees (DDTree).

Under a factorised draft distribution Q(y) = prod_i q_i(y_i), the expected acceptance length of a tree T is
sum_{u in T} q(u), with q(u) the probability of prefix u. The best tree of B nodes is therefore the set of the B
most probable prefixes; it is prefix-closed because a prefix is at least as probable as any of its extensions.
Only the per-position top-K tokens, K = min(B, V), can appear (a token of rank j has j more probable siblings).

Order and ties (one rule, shared by the reference heap and the batched builder):
- Within a position, tokens are ranked by decreasing log-prob, equal log-probs by increasing token id. When
  several tokens tie at the K-th value, which of them enter the top-K follows `torch.topk`; the trees' expected
  acceptance does not depend on it.
- Path log-probs are accumulated in float64, parent first (`lp(child) = lp(parent) + logprob[depth, token]`),
  so the heap and the batched builder compute bit-identical sums; DraftTree stores them as float32.
- Nodes are ordered by the key (-path_logprob, depth, parent's rank within its depth, token rank): equal
  probabilities go shallower first, then by the order of their parents, then by token rank. A parent precedes its
  children and a token precedes its lower-ranked siblings under this key, so every prefix of the order is a
  prefix-closed tree, and the heap pops exactly this order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """One request's draft tree, nodes in best-first pop order (every parent precedes its children).

    The root (the request's last committed token) is implicit: it is not a node.
    """

    token_ids: torch.Tensor  # [num_nodes] int64
    parents: torch.Tensor  # [num_nodes] int64: index of the parent node, -1 for children of the root
    depths: torch.Tensor  # [num_nodes] int64 in 1..L
    path_logprobs: torch.Tensor  # [num_nodes] float: sum of draft log-probs along the path

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.numel())

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        """The tree of an autoregressive step: no nodes, only the root."""
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return DraftTree(z, z.clone(), z.clone(), torch.zeros(0, dtype=torch.float32, device=device))


@dataclass
class PaddedTrees:
    """Many requests' trees as padded tensors; row r holds request r's first num_nodes[r] nodes in pop order."""

    token_ids: torch.Tensor  # [R, max_nodes] int64, -1 past num_nodes[r]
    parents: torch.Tensor  # [R, max_nodes] int64, -1 for children of the root and past num_nodes[r]
    depths: torch.Tensor  # [R, max_nodes] int64, 0 past num_nodes[r]
    path_logprobs: torch.Tensor  # [R, max_nodes] float32, -inf past num_nodes[r]
    num_nodes: list[int]  # [R]

    def to_list(self) -> list[DraftTree]:
        return [
            DraftTree(self.token_ids[r, :n], self.parents[r, :n], self.depths[r, :n], self.path_logprobs[r, :n])
            for r, n in enumerate(self.num_nodes)
        ]


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k: values [R, L, k] in decreasing order (ties: lower token id first), token_ids [R, L, k]."""
    if logprobs.dim() != 3:
        raise ValueError(f"logprobs must be [R, L, V], got shape {tuple(logprobs.shape)}")
    _check_int("k", k, minimum=1)
    if k > logprobs.shape[-1]:
        raise ValueError(f"k={k} exceeds the vocabulary size {logprobs.shape[-1]}")
    values, token_ids = torch.topk(logprobs, k, dim=-1, sorted=True)  # [R, L, k] each
    # torch.topk orders equal values arbitrarily: put them in token id order so that ranks are reproducible.
    by_id = token_ids.argsort(dim=-1)
    values, token_ids = values.gather(-1, by_id), token_ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), token_ids.gather(-1, by_value)


def build_tree(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The reference DDTree builder: a best-first heap over rank tuples, in Python. logprobs: [L, V]."""
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError(f"logprobs must be a 2-D tensor [L, V], got {getattr(logprobs, 'shape', logprobs)!r}")
    _check_int("budget", budget, minimum=0)
    if logprobs.shape[0] == 0 or logprobs.shape[1] == 0 or budget == 0:
        return DraftTree.empty(logprobs.device)
    _check_logprob_values(logprobs)
    values, token_ids = topk_logprobs(logprobs.unsqueeze(0), min(budget, logprobs.shape[1]))
    return build_tree_from_topk(values[0], token_ids[0], budget)


def build_tree_from_topk(values: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    """The heap of `build_tree`, from one request's top-K: values [L, K] (decreasing per row), token_ids [L, K]."""
    if values.dim() != 2 or values.shape != token_ids.shape:
        raise ValueError(f"values and token_ids must both be [L, K], got {tuple(values.shape)}, {tuple(token_ids.shape)}")
    _check_int("budget", budget, minimum=0)
    device = values.device
    max_depth, num_ranks = values.shape
    if budget == 0 or max_depth == 0 or num_ranks == 0:
        return DraftTree.empty(device)
    v = values.double().tolist()  # float64, as the batched builder sums
    ids = token_ids.tolist()
    # Entry: (-path_logprob, depth, parent's rank within its depth, token rank, parent node, parent path_logprob).
    # The first four fields identify a node, so ties never compare further.
    heap = [(-(0.0 + v[0][0]), 1, 0, 0, -1, 0.0)]
    num_popped_at_depth = [0] * (max_depth + 1)
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_depths: list[int] = []
    out_logprobs: list[float] = []
    while heap and len(out_tokens) < budget:
        neg_lp, depth, parent_order, rank, parent, parent_lp = heapq.heappop(heap)
        node, lp = len(out_tokens), -neg_lp
        order_in_depth = num_popped_at_depth[depth]
        num_popped_at_depth[depth] += 1
        out_tokens.append(ids[depth - 1][rank])
        out_parents.append(parent)
        out_depths.append(depth)
        out_logprobs.append(lp)
        if rank + 1 < num_ranks:  # next sibling
            heapq.heappush(heap, (-(parent_lp + v[depth - 1][rank + 1]), depth, parent_order, rank + 1, parent, parent_lp))
        if depth < max_depth:  # first child
            heapq.heappush(heap, (-(lp + v[depth][0]), depth + 1, order_in_depth, 0, node, lp))
    return DraftTree(
        token_ids=torch.tensor(out_tokens, dtype=torch.int64, device=device),
        parents=torch.tensor(out_parents, dtype=torch.int64, device=device),
        depths=torch.tensor(out_depths, dtype=torch.int64, device=device),
        path_logprobs=torch.tensor(out_logprobs, dtype=torch.float64, device=device).float(),
    )


def build_trees(logprobs: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """Batched `build_tree` for R requests: logprobs [R, L, V], one budget per request."""
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 3:
        raise ValueError(f"logprobs must be a 3-D tensor [R, L, V], got {getattr(logprobs, 'shape', logprobs)!r}")
    budgets = _check_budgets(budgets, logprobs.shape[0])
    num_ranks = min(max(budgets, default=0), logprobs.shape[2])
    if num_ranks == 0:
        return [DraftTree.empty(logprobs.device) for _ in budgets]
    values, token_ids = topk_logprobs(logprobs, num_ranks)
    return build_trees_from_topk(values, token_ids, budgets)


def build_trees_from_topk(values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """Batched builder from `topk_logprobs` output (K >= min(max(budgets), V)); the same trees as the heap."""
    return build_padded_trees(values, token_ids, budgets).to_list()


def build_padded_trees(values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> PaddedTrees:
    """The batched builder: vectorised over requests and nodes, a loop over depths, one host sync at the end.

    values [R, L, K] decreasing along K, token_ids [R, L, K]. Depth by depth, the candidates are (kept nodes of the
    previous depth) x (token ranks), pruned by (i + 1)(j + 1) <= B for parent rank i and token rank j (the i + 1
    better parents' and j + 1 better tokens' combinations all come first); each depth keeps its first B nodes in
    order. The B best nodes overall are the first B of all kept nodes, which a stable sort puts in pop order.
    """
    if values.dim() != 3 or values.shape != token_ids.shape:
        raise ValueError(
            f"values and token_ids must both be [R, L, K], got {tuple(values.shape)}, {tuple(token_ids.shape)}"
        )
    num_requests, max_depth, num_ranks = values.shape
    budgets = _check_budgets(budgets, num_requests)
    device = values.device
    max_budget = max(budgets, default=0)
    if max_budget == 0 or max_depth == 0 or num_ranks == 0:
        return _empty_padded(num_requests, device)

    budget_t = torch.tensor(budgets, dtype=torch.int64, device=device)  # [R]
    values64 = values.double()  # [R, L, K]
    # Candidate (parent rank i, token rank j) pairs, i-major so that a stable sort breaks ties by (i, j).
    per_parent = [min(max_budget // (i + 1), num_ranks) for i in range(max_budget)]
    pair_parent = torch.repeat_interleave(
        torch.arange(max_budget, device=device), torch.tensor(per_parent, device=device)
    )  # [num_pairs]
    pair_starts = torch.tensor([0] + per_parent[:-1], device=device).cumsum(0)  # [max_budget]
    pair_rank = torch.arange(pair_parent.numel(), device=device) - pair_starts[pair_parent]  # [num_pairs]
    pair_bound = (pair_parent + 1) * (pair_rank + 1)  # [num_pairs]
    pairs_below = [0]  # pairs_below[c] = number of pairs whose parent rank is < c
    for n in per_parent:
        pairs_below.append(pairs_below[-1] + n)

    kept_lp, kept_parent, kept_rank, kept_count = [], [], [], []
    parent_lp = torch.zeros(num_requests, 1, dtype=torch.float64, device=device)  # [R, 1]: the root
    parent_count = torch.ones(num_requests, dtype=torch.int64, device=device)  # [R]
    num_parents = 1  # host-side bound on the kept nodes of the previous depth
    for d in range(max_depth):
        num_cand = pairs_below[num_parents]
        cand_parent, cand_rank = pair_parent[:num_cand], pair_rank[:num_cand]
        cand_lp = parent_lp[:, cand_parent] + values64[:, d, cand_rank]  # [R, C]
        is_valid = (cand_parent < parent_count[:, None]) & (pair_bound[:num_cand] <= budget_t[:, None])  # [R, C]
        num_kept = min(max_budget, num_cand)
        order = _stable_order(cand_lp, is_valid)[:, :num_kept]  # [R, num_kept]
        parent_lp = cand_lp.gather(1, order)
        parent_count = torch.minimum(is_valid.sum(1), budget_t)
        kept_lp.append(parent_lp)
        kept_parent.append(cand_parent[order])
        kept_rank.append(cand_rank[order])
        kept_count.append(parent_count)
        num_parents = num_kept

    # All kept nodes, depth-major and in order within each depth: a stable sort by -lp gives the pop order.
    widths = [t.shape[1] for t in kept_lp]
    depth_starts = [0]
    for w in widths:
        depth_starts.append(depth_starts[-1] + w)
    all_lp = torch.cat(kept_lp, 1)  # [R, T]
    all_parent = torch.cat(kept_parent, 1)  # [R, T]: rank within the previous depth
    all_rank = torch.cat(kept_rank, 1)  # [R, T]
    slot_depth = torch.repeat_interleave(
        torch.arange(max_depth, device=device), torch.tensor(widths, device=device)
    )  # [T]: depth - 1
    slot_in_depth = torch.arange(all_lp.shape[1], device=device) - torch.tensor(depth_starts[:-1], device=device)[
        slot_depth
    ]  # [T]
    is_kept = slot_in_depth[None, :] < torch.stack(kept_count, 1)[:, slot_depth]  # [R, T]
    num_out = min(max_budget, all_lp.shape[1])
    order = _stable_order(all_lp, is_kept)[:, :num_out]  # [R, num_out] slots in pop order
    num_nodes = torch.minimum(is_kept.sum(1), budget_t)  # [R]

    # Node index of each slot, to turn a parent's slot into its node index.
    node_of_slot = torch.full_like(all_lp, -1, dtype=torch.int64)  # [R, T]
    node_of_slot.scatter_(1, order, torch.arange(num_out, device=device).expand(num_requests, -1).contiguous())
    depth0 = slot_depth[order]  # [R, num_out] depth - 1
    prev_start = torch.tensor([0] + depth_starts[:-2], device=device)  # [L] first slot of the previous depth
    parent_slot = prev_start[depth0] + all_parent.gather(1, order)
    parents = torch.where(depth0 > 0, node_of_slot.gather(1, parent_slot), -1)
    flat_token = depth0 * num_ranks + all_rank.gather(1, order)
    tokens = token_ids.reshape(num_requests, -1).gather(1, flat_token)
    path_lp = all_lp.gather(1, order).float()

    is_node = torch.arange(num_out, device=device)[None, :] < num_nodes[:, None]  # [R, num_out]
    # The single host sync: node counts, plus a check that the inputs are log-probs (the order relies on it).
    is_bad = torch.isnan(values).any() | (values[:, :, 0] > 0).any()
    host = torch.cat([num_nodes, is_bad.long().reshape(1)]).tolist()
    if host[-1]:
        raise ValueError("values must be log-probabilities: no NaN and none above 0")
    return PaddedTrees(
        token_ids=torch.where(is_node, tokens, -1),
        parents=torch.where(is_node, parents, -1),
        depths=torch.where(is_node, depth0 + 1, 0),
        path_logprobs=torch.where(is_node, path_lp, float("-inf")),
        num_nodes=host[:-1],
    )


def _stable_order(lp: torch.Tensor, is_valid: torch.Tensor) -> torch.Tensor:
    """[R, C] column order by decreasing lp, ties by column, invalid columns last (NaN sorts after +inf)."""
    key = torch.where(is_valid, -lp, float("nan"))
    return key.sort(dim=1, stable=True).indices


def _empty_padded(num_requests: int, device: torch.device) -> PaddedTrees:
    z = torch.zeros(num_requests, 0, dtype=torch.int64, device=device)
    return PaddedTrees(z, z.clone(), z.clone(), torch.zeros(num_requests, 0, device=device), [0] * num_requests)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_budgets(budgets: list[int], num_requests: int) -> list[int]:
    budgets = list(budgets)
    if len(budgets) != num_requests:
        raise ValueError(f"need one budget per request: {len(budgets)} budgets for {num_requests} requests")
    for b in budgets:
        _check_int("each budget", b, minimum=0)
    return budgets


def _check_logprob_values(logprobs: torch.Tensor) -> None:
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    if bool(torch.isnan(logprobs).any()) or bool((logprobs > 0).any()):
        raise ValueError("logprobs must be log-probabilities: no NaN and none above 0")
