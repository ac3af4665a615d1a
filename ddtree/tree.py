"""Optimal draft trees (DDTree).

Under a factorised draft distribution Q(y) = prod_i q_i(y_i), the expected acceptance length of a tree T is
sum_{u in T} q(u), with q(u) the probability of prefix u. The best tree of B nodes is therefore the set of the B
most probable prefixes; it is prefix-closed because a prefix is at least as probable as any of its extensions.
"""

from __future__ import annotations

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
