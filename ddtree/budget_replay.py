"""Replaying a budget policy on recorded acceptance traces (policy only: floats, ints and lists; no tensors).

At T=0 a request's output is fixed, so what a round at position p accepts with the first n nodes of its tree is a
function acc(p, n) of the drafter alone, and a `Trace` holds it for every p (the node probabilities of the full
tree in pop order, and which of its nodes lie on the target's path). `Replay` plays `BudgetPolicy` rounds on traces,
`plan` -> `allocate` -> `observe` as the engine calls them, with round seconds from a `CostModel`: policies and
budgets compare without timing noise. `benchmarks/sim_budget_policy.py` records traces from a drafter and the
evaluation data and prints the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddtree.budget import BudgetPolicy, ProposedTree
from ddtree.cost import CostModel
from ddtree.ngram import NgramIndex


@dataclass
class Trace:
    """One evaluation sequence as the policy sees it: per anchor (round start), the node probabilities of the full
    tree in pop order, and the indices of the tree nodes on the target's path (increasing: parents come first).

    For n-gram proposals a trace also holds the trees' tokens and parents, and the sequence's token ids with the
    prompt length: the round at position p has the root `token_ids[prompt_length + p]` (the first response token,
    from prefill, at p = 0), the history `token_ids[: prompt_length + p + 1]` to propose from, and the target's
    continuation after it."""

    category: str
    path_probs: list[list[float]]
    matched_nodes: list[list[int]]
    tree_tokens: list[list[int]] | None = None
    tree_parents: list[list[int]] | None = None
    token_ids: list[int] | None = None
    prompt_length: int = 0

    @property
    def num_positions(self) -> int:
        return len(self.path_probs)

    @property
    def has_tokens(self) -> bool:
        return self.tree_tokens is not None and self.token_ids is not None

    def accepted(self, position: int, num_nodes: int) -> int:
        """Accepted nodes of a round at `position` whose tree keeps its first `num_nodes` nodes."""
        count = 0
        for node in self.matched_nodes[position]:
            if node >= num_nodes:
                break
            count += 1
        return count

    def history(self, position: int) -> list[int]:
        return self.token_ids[: self.prompt_length + position + 1]

    def continuation(self, position: int) -> list[int]:
        return self.token_ids[self.prompt_length + position + 1 :]

    def truncated(self, num_positions: int) -> Trace:
        """The first `num_positions` rounds' positions only (a response's first tokens)."""
        cut = slice(0, num_positions)
        return replace(
            self,
            path_probs=self.path_probs[cut],
            matched_nodes=self.matched_nodes[cut],
            tree_tokens=None if self.tree_tokens is None else self.tree_tokens[cut],
            tree_parents=None if self.tree_parents is None else self.tree_parents[cut],
        )


def accepted_along(token_ids: list[int], parents: list[int], continuation: list[int]) -> int:
    """Nodes of a tree (given as lists) that the target's continuation follows from the root."""
    children: dict[int, dict[int, int]] = {}
    for node, (parent, token) in enumerate(zip(parents, token_ids)):
        children.setdefault(parent, {})[token] = node
    node, depth = -1, 0
    for token in continuation:
        node = children.get(node, {}).get(token)
        if node is None:
            break
        depth += 1
    return depth


@dataclass
class Result:
    """Totals of one category's requests: the round seconds are shared evenly among the requests of each round."""

    seconds: float = 0.0
    tokens: int = 0
    request_rounds: int = 0
    drafted_request_rounds: int = 0
    committed_when_drafted: int = 0
    ngram_tokens: int = 0  # tokens accepted from n-gram chains verified without a draft

    def add(self, other: Result) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)

    @property
    def tau(self) -> float:
        return self.committed_when_drafted / max(self.drafted_request_rounds, 1)


@dataclass
class _Slot:
    request_id: str
    trace: Trace
    position: int = 0
    ngrams: NgramIndex | None = None


@dataclass
class _Verified:
    """What one request verified in a round: its tree's nodes, how many were accepted, and whether it was drafted
    (a request in fallback may verify an n-gram chain)."""

    num_nodes: int
    num_accepted: int
    is_drafted: bool


@dataclass
class Replay:
    """Requests (traces) run `concurrency` at a time; a finished one is replaced by the next (continuous batching)."""

    cost: CostModel
    concurrency: int = 1

    def run_off(self, traces: list[Trace]) -> dict[str, Result]:
        """Every request decodes autoregressively."""
        return self._run(traces, lambda slots: {}, lambda r: None, lambda r: None)

    def run_policy(self, policy: BudgetPolicy, traces: list[Trace], ngram_tokens: int = 0) -> dict[str, Result]:
        """The engine's round: plan -> (draft) -> allocate -> verify -> observe. With `ngram_tokens`, n-gram chains
        join as in the engine's auto mode: merged into drafted trees (into what a first allocation keeps, plus the
        chain), verified alone by requests in fallback, valued and learned by the policy."""
        if ngram_tokens and not all(t.has_tokens for t in traces):
            raise ValueError("n-gram proposals need traces with tree tokens and the sequence's token ids")

        def choose(slots: list[_Slot]) -> dict[int, _Verified]:
            slot_of = {s.request_id: s for s in slots}
            index_of = {s.request_id: i for i, s in enumerate(slots)}
            plan = policy.plan(list(slot_of))
            drafted = [
                self._proposed(slot_of[rid], b, ngram_tokens) for rid, b in zip(plan.speculative_ids, plan.max_budgets)
            ]
            chains = {rid: s.ngrams.propose(ngram_tokens) for rid, s in slot_of.items()} if ngram_tokens else {}
            allocation = policy.allocate_round(plan, drafted, chains)
            verified: dict[int, _Verified] = {}
            for k, (rid, tree, n) in enumerate(zip(allocation.request_ids, allocation.trees, allocation.counts)):
                slot = slot_of[rid]
                is_drafted = k < allocation.num_drafted
                if ngram_tokens:
                    continuation = slot.trace.continuation(slot.position)
                    accepted = accepted_along(tree.token_ids[:n], tree.parents[:n], continuation)
                    without_draft = policy.observe_proposal(chains[rid], continuation[: accepted + 1], rid)
                else:
                    accepted, without_draft = slot.trace.accepted(slot.position, n), 0
                if is_drafted:
                    policy.observe(rid, sum(tree.values[:n]), accepted, n, without_draft)
                verified[index_of[rid]] = _Verified(n, accepted, is_drafted)
            return verified

        return self._run(traces, choose, policy.add, policy.remove, ngram_tokens=ngram_tokens)

    def run_oracle(self, traces: list[Trace], max_budget: int) -> dict[str, Result]:
        """One request at a time: each round the node count (0 = autoregressive) best for that round alone."""
        ar = self.cost.verify_seconds(1)
        draft = self.cost.draft_seconds(1)

        def choose(slots: list[_Slot]) -> dict[int, _Verified]:
            (slot,) = slots
            best_n, best_rate = 0, 1.0 / ar
            for n in range(1, max_budget + 1):
                rate = (1 + slot.trace.accepted(slot.position, n)) / (draft + self.cost.verify_seconds(1 + n))
                if rate > best_rate:
                    best_n, best_rate = n, rate
            return {0: _Verified(best_n, slot.trace.accepted(slot.position, best_n), True)} if best_n else {}

        if self.concurrency != 1:
            raise ValueError("the oracle replays one request at a time")
        return self._run(traces, choose, lambda r: None, lambda r: None)

    @staticmethod
    def _proposed(slot: _Slot, max_nodes: int, with_tokens: bool) -> ProposedTree:
        """The drafter's tree at the slot's position, its first `max_nodes` nodes (tokens too, to merge chains)."""
        trace, p = slot.trace, slot.position
        values = trace.path_probs[p][:max_nodes]
        if not with_tokens:
            return ProposedTree(values)
        return ProposedTree(values, trace.tree_tokens[p][:max_nodes], trace.tree_parents[p][:max_nodes])

    def _run(self, traces, choose, add, remove, ngram_tokens: int = 0) -> dict[str, Result]:
        """`choose(slots)` -> {slot index: what it verified} for the requests verifying a tree this round (the others
        verify their root alone), observations made; `add` / `remove` a request id as it joins / leaves."""
        results: dict[str, Result] = {}
        queue = list(enumerate(traces))
        slots: list[_Slot] = []
        while queue or slots:
            while queue and len(slots) < self.concurrency:
                i, trace = queue.pop(0)
                slot = _Slot(f"r{i}", trace)
                if ngram_tokens:
                    slot.ngrams = NgramIndex(trace.history(0))
                slots.append(slot)
                add(slot.request_id)
            verified = choose(slots)
            num_drafted = sum(v.is_drafted for v in verified.values())
            num_tokens = len(slots) + sum(v.num_nodes for v in verified.values())
            round_seconds = self.cost.draft_seconds(num_drafted) + self.cost.verify_seconds(num_tokens)
            for i, slot in enumerate(slots):
                r = results.setdefault(slot.trace.category, Result())
                r.seconds += round_seconds / len(slots)  # the round's time, shared evenly
                r.request_rounds += 1
                v = verified.get(i)
                num_accepted = v.num_accepted if v is not None else 0
                if v is not None and v.is_drafted:
                    r.drafted_request_rounds += 1
                    r.committed_when_drafted += 1 + num_accepted
                elif v is not None:
                    r.ngram_tokens += num_accepted
                self._advance(slot, 1 + num_accepted, r)
            for slot in [s for s in slots if s.position >= s.trace.num_positions]:
                slots.remove(slot)
                remove(slot.request_id)
        return results

    @staticmethod
    def _advance(slot: _Slot, num_tokens: int, result: Result) -> None:
        num_tokens = min(num_tokens, slot.trace.num_positions - slot.position)
        if slot.ngrams is not None:
            start = slot.trace.prompt_length + slot.position + 1
            slot.ngrams.extend(slot.trace.token_ids[start : start + num_tokens])
        slot.position += num_tokens
        result.tokens += num_tokens
