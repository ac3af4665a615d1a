"""What the budget policy costs per round in Python, at batch sizes a GPU serves.

The policy runs on the host between the drafter's forward and the verify pass, so its time adds to every round. Per
round the engine calls `plan` once, `allocate` twice when n-gram chains are merged (`allocate_round`: once to bound
the merge, once on the merged trees) and `observe` once per speculating request. Synthetic inputs: each request's
tree has `--nodes` values decaying like a drafter's path probabilities (random parents and tokens), a 3-token
chain per request; a cost curve shaped like a GPU's (flat, then linear). The second table compares
`allocate_round` with the simpler alternative it replaces: merging every chain into the whole tree, one allocation.

    python -m benchmarks.bench_policy [--nodes 64] [--requests 1 8 64 256]
"""

from __future__ import annotations

import argparse
import random
import time

from ddtree.budget import BudgetConfig, BudgetPolicy, ProposedTree, RoundPlan
from ddtree.cost import CostModel
from ddtree.ngram import merge_chain


def synthetic_trees(rng: random.Random, num_requests: int, num_nodes: int) -> list[list[float]]:
    trees = []
    for _ in range(num_requests):
        value, values = 0.9, []
        for _ in range(num_nodes):
            value *= rng.uniform(0.6, 1.0)
            values.append(value)
        trees.append(sorted(values, reverse=True))
    return trees


def best_of(fn, seconds: float = 0.5) -> float:
    """Best time of repeated calls over about `seconds`."""
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64, help="nodes per drafted tree")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args()
    # Flat up to 256 packed tokens (a GPU's memory-bound regime), then linear.
    verify = [(n, 0.02 * max(1.0, n / 256)) for n in (1, 16, 64, 256, 1024, 4096, 16384)]
    cost = CostModel(verify, [(r, 0.004 + 0.0001 * r) for r in (1, 16, 64, 256)])
    rng = random.Random(0)
    print("| requests | nodes per tree | plan ms | allocate ms | observe (all requests) ms | round total ms |")
    print("|---|---|---|---|---|---|")
    chain_rows = []
    for num_requests in args.requests:
        policy = BudgetPolicy(BudgetConfig(max_budget=args.nodes), cost)
        request_ids = [f"r{i}" for i in range(num_requests)]
        for rid in request_ids:
            policy.add(rid)
            policy.observe(rid, predicted=2.0, num_accepted_nodes=rng.choice([0, 1, 2, 3, 4]))
        trees = synthetic_trees(rng, num_requests, args.nodes)
        plan_s = best_of(lambda: policy.plan(request_ids))
        allocate_s = best_of(lambda: policy.allocate(request_ids, trees, 0))
        counts = policy.allocate(request_ids, trees, 0)

        def observe_all():
            for rid, p, n in zip(request_ids, trees, counts):
                policy.observe(rid, predicted=sum(p[:n]), num_accepted_nodes=min(n, 2), num_nodes=n)

        observe_s = best_of(observe_all)
        total = plan_s + 2 * allocate_s + observe_s
        print(
            f"| {num_requests} | {args.nodes} | {plan_s * 1e3:.2f} | {allocate_s * 1e3:.2f} | "
            f"{observe_s * 1e3:.2f} | {total * 1e3:.2f} |"
        )
        chain_rows.append((num_requests, *chain_allocation_seconds(rng, policy, request_ids, trees)))
    print()
    print(
        "| requests | allocate_round ms (chains merged into a first allocation's nodes) "
        "| merge into the whole trees + one allocate ms | whole / allocate_round |"
    )
    print("|---|---|---|---|")
    for num_requests, round_s, whole_s in chain_rows:
        print(f"| {num_requests} | {round_s * 1e3:.2f} | {whole_s * 1e3:.2f} | {whole_s / round_s:.2f}x |")


def chain_allocation_seconds(
    rng: random.Random, policy: BudgetPolicy, request_ids: list[str], values: list[list[float]]
) -> tuple[float, float]:
    """Best seconds of `allocate_round` with a 3-token chain per drafted request, and of the alternative."""
    trees = []
    for v in values:
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, len(v))]
        trees.append(ProposedTree(v, [rng.randrange(100) for _ in v], parents))
    chains = {rid: [rng.randrange(100) for _ in range(3)] for rid in request_ids}
    plan = RoundPlan(request_ids, [], [len(v) for v in values])
    chain_values = policy.ngram_values(3)

    def merge_whole():
        merged = [
            merge_chain(t.token_ids, t.parents, t.values, chains[rid], chain_values)[3]
            for rid, t in zip(request_ids, trees)
        ]
        return policy.allocate(request_ids, merged, 0)

    return best_of(lambda: policy.allocate_round(plan, trees, chains)), best_of(merge_whole)


if __name__ == "__main__":
    main()
