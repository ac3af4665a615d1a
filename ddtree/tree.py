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
- Nodes are ordered by the key (-path_logprob, depth, parent's position among the nodes of its depth under this
  same order, token rank): equal probabilities go shallower first, then by the order of their parents, then by
  token rank (zero-probability nodes, -inf, tie with each other and follow the same rule). A parent precedes its
  children and a token precedes its lower-ranked siblings under this key, so every prefix of the order is a
  prefix-closed tree, and the heap pops exactly this order.
"""

from __future__ import annotations

import functools
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

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(*(t.to(device) for t in (self.token_ids, self.parents, self.depths, self.path_logprobs)))

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> DraftTree:
        """The tree of an autoregressive step: no nodes, only the root."""
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return DraftTree(z, z.clone(), z.clone(), torch.zeros(0, dtype=torch.float32, device=device))

    @staticmethod
    def chain(token_ids: list[int]) -> DraftTree:
        """The tokens as one path below the root (each the child of the one before), on the host: a prompt's tokens
        after its first, which a verify pass takes in whole (its ancestor mask is then causal)."""
        n = len(token_ids)
        return DraftTree(
            torch.tensor(token_ids, dtype=torch.int64),
            torch.arange(-1, n - 1, dtype=torch.int64),
            torch.arange(1, n + 1, dtype=torch.int64),
            torch.zeros(n, dtype=torch.float32),
        )


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
    if not bool((values[..., 1:] == values[..., :-1]).any()):
        return values, token_ids
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
        raise ValueError(
            f"values and token_ids must both be [L, K], got {tuple(values.shape)}, {tuple(token_ids.shape)}"
        )
    _check_int("budget", budget, minimum=0)
    device = values.device
    max_depth, num_ranks = values.shape
    if budget == 0 or max_depth == 0 or num_ranks == 0:
        return DraftTree.empty(device)
    v = values.double().tolist()  # float64, as the batched builder sums
    ids = token_ids.tolist()
    if any(not row[0] <= 0 for row in v):  # rows decrease, NaN first
        raise ValueError("values must be log-probabilities: no NaN and none above 0")
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
            sibling_lp = parent_lp + v[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling_lp, depth, parent_order, rank + 1, parent, parent_lp))
        if depth < max_depth:  # first child
            heapq.heappush(heap, (-(lp + v[depth][0]), depth + 1, order_in_depth, 0, node, lp))
    return DraftTree(
        token_ids=torch.tensor(out_tokens, dtype=torch.int64, device=device),
        parents=torch.tensor(out_parents, dtype=torch.int64, device=device),
        depths=torch.tensor(out_depths, dtype=torch.int64, device=device),
        path_logprobs=torch.tensor(out_logprobs, dtype=torch.float64, device=device).float(),
    )


def build_trees_with_heap(values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """The reference heap per request, from `topk_logprobs` output [R, L, K]: the same trees as
    `build_trees_from_topk`. One host copy; on a CPU it is the faster choice for small total budgets or deep,
    narrow trees (see docs/tree_benchmark.md)."""
    _check_topk(values, token_ids)
    budgets = _check_budgets(budgets, values.shape[0])
    host_values, host_ids = values.cpu(), token_ids.cpu()
    trees = [build_tree_from_topk(host_values[r], host_ids[r], b) for r, b in enumerate(budgets)]
    if values.device.type == "cpu":
        return trees
    return [
        DraftTree(*(x.to(values.device) for x in (t.token_ids, t.parents, t.depths, t.path_logprobs))) for t in trees
    ]


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


# On a CPU, up to this many nodes in all (sum of the budgets), the reference heap builds a round's trees faster
# than the batched builder (docs/tree_benchmark.md). On GPUs the batched builder stays (the heap would add host
# copies per request).
HEAP_MAX_TOTAL_NODES = 512


def build_round_trees(values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """A decoding round's trees, from `topk_logprobs` output [R, L, K]: by the reference heap on a CPU when the
    budgets total at most `HEAP_MAX_TOTAL_NODES` nodes, else by the batched builder. Both give identical trees."""
    _check_topk(values, token_ids)
    total = sum(_check_budgets(budgets, values.shape[0]))
    if values.device.type == "cpu" and total <= HEAP_MAX_TOTAL_NODES:
        return build_trees_with_heap(values, token_ids, budgets)
    return build_trees_from_topk(values, token_ids, budgets)


def build_padded_trees(values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> PaddedTrees:
    """The batched builder: vectorised over requests and nodes, with a loop over depths.

    values [R, L, K] from `topk_logprobs` (decreasing along K), token_ids [R, L, K]. Depth by depth, the candidates
    are (kept nodes of the previous depth) x (token ranks), pruned twice:
    - by (i + 1)(j + 1) <= B for parent rank i and token rank j: the combinations of the i + 1 better parents and
      the j + 1 better tokens all come first, so the candidate cannot be among the B best;
    - by a lower bound on the B-th best path log-prob: the B-th best of any B known prefixes (first the greedy chain
      with one last deviation, then the nodes kept so far). Nothing below it can enter the tree, nor can its
      descendants.
    Each depth keeps its first B survivors in order; the tree is the first B of all kept nodes, which one stable
    sort (depth-major layout) puts in pop order.

    Host syncs: two at the start, two per depth (the sizes of the next candidate set) and one at the end; the loop
    stops at the first depth where no node survives, so shallow trees cost few steps.
    """
    _check_topk(values, token_ids)
    num_requests, max_depth, num_ranks = values.shape
    budgets = _check_budgets(budgets, num_requests)
    device = values.device
    max_budget = max(budgets, default=0)
    if max_budget == 0 or max_depth == 0 or num_ranks == 0:
        return _empty_padded(num_requests, device)
    # Rows are sorted with NaN first, so the first column tells NaN and positive values apart.
    if not bool((values[:, :, 0] <= 0).all()):
        raise ValueError("values must be log-probabilities: no NaN and none above 0")

    num_ranks = min(num_ranks, max_budget)  # rank j >= B never enters: its j better siblings come first
    budget_t = torch.tensor(budgets, dtype=torch.int64, device=device)  # [R]
    last_rank = (budget_t - 1).clamp(min=0)[:, None]  # [R, 1]
    is_uniform = min(budgets) == max_budget
    pair_parent, pair_rank, pairs_below = _candidate_pairs(max_budget, num_ranks, device)
    rank_range = torch.arange(max(num_ranks, pairs_below[-1]), device=device)  # covers every width below
    # Sort keys: -inf path log-probs (zero-probability tokens) become the lowest finite value, so that -inf can mark
    # "not a candidate"; ties among them break by position, as for any other tie.
    lowest = torch.finfo(torch.float64).min

    # A first pruning bound: the greedy chain with one last deviation, (0, ..., 0, j), gives L * K distinct
    # prefixes, so the B-th best of them cannot beat the B-th best overall (the largest budget's bound is valid for
    # every request). Summed in another order than the builder's, so lowered by a margin far above rounding.
    first_ranks = values[:, :, :num_ranks].double()  # [R, L, K]
    chain_lp = first_ranks[:, :, 0].cumsum(1)  # [R, L]
    chain_above = torch.cat([torch.zeros_like(chain_lp[:, :1]), chain_lp[:, :-1]], 1)  # [R, L]
    deviations = (chain_above[:, :, None] + first_ranks).reshape(num_requests, -1)  # [R, L * K]
    if deviations.shape[1] >= max_budget:
        grid_bound = deviations.topk(max_budget, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
        grid_bound = grid_bound - 1e-9 * grid_bound.abs() - 1e-300  # [R, 1]
    else:
        grid_bound = torch.full((num_requests, 1), float("-inf"), dtype=torch.float64, device=device)

    # Depth 1: the root's children are the top tokens in rank order.
    lp = first_ranks[:, 0]  # [R, K]
    count = torch.minimum((lp >= grid_bound).sum(1), budget_t)  # [R]
    num_kept = max(int(count.max()), 1)
    lp = lp[:, :num_kept]
    is_kept = rank_range[None, :num_kept] < count[:, None]
    kept_lp, kept_kept = [lp], [is_kept]
    kept_parent_slot = [torch.full((num_requests, num_kept), -1, dtype=torch.int64, device=device)]
    kept_token = [token_ids[:, 0, :num_kept]]
    parent_lp = torch.where(is_kept, lp, float("nan"))  # [R, P]: NaN past a request's kept nodes
    best_lp = torch.where(is_kept, lp, float("-inf"))  # [R, W] decreasing: the best nodes so far
    if num_kept < max_budget:
        best_lp = torch.cat([best_lp, best_lp.new_full((num_requests, max_budget - num_kept), float("-inf"))], 1)
    min_lp = torch.maximum(best_lp.gather(1, last_rank), grid_bound)  # [R, 1]: the pruning bound
    slot_start = 0  # first slot of the previous depth in the all-depths layout

    for d in range(1, max_depth):
        logp = first_ranks[:, d]  # [R, K]
        # How many parents can still have a surviving child, and how many token ranks can follow the best parent
        # (not worth two more reductions and a sync when there are few parents).
        if parent_lp.shape[1] <= 32:
            live_parents, live_ranks = parent_lp.shape[1], num_ranks
        else:
            num_live_parents = (parent_lp + logp[:, :1] >= min_lp).sum(1)
            num_live_ranks = (logp + parent_lp[:, :1] >= min_lp).sum(1)
            live_parents, live_ranks = torch.stack([num_live_parents.max(), num_live_ranks.max()]).tolist()
            if live_parents == 0 or live_ranks == 0:
                break
        # Candidates in (parent rank, token rank) lexicographic order: the full grid of live parents and ranks, or
        # the (i + 1)(j + 1) <= B pairs when those are fewer.
        if live_parents * live_ranks <= pairs_below[live_parents]:
            cand_parent = rank_range[:live_parents].repeat_interleave(live_ranks)  # [C]
            cand_rank = rank_range[:live_ranks].repeat(live_parents)  # [C]
            cand_lp = (parent_lp[:, :live_parents, None] + logp[:, None, :live_ranks]).reshape(num_requests, -1)
        else:
            num_cand = pairs_below[live_parents]
            cand_parent, cand_rank = pair_parent[:num_cand], pair_rank[:num_cand]
            cand_lp = parent_lp.gather(1, cand_parent.expand(num_requests, -1)) + logp.gather(
                1, cand_rank.expand(num_requests, -1)
            )  # [R, C]
        num_cand = cand_parent.numel()
        is_survivor = cand_lp >= min_lp  # [R, C]; NaN parents (past a request's kept nodes) fail it
        if is_uniform:  # the pairs already respect the bound
            if live_parents * live_ranks <= pairs_below[live_parents]:
                is_survivor &= (cand_parent + 1) * (cand_rank + 1) <= max_budget
        else:
            is_survivor &= (cand_parent + 1) * (cand_rank + 1) <= budget_t[:, None]
        num_survivors = is_survivor.sum(1)  # [R]
        max_survivors = int(num_survivors.max())
        if max_survivors == 0:
            break
        # A stable sort by decreasing log-prob: candidates are laid out i-major, so ties fall back to (parent rank,
        # token rank), and each parent's children form an already sorted run, which the merge sort exploits. Unless
        # almost all candidates survive, they first move to the front in candidate order (a slot past them collects
        # the rest) so that the sort is short.
        num_kept = min(max_survivors, max_budget)
        if num_cand <= 128 or 8 * (num_cand - max_survivors) <= num_cand:
            key = torch.where(is_survivor, cand_lp.clamp(min=lowest), float("-inf"))  # [R, C]
            picked = key.sort(dim=1, descending=True, stable=True).indices[:, :num_kept]  # [R, W]
        else:
            slot = torch.where(is_survivor, is_survivor.cumsum(1) - 1, max_survivors)  # [R, C]
            picked = torch.full((num_requests, max_survivors + 1), num_cand - 1, dtype=torch.int64, device=device)
            picked.scatter_(1, slot, torch.arange(num_cand, device=device).expand(num_requests, -1))
            picked = picked[:, :max_survivors]  # [R, S]
            is_filled = rank_range[None, :max_survivors] < num_survivors[:, None]  # [R, S]
            key = torch.where(is_filled, cand_lp.gather(1, picked).clamp(min=lowest), float("-inf"))
            picked = picked.gather(1, key.sort(dim=1, descending=True, stable=True).indices[:, :num_kept])  # [R, W]
        lp = cand_lp.gather(1, picked)
        is_kept = rank_range[None, :num_kept] < torch.minimum(num_survivors, budget_t)[:, None]  # [R, W]
        rank = cand_rank[picked]
        kept_lp.append(lp)
        kept_kept.append(is_kept)
        kept_parent_slot.append(slot_start + cand_parent[picked])
        kept_token.append(token_ids[:, d].gather(1, rank))
        slot_start += parent_lp.shape[1]
        parent_lp = torch.where(is_kept, lp, float("nan"))
        # Two sorted runs: the stable merge sort is cheap.
        best_lp = torch.cat([best_lp, torch.where(is_kept, lp, float("-inf"))], 1)
        best_lp = best_lp.sort(dim=1, descending=True, stable=True).values[:, :max_budget]
        min_lp = torch.maximum(best_lp.gather(1, last_rank), grid_bound)

    # All kept nodes, depth-major and in order within each depth: a stable sort gives the pop order (equal
    # log-probs: shallower first, then by order within the depth).
    widths = [t.shape[1] for t in kept_lp]
    all_lp = torch.cat(kept_lp, 1)  # [R, T]
    all_kept = torch.cat(kept_kept, 1)  # [R, T]
    num_slots = all_lp.shape[1]
    slot_depth = torch.repeat_interleave(
        torch.arange(1, len(widths) + 1, device=device), torch.tensor(widths, device=device), output_size=num_slots
    )  # [T]
    key = torch.where(all_kept, all_lp.clamp(min=lowest), float("-inf"))
    num_out = min(max_budget, num_slots)
    order = key.sort(dim=1, descending=True, stable=True).indices[:, :num_out]  # [R, num_out]: slots in pop order
    num_nodes = torch.minimum(all_kept.sum(1), budget_t)  # [R]

    node_of_slot = torch.full((num_requests, num_slots), -1, dtype=torch.int64, device=device)
    node_of_slot.scatter_(1, order, torch.arange(num_out, device=device).expand(num_requests, -1))
    parent_slot = torch.cat(kept_parent_slot, 1).gather(1, order)  # [R, num_out], -1 at depth 1
    parents = torch.where(parent_slot >= 0, node_of_slot.gather(1, parent_slot.clamp(min=0)), -1)
    tokens = torch.cat(kept_token, 1).gather(1, order)
    path_lp = all_lp.gather(1, order).float()

    is_node = torch.arange(num_out, device=device)[None, :] < num_nodes[:, None]  # [R, num_out]
    return PaddedTrees(
        token_ids=torch.where(is_node, tokens, -1),
        parents=torch.where(is_node, parents, -1),
        depths=torch.where(is_node, slot_depth[order], 0),
        path_logprobs=torch.where(is_node, path_lp, float("-inf")),
        num_nodes=num_nodes.tolist(),
    )


@functools.lru_cache(maxsize=32)
def _candidate_pairs(
    max_budget: int, num_ranks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(parent rank i, token rank j) pairs with (i + 1)(j + 1) <= B and j < K, i-major: parent [P], rank [P], and
    pairs_below[c] = the number of pairs whose parent rank is below c."""
    per_parent = [min(max_budget // (i + 1), num_ranks) for i in range(max_budget)]
    pairs_below = [0]
    for n in per_parent:
        pairs_below.append(pairs_below[-1] + n)
    pair_parent = torch.repeat_interleave(
        torch.arange(max_budget, device=device), torch.tensor(per_parent, device=device)
    )
    starts = torch.tensor(pairs_below[:-1], device=device)
    pair_rank = torch.arange(pair_parent.numel(), device=device) - starts[pair_parent]
    return pair_parent, pair_rank, pairs_below


def _empty_padded(num_requests: int, device: torch.device) -> PaddedTrees:
    z = torch.zeros(num_requests, 0, dtype=torch.int64, device=device)
    return PaddedTrees(z, z.clone(), z.clone(), torch.zeros(num_requests, 0, device=device), [0] * num_requests)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_topk(values: torch.Tensor, token_ids: torch.Tensor) -> None:
    if values.dim() != 3 or values.shape != token_ids.shape:
        raise ValueError(
            f"values and token_ids must both be [R, L, K], got {tuple(values.shape)}, {tuple(token_ids.shape)}"
        )


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


def chain_trees_from_topk(values: torch.Tensor, token_ids: torch.Tensor, lengths: list[int]) -> list[DraftTree]:
    """Single-path DFlash: the drafter's argmax at each position, `lengths[i]` deep (at most L)."""
    trees = []
    for i, n in enumerate(lengths):
        n = min(n, values.shape[1])
        depths = torch.arange(1, n + 1, device=values.device)
        trees.append(DraftTree(token_ids[i, :n, 0], depths - 2, depths, values[i, :n, 0].cumsum(0)))
    return trees
