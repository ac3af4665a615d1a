"""What n-gram (prompt lookup) proposals add, alone and merged into DDTree trees, replayed offline at T=0.

For each evaluation sequence (`ddtree train-drafter eval-data`: prompt + the target's greedy response + features),
rounds are replayed exactly as in the offline tau evaluation: a round at position p drafts from the features of
positions < p, builds the tree of B nodes, optionally merges the request's n-gram chain (ddtree.ngram: up to
--ngram-tokens tokens that followed the most recent earlier occurrence of its last 1-3 tokens), accepts the deepest
path the target's continuation follows, and costs draft + verify(1 + nodes) from the cost model that
benchmarks/sim_budget_policy.py measured (work/sim_budget/cost-1threads.json). Prints tokens/s relative to `off`
per category for the n-gram chain alone (no drafter call), fixed B, and fixed B with the chain merged in:

    python benchmarks/sim_ngram.py [--num-sequences 10] [--max-tokens 48] [--budgets 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree.budget_replay import accepted_along  # noqa: E402
from ddtree.cost import CostModel  # noqa: E402
from ddtree.ngram import NgramIndex, merge_chain  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--eval-dir", type=Path, default=REPO / "work" / "drafter_eval")
    parser.add_argument("--cost", type=Path, default=REPO / "work" / "sim_budget" / "cost-1threads.json")
    parser.add_argument("--num-sequences", type=int, default=10, help="per category")
    parser.add_argument("--max-tokens", type=int, default=None, help="replay only each response's first tokens")
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ngram-tokens", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from ddtree.loaders import resolve_drafter_path
    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids
    from ddtree.training.evaluate import draft_topk_at_every_anchor, load_for_evaluation
    from ddtree.training.prompts import CATEGORIES
    from ddtree.tree import build_tree_from_topk

    if not args.cost.exists():
        raise ValueError(f"{args.cost} is missing: run benchmarks/sim_budget_policy.py first (it measures it)")
    points = json.loads(args.cost.read_text())
    cost = CostModel([tuple(p) for p in points["verify"]], [tuple(p) for p in points["draft"]])
    torch.set_num_threads(args.threads)
    drafter_dir = resolve_drafter_path(None, args.drafter)
    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(drafter_dir)
    chain_values = [0.5, 0.35, 0.25, 0.18, 0.12][: args.ngram_tokens]  # only their order matters for fixed B
    variants = [(0, True)] + [(b, ngram) for b in args.budgets for ngram in (False, True)]
    names = ["n-gram alone" if b == 0 else f"B={b}" + (" + n-gram" if ngram else "") for b, ngram in variants]
    print(
        f"\n{drafter_dir.name}, {args.num_sequences} sequences per category"
        + (f", first {args.max_tokens} tokens" if args.max_tokens else "")
        + f", n-gram chains of up to {args.ngram_tokens} tokens: simulated tokens/s over off (tau)\n"
    )
    print("| category | " + " | ".join(names) + " |")
    print("|---" * (1 + len(names)) + "|")
    for category in CATEGORIES:
        data_dir = args.eval_dir / category
        reader = FeatureReader(data_dir, stored_layer_ids(data_dir), drafter.config.target_layer_ids)
        totals = {v: [0.0, 0, 0] for v in variants}  # seconds, tokens, rounds
        off_seconds = 0.0
        for seq in read_sequences(data_dir)[: args.num_sequences]:
            end = len(seq.token_ids) if args.max_tokens is None else seq.prompt_length + args.max_tokens
            ids, first = seq.token_ids[:end], seq.prompt_length
            values, top_ids = draft_topk_at_every_anchor(
                drafter,
                embed,
                lm_head,
                reader(seq)[: len(ids) - 1],
                ids,
                first,
                max(args.budgets),
                draft_token_ids=draft_token_ids,
            )
            off_seconds += (len(ids) - 1 - first) * cost.verify_seconds(1)
            for budget, use_ngram in variants:
                p, index = first, NgramIndex(ids[: first + 1])
                while p < len(ids) - 1:
                    tokens, parents, probs = [], [], []
                    if budget:
                        tree = build_tree_from_topk(values[p - first], top_ids[p - first], budget)
                        tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()
                        probs = tree.path_logprobs.exp().tolist()
                    chain = index.propose(args.ngram_tokens) if use_ngram else []
                    if chain:
                        tokens, parents, _, probs = merge_chain(
                            tokens, parents, probs, chain, chain_values[: len(chain)]
                        )
                    accepted = accepted_along(tokens, parents, ids[p + 1 :])
                    t = totals[(budget, use_ngram)]
                    t[0] += (cost.draft_seconds(1) if budget else 0.0) + cost.verify_seconds(1 + len(tokens))
                    t[1] += 1 + accepted
                    t[2] += 1
                    index.extend(ids[p + 1 : p + 2 + accepted])
                    p += 1 + accepted
        off_rate = sum(t[1] for t in totals.values()) / len(totals) / off_seconds
        cells = [f"{t[1] / t[0] / off_rate:.2f}x ({t[1] / t[2]:.2f})" for t in totals.values()]
        print(f"| {category} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
