"""N-gram (prompt lookup) proposals: free draft tokens from a request's own history (plain ints and lists).

A request's next tokens often repeat what came before: a name from the prompt, a line of code, a phrase the answer
already used. `NgramIndex` proposes the tokens that followed the most recent earlier occurrence of the request's
last n tokens (n from `max_n` down to 1), with no model call; prompt lookup decoding and vLLM's n-gram speculator
propose the same way. The engine merges such a chain into a request's DDTree tree (`merge_chain`), and gives it to
requests in fallback as a tree of its own: verifying a few extra tokens costs little where a verify pass is
weight-bandwidth-bound, and verification keeps the output exact whatever is proposed (the walk follows the target's
own tokens).
"""

from __future__ import annotations


class NgramIndex:
    """One request's token history and, per n-gram (n <= max_n), where its most recent earlier occurrence ended."""

    def __init__(self, token_ids: list[int], max_n: int = 3) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its most recent occurrence (the tail's own n-grams are entered
        # once a token follows them, so a lookup of the tail finds an earlier occurrence)
        self._next_index: dict[tuple[int, ...], int] = {}
        self.extend(token_ids)

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self._next_index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest tail n-gram seen before; [] when none was."""
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            start = self._next_index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + max_tokens]
        return []


def merge_chain(
    token_ids: list[int], parents: list[int], values: list[float], chain: list[int], chain_values: list[float]
) -> tuple[list[int], list[int], list[int], list[float]]:
    """A tree (nodes in decreasing value, parents first) with a chain from the root merged in.

    A chain token already in the tree along the chain's path keeps its node, valued max(its value, the chain's);
    the rest become new nodes. Every node is then valued at most its parent (values along the chain decrease, and
    a tree node under a chain node keeps its own smaller value), so sorting by decreasing value (stable, parents
    before children on ties) leaves the tree prefix-closed: any first k nodes form a tree.
    Returns (token_ids, parents, depths, values)."""
    if not token_ids and all(a >= b for a, b in zip(chain_values, chain_values[1:])):
        # a chain alone whose values already decrease: its path is the tree, in order (a fallback request's chain,
        # every round)
        n = min(len(chain), len(chain_values))
        return list(chain[:n]), list(range(-1, n - 1)), list(range(1, n + 1)), list(chain_values[:n])
    tokens, parent_of, value_of = list(token_ids), list(parents), list(values)
    children: dict[int, dict[int, int]] = {}
    for node, (parent, token) in enumerate(zip(parent_of, tokens)):
        children.setdefault(parent, {})[token] = node
    node = -1
    for token, value in zip(chain, chain_values):
        child = children.get(node, {}).get(token)
        if child is None:
            child = len(tokens)
            tokens.append(token)
            parent_of.append(node)
            value_of.append(value)
            children.setdefault(node, {})[token] = child
        else:
            value_of[child] = max(value_of[child], value)
        node = child
    depth = [0] * len(tokens)
    for i, p in enumerate(parent_of):  # parents first: new chain nodes come after theirs, too
        depth[i] = 1 if p < 0 else depth[p] + 1
    order = sorted(range(len(tokens)), key=lambda i: (-value_of[i], depth[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    return (
        [tokens[i] for i in order],
        [-1 if parent_of[i] < 0 else new_index[parent_of[i]] for i in order],
        [depth[i] for i in order],
        [value_of[i] for i in order],
    )


def chain_acceptance(chain: list[int], target_tokens: list[int]) -> int:
    """How many leading chain tokens the target's own tokens (the accepted ones, then the bonus token) confirm: what
    verifying the chain alone would have accepted (exact at T=0, and at T>0 too: the target's samples are keyed
    by position, not by the tree)."""
    n = 0
    for proposed, actual in zip(chain, target_tokens):
        if proposed != actual:
            break
        n += 1
    return n
