"""Does the factorised tree value overrate the descendants of a non-top-1 branch? Offline tau per tree value.

    python -m benchmarks.bench_tree_value --eval-dir work/drafter_eval --num-sequences 20 --budgets 4 8 16 64

DDTree values a node by the product of the drafter's per-position probabilities along its path (the factorised
draft distribution). A block-diffusion drafter predicts all positions at once, so its distribution at depth d + 1
describes the continuation of its own likely path; after a branch that left its top-1 token at some depth, that
prediction is likely to be less good. This script builds the trees with the value

    log q(u) + depth_gap x (number of ancestors of u whose token is not its position's top 1)

(depth_gap <= 0: the descendants of a deviation are discounted; 0 is DDTree) and measures the resulting offline tau
on the evaluation data (the target's greedy responses, T = 0), exactly as `ddtree train-drafter eval` does: at every
round the tree of B nodes is walked along the target's own continuation. The value stays non-increasing along
paths and over siblings, so the best-first heap still gives prefix-closed trees. Prints tau per category, budget
and discount, with the ratio to DDTree's.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path


def build_tree(values: list[list[float]], ids: list[list[int]], budget: int, depth_gap: float):
    """The best-first heap of ddtree.tree.build_tree_from_topk with the discounted value: (tokens, parents)."""
    max_depth, num_ranks = len(values), len(values[0])
    # entry: (-value, depth, parent's order in its depth, rank, parent node, value base of the parent's children)
    heap = [(-values[0][0], 1, 0, 0, -1, 0.0)]
    popped_at_depth = [0] * (max_depth + 1)
    tokens, parents = [], []
    while heap and len(tokens) < budget:
        neg_value, depth, parent_order, rank, parent, base = heapq.heappop(heap)
        node, value = len(tokens), -neg_value
        order = popped_at_depth[depth]
        popped_at_depth[depth] += 1
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        if rank + 1 < num_ranks:
            heapq.heappush(heap, (-(base + values[depth - 1][rank + 1]), depth, parent_order, rank + 1, parent, base))
        if depth < max_depth:
            child_base = value + (depth_gap if rank > 0 else 0.0)
            heapq.heappush(heap, (-(child_base + values[depth][0]), depth + 1, order, 0, node, child_base))
    return tokens, parents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-dir", type=Path, default=Path("work/drafter_eval"))
    parser.add_argument("--drafter", type=Path, default=None, help="default: the shipped drafter")
    parser.add_argument("--num-sequences", type=int, default=20, help="per category")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument(
        "--gammas",
        type=float,
        nargs="+",
        default=[1.0, 0.7, 0.5, 0.3, 0.15],
        help="discount factors per deviation (depth_gap = log gamma; 1 is DDTree)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from ddtree.loaders import DEFAULT_DRAFTER_DIR
    from ddtree.training.evaluate import accepted_length, drafts_of_sequences, load_evaluation_set, load_for_evaluation
    from ddtree.training.prompts import CATEGORIES

    torch.set_num_threads(args.threads)
    drafter_dir = args.drafter or DEFAULT_DRAFTER_DIR
    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(drafter_dir)
    top_k = max(args.budgets)
    gaps = [math.log(g) for g in args.gammas]
    print(f"drafter {drafter_dir}; {args.num_sequences} sequences per category; T = 0")
    header = "| category | B | " + " | ".join(f"gamma {g:g}" for g in args.gammas) + " |"
    rows = []
    for category in CATEGORIES:
        sequences, reader = load_evaluation_set(args.eval_dir / category, drafter, args.num_sequences)
        rounds = {(b, gap): 0 for b in args.budgets for gap in gaps}
        num_tokens = 0
        for seq, first, values, ids in drafts_of_sequences(
            drafter, embed, lm_head, sequences, reader, top_k, draft_token_ids
        ):
            values, ids = values.double().tolist(), ids.tolist()
            num_tokens += len(seq.token_ids) - 1 - first
            for b in args.budgets:
                for gap in gaps:
                    p = first
                    while p < len(seq.token_ids) - 1:
                        row = p - first
                        tokens, parents = build_tree([v[:b] for v in values[row]], [i[:b] for i in ids[row]], b, gap)
                        p += 1 + accepted_length(tokens, parents, seq.token_ids[p + 1 :])
                        rounds[(b, gap)] += 1
        for b in args.budgets:
            taus = [num_tokens / rounds[(b, gap)] for gap in gaps]
            rows.append(
                f"| {category} | {b} | "
                + " | ".join(f"{t:.3f}" + ("" if i == 0 else f" ({t / taus[0]:.3f}x)") for i, t in enumerate(taus))
                + " |"
            )
        print(f"  {category}: {len(sequences)} sequences, {num_tokens} tokens", flush=True)
    print(header)
    print("|---|---|" + "---|" * len(gaps))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
