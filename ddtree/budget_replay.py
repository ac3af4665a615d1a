"""Replaying a budget policy on recorded acceptance traces (policy only: floats, ints and lists; no tensors).

At T=0 a request's output is fixed, so what a round at position p accepts with the first n nodes of its tree is a
function acc(p, n) of the drafter alone, and a `Trace` holds it for every p (the node probabilities of the full
tree in pop order, and which of its nodes lie on the target's path). `Replay` plays `BudgetPolicy` rounds on traces,
`plan` -> `allocate` -> `observe` as the engine calls them, with round seconds from a `CostModel`: policies and
budgets compare without timing noise. `benchmarks/sim_budget_policy.py` records traces from a drafter and the
evaluation data and prints the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.budget import BudgetPolicy, CostModel


@dataclass
class Trace:
    """One evaluation sequence as the policy sees it: per anchor (round start), the node probabilities of the full
    tree in pop order, and the indices of the tree nodes on the target's path (increasing: parents come first)."""

    category: str
    path_probs: list[list[float]]
    matched_nodes: list[list[int]]

    @property
    def num_positions(self) -> int:
        return len(self.path_probs)

    def accepted(self, position: int, num_nodes: int) -> int:
        """Accepted nodes of a round at `position` whose tree keeps its first `num_nodes` nodes."""
        count = 0
        for node in self.matched_nodes[position]:
            if node >= num_nodes:
                break
            count += 1
        return count


@dataclass
class Result:
    """Totals of one category's requests: the round seconds are shared evenly among the requests of each round."""

    seconds: float = 0.0
    tokens: int = 0
    request_rounds: int = 0
    drafted_request_rounds: int = 0
    committed_when_drafted: int = 0

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


@dataclass
class Replay:
    """Requests (traces) run `concurrency` at a time; a finished one is replaced by the next (continuous batching)."""

    cost: CostModel
    concurrency: int = 1

    def run_off(self, traces: list[Trace]) -> dict[str, Result]:
        """Every request decodes autoregressively."""
        return self._run(traces, lambda slots: ([], [], len(slots)), lambda *a: None, lambda r: None, lambda r: None)

    def run_policy(self, policy: BudgetPolicy, traces: list[Trace]) -> dict[str, Result]:
        def choose(slots: list[_Slot]) -> tuple[list[_Slot], list[int], int]:
            plan = policy.plan([s.request_id for s in slots])
            by_id = {s.request_id: s for s in slots}
            speculative = [by_id[r] for r in plan.speculative_ids]
            probs = [s.trace.path_probs[s.position][:b] for s, b in zip(speculative, plan.max_budgets)]
            counts = policy.allocate(plan.speculative_ids, probs, len(plan.autoregressive_ids)) if probs else []
            return speculative, counts, len(plan.autoregressive_ids)

        def learn(slot: _Slot, num_nodes: int, accepted: int) -> None:
            predicted = sum(slot.trace.path_probs[slot.position][:num_nodes])
            policy.observe(slot.request_id, predicted, accepted, num_nodes)

        return self._run(traces, choose, learn, policy.add, policy.remove)

    def run_oracle(self, traces: list[Trace], max_budget: int) -> dict[str, Result]:
        """One request at a time: each round the node count (0 = autoregressive) best for that round alone."""
        ar = self.cost.verify_seconds(1)
        draft = self.cost.draft_seconds(1)

        def choose(slots: list[_Slot]) -> tuple[list[_Slot], list[int], int]:
            (slot,) = slots
            best_n, best_rate = 0, 1.0 / ar
            for n in range(1, max_budget + 1):
                rate = (1 + slot.trace.accepted(slot.position, n)) / (draft + self.cost.verify_seconds(1 + n))
                if rate > best_rate:
                    best_n, best_rate = n, rate
            return ([slot], [best_n], 0) if best_n else ([], [], 1)

        if self.concurrency != 1:
            raise ValueError("the oracle replays one request at a time")
        return self._run(traces, choose, lambda *a: None, lambda r: None, lambda r: None)

    def _run(self, traces, choose, learn, add, remove) -> dict[str, Result]:
        """`choose(slots)` -> (speculating slots, their node counts, number autoregressive); `learn(slot, nodes,
        accepted)` after each speculative round; `add` / `remove` a request id as it joins / leaves."""
        results: dict[str, Result] = {}
        queue = list(enumerate(traces))
        slots: list[_Slot] = []
        while queue or slots:
            while queue and len(slots) < self.concurrency:
                i, trace = queue.pop(0)
                slots.append(_Slot(f"r{i}", trace))
                add(slots[-1].request_id)
            speculative, counts, _ = choose(slots)
            num_tokens = len(slots) + sum(counts)
            round_seconds = self.cost.draft_seconds(len(speculative)) + self.cost.verify_seconds(num_tokens)
            drafted = {id(s) for s in speculative}
            for slot in slots:
                r = results.setdefault(slot.trace.category, Result())
                r.seconds += round_seconds / len(slots)  # the round's time, shared evenly
                r.request_rounds += 1
            for slot, n in zip(speculative, counts):
                accepted = slot.trace.accepted(slot.position, n)
                learn(slot, n, accepted)
                r = results[slot.trace.category]
                r.drafted_request_rounds += 1
                r.committed_when_drafted += 1 + accepted
                self._advance(slot, 1 + accepted, r)
            for slot in slots:
                if id(slot) not in drafted:
                    self._advance(slot, 1, results[slot.trace.category])
            for slot in [s for s in slots if s.position >= s.trace.num_positions]:
                slots.remove(slot)
                remove(slot.request_id)
        return results

    @staticmethod
    def _advance(slot: _Slot, num_tokens: int, result: Result) -> None:
        num_tokens = min(num_tokens, slot.trace.num_positions - slot.position)
        slot.position += num_tokens
        result.tokens += num_tokens
