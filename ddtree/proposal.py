"""Draft trees between the tree builder and the budget policy.

The tree builder (ddtree.tree) makes `DraftTree`s: tensors, on the drafter's device, that the target worker packs
into a verify pass. The budget policy (ddtree.budget) ranks nodes and merges n-gram chains as plain lists
(`ProposedTree`), so that it stays free of torch. A round crosses that boundary twice: the drafted trees go to the
policy as lists (`proposed_trees`), and what the policy keeps comes back as tensors (`kept_tree`).
"""

from __future__ import annotations

import torch

from ddtree.budget import ProposedTree
from ddtree.tree import DraftTree, build_round_trees, chain_trees_from_topk


def drafted_trees(
    values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int], max_depths: list[int], chain: bool = False
) -> list[DraftTree]:
    """Each request's tree from its top-K ([R, L, K] log-probs and token ids), holding at most `budgets[r]` nodes of
    depth <= `max_depths[r]` (a round commits at most accepted nodes + 1 tokens, so nodes past a request's tokens
    left - 1 would be verified for nothing). `chain`: the drafter's argmax chain (the DFlash baseline) instead of the
    best-first tree."""
    if chain:
        return chain_trees_from_topk(values, token_ids, [min(b, d) for b, d in zip(budgets, max_depths)])
    capped = [r for r, d in enumerate(max_depths) if d < values.shape[1]]
    if not capped:
        return build_round_trees(values, token_ids, budgets)
    # Positions past a request's max depth get log-probability -inf: their nodes pop after every finite one
    # (best-first) and are cut off the end.
    values = values.clone()
    for r in capped:
        values[r, max(max_depths[r], 0) :] = float("-inf")
    trees = build_round_trees(values, token_ids, budgets)
    for r in capped:
        trees[r] = truncate(trees[r], int(torch.isfinite(trees[r].path_logprobs).sum()))
    return trees


def truncate(tree: DraftTree, num_nodes: int) -> DraftTree:
    """The first `num_nodes` nodes in pop order: still a tree (parents precede children)."""
    if num_nodes >= tree.num_nodes:
        return tree
    return DraftTree(
        tree.token_ids[:num_nodes],
        tree.parents[:num_nodes],
        tree.depths[:num_nodes],
        tree.path_logprobs[:num_nodes],
    )


def proposed_trees(trees: list[DraftTree], with_tokens: bool) -> tuple[list[ProposedTree], list[DraftTree]]:
    """The trees as the policy reads them (node probabilities; `with_tokens`: token ids and parents too, to merge
    n-gram chains; ids are exact in float64), and as host tensors. On a GPU both come from one device read."""
    logprobs = torch.cat([t.path_logprobs for t in trees])
    if logprobs.device.type == "cpu":  # host trees already: only the lists the policy reads
        fields = ("token_ids", "parents") if with_tokens else ()
        columns = [logprobs.exp().double()] + [torch.cat([getattr(t, f) for t in trees]).double() for f in fields]
        return _as_proposed(trees, torch.stack(columns).tolist(), with_tokens), trees
    host = torch.stack(
        [logprobs.exp().double(), logprobs.double()]
        + [torch.cat([getattr(t, f) for t in trees]).double() for f in ("token_ids", "parents", "depths")]
    ).cpu()  # [5, nodes]
    ids = host[2:].long()
    path_logprobs = host[1].to(logprobs.dtype)
    host_trees, start = [], 0
    for t in trees:
        end = start + t.num_nodes
        host_trees.append(DraftTree(ids[0, start:end], ids[1, start:end], ids[2, start:end], path_logprobs[start:end]))
        start = end
    return _as_proposed(trees, (host[[0, 2, 3]] if with_tokens else host[:1]).tolist(), with_tokens), host_trees


def _as_proposed(trees: list[DraftTree], columns: list[list[float]], with_tokens: bool) -> list[ProposedTree]:
    """Per tree, its slice of the columns: [probabilities] or [probabilities, token ids, parents]."""
    proposed, start = [], 0
    for t in trees:
        end = start + t.num_nodes
        if with_tokens:
            token_ids = [int(x) for x in columns[1][start:end]]
            parents = [int(x) for x in columns[2][start:end]]
            proposed.append(ProposedTree(columns[0][start:end], token_ids, parents))
        else:
            proposed.append(ProposedTree(columns[0][start:end]))
        start = end
    return proposed


def kept_tree(proposed: ProposedTree, drafted: DraftTree | None, num_nodes: int) -> DraftTree:
    """The first `num_nodes` nodes the allocation kept, as host tensors: a slice of the drafted tree, or new tensors
    where the policy rebuilt it (a chain merged in, or a chain alone: `drafted` is None)."""
    if not proposed.is_rebuilt:
        return truncate(drafted, num_nodes)
    rebuilt = DraftTree(
        torch.tensor(proposed.token_ids, dtype=torch.int64),
        torch.tensor(proposed.parents, dtype=torch.int64),
        torch.tensor(proposed.depths, dtype=torch.int64),
        torch.tensor(proposed.values, dtype=torch.float32).log(),
    )
    return truncate(rebuilt, num_nodes)
