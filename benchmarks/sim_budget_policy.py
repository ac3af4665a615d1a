"""Budget policies replayed on real drafter traces: which one commits the most tokens per second (T=0).

At T=0 a request's output is fixed, so what a round at position p accepts with the first n nodes of its tree is a
function acc(p, n) of the drafter alone: one target pass per sequence (the cached features of the evaluation data,
`ddtree train-drafter eval-data`) and one drafter forward per position give it for every p and n (as the offline tau
evaluation does). The engine's own `BudgetPolicy` then plays its rounds on these traces, `plan` -> `allocate` ->
`observe` exactly as the engine calls them, with round times from a cost model measured on this machine (the one
the engine measures at start-up). No model runs during the replay, so policies compare without timing noise:

    python benchmarks/sim_budget_policy.py [--num-sequences 10] [--concurrency 1] [--threads 1]

Prints, per category and over all, the simulated tokens per second of `off`, fixed budgets, `auto` (the engine's
policy), `auto, no fallback`, and `oracle` (each round the n in 0..max_budget that is best for that round alone,
knowing its acceptance: a reference no policy can reach), with tau and the share of request-rounds drafted.
The traces and the cost model are cached under work/sim_budget/ (delete them to remeasure; the cost model is
measured with --threads threads: run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree.budget import BudgetConfig, BudgetPolicy, CostModel  # noqa: E402


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


def compute_traces(drafter_dir: Path, eval_dir: Path, categories: list[str], num_sequences: int,
                   max_budget: int) -> list[Trace]:
    import torch

    from ddtree.models.dflash import load_dflash, load_draft_vocab
    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids
    from ddtree.training.evaluate import draft_topk_at_every_anchor
    from ddtree.training.target import load_target
    from ddtree.tree import build_tree_from_topk

    _, drafter = load_dflash(drafter_dir)
    target, _ = load_target("smollm2-135m-instruct")
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    del target
    draft_vocab = load_draft_vocab(drafter_dir, lm_head.shape[0])
    draft_token_ids = None if draft_vocab is None else torch.tensor(draft_vocab)
    traces = []
    for category in categories:
        data_dir = eval_dir / category
        reader = FeatureReader(data_dir, stored_layer_ids(data_dir), drafter.config.target_layer_ids)
        for seq in read_sequences(data_dir)[:num_sequences]:
            first = seq.prompt_length
            values, ids = draft_topk_at_every_anchor(drafter, embed, lm_head, reader(seq), seq.token_ids, first,
                                                     max_budget, draft_token_ids=draft_token_ids)
            trace = Trace(category, [], [])
            for row, anchor in enumerate(range(first, len(seq.token_ids) - 1)):
                tree = build_tree_from_topk(values[row], ids[row], max_budget)
                trace.path_probs.append(tree.path_logprobs.exp().tolist())
                trace.matched_nodes.append(_matched_nodes(tree, seq.token_ids[anchor + 1 :]))
            traces.append(trace)
            print(f"[traces] {category} {seq.prompt_id}: {trace.num_positions} positions", flush=True)
    return traces


def _matched_nodes(tree, target_next: list[int]) -> list[int]:
    children: dict[int, dict[int, int]] = {}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.token_ids.tolist())):
        children.setdefault(parent, {})[token] = node
    path, node = [], -1
    for token in target_next:
        node = children.get(node, {}).get(token)
        if node is None:
            break
        path.append(node)
    return path


def measure_cost_model(max_budget: int) -> CostModel:
    from ddtree.engine import Engine, EngineConfig
    from ddtree.workers import build_workers

    target, drafter, tokenizer = build_workers()
    engine = Engine(EngineConfig(max_num_seqs=16, max_budget=max_budget), target, drafter, tokenizer)
    return engine.budget.cost


# ------------------------------------------------------------------------------------------------ the replay


@dataclass
class Result:
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
    results: dict[str, Result] = field(default_factory=dict)  # per category

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
        results: dict[str, Result] = {}
        queue = list(enumerate(traces))
        slots: list[_Slot] = []
        while queue or slots:
            while queue and len(slots) < self.concurrency:
                i, trace = queue.pop(0)
                slots.append(_Slot(f"r{i}", trace))
                add(slots[-1].request_id)
            speculative, counts, num_autoregressive = choose(slots)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--eval-dir", type=Path, default=REPO / "work" / "drafter_eval")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "work" / "sim_budget")
    parser.add_argument("--num-sequences", type=int, default=10, help="per category")
    parser.add_argument("--max-budget", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=None, help="replay only each response's first tokens")
    parser.add_argument("--first-sequences", type=int, default=None, help="replay only the first N per category")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--draft-cost-scale", type=float, default=1.0,
                        help="multiply the drafter's measured seconds (a slower drafter: where drafting pays less)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from ddtree.training.prompts import CATEGORIES
    from ddtree.workers import resolve_drafter_path

    torch.set_num_threads(args.threads)
    drafter_dir = resolve_drafter_path(None, args.drafter)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    traces_path = args.cache_dir / f"traces-{drafter_dir.name}-{args.num_sequences}-{args.max_budget}.json"
    if traces_path.exists():
        traces = [Trace(**t) for t in json.loads(traces_path.read_text())]
    else:
        traces = compute_traces(drafter_dir, args.eval_dir, list(CATEGORIES), args.num_sequences, args.max_budget)
        traces_path.write_text(json.dumps([t.__dict__ for t in traces]))
    if args.first_sequences is not None:
        traces = [t for c in CATEGORIES for t in [t for t in traces if t.category == c][: args.first_sequences]]
    if args.max_tokens is not None:
        traces = [Trace(t.category, t.path_probs[: args.max_tokens - 1], t.matched_nodes[: args.max_tokens - 1])
                  for t in traces]
    cost_path = args.cache_dir / f"cost-{args.threads}threads.json"
    if cost_path.exists():
        points = json.loads(cost_path.read_text())
        cost = CostModel([tuple(p) for p in points["verify"]], [tuple(p) for p in points["draft"]])
    else:
        cost = measure_cost_model(args.max_budget)
        cost_path.write_text(json.dumps({"verify": cost.verify_points, "draft": cost.draft_points}))
    cost.draft_points = [(n, seconds * args.draft_cost_scale) for n, seconds in cost.draft_points]
    cost.refresh_weight = 0.0  # the replay's clock is this model: it never drifts
    print(f"\nverify ms: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cost.verify_points)
          + f"; draft ms: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cost.draft_points))

    replay = Replay(cost, args.concurrency)
    rows: dict[str, dict[str, Result]] = {}
    off = BudgetPolicy(BudgetConfig(fixed_budget=1), cost)
    rows["off"] = Replay(cost, args.concurrency)._run(
        traces, lambda slots: ([], [], len(slots)), lambda *a: None, off.add, off.remove)
    for b in args.budgets:
        rows[f"B={b}"] = replay.run_policy(BudgetPolicy(BudgetConfig(fixed_budget=b), cost), traces)
    rows["auto"] = replay.run_policy(BudgetPolicy(BudgetConfig(max_budget=args.max_budget), cost), traces)
    rows["auto, no fallback"] = replay.run_policy(
        BudgetPolicy(BudgetConfig(max_budget=args.max_budget, allow_fallback=False), cost), traces)
    if args.concurrency == 1:
        rows["oracle"] = replay.run_oracle(traces, args.max_budget)

    categories = list(CATEGORIES) + ["all"]
    for res in rows.values():
        total = Result()
        for c in CATEGORIES:
            total.add(res.get(c, Result()))
        res["all"] = total
    base = {c: rows["off"][c].tokens_per_second for c in categories}
    print(f"\n{len(traces)} sequences, concurrency {args.concurrency}: simulated tok/s (x off), tau, drafted %\n")
    print("| policy | " + " | ".join(categories) + " | tau (all) | drafted (all) |")
    print("|---" * (3 + len(categories)) + "|")
    for name, res in rows.items():
        cells = [f"{res[c].tokens_per_second:.1f} ({res[c].tokens_per_second / base[c]:.2f}x)" for c in categories]
        a = res["all"]
        print(f"| {name} | " + " | ".join(cells)
              + f" | {a.tau:.2f} | {100 * a.drafted_request_rounds / max(a.request_rounds, 1):.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
