"""Would a draft temperature help the tree? Offline tau at small budgets when the drafter's per-position top-64
log-probs are divided by T (and renormalised over those 64, whose tail mass is small) before the tree is built:
T > 1 flattens them (wider, shallower trees), T < 1 sharpens them (deeper, narrower ones). At T = 1 the log-probs
are used as drafted: the evaluation step's tau.

    python benchmarks/bench_draft_temperature.py [--drafter DIR] [--num-sequences 12] [--temperatures 0.7 1 1.3 1.6 2]

Prints tau per category, budget and temperature on the evaluation data (work/drafter_eval), over the drafter's draft
vocabulary as served.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--eval-dir", type=Path, default=REPO / "work" / "drafter_eval")
    parser.add_argument("--num-sequences", type=int, default=12, help="per category")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3, 1.6, 2.0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from ddtree.loaders import DEFAULT_DRAFTER_DIR
    from ddtree.training.evaluate import drafts_of_sequences, load_evaluation_set, load_for_evaluation, simulate_rounds

    torch.set_num_threads(args.threads)
    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(Path(args.drafter or DEFAULT_DRAFTER_DIR))
    print("| category | tokens | T | " + " | ".join(f"tau B={b}" for b in args.budgets) + " |")
    print("|---|---|---|" + "---|" * len(args.budgets))
    for category in ("code", "math", "chat"):
        sequences, reader = load_evaluation_set(args.eval_dir / category, drafter, args.num_sequences)
        rounds = {(t, b): 0 for t in args.temperatures for b in args.budgets}
        num_tokens = 0
        for seq, first, values, ids in drafts_of_sequences(
            drafter, embed, lm_head, sequences, reader, max(64, *args.budgets), draft_token_ids
        ):
            num_tokens += len(seq.token_ids) - 1 - first
            for t in args.temperatures:
                tempered = values if t == 1 else torch.log_softmax(values / t, dim=-1)
                for b in args.budgets:
                    rounds[(t, b)] += simulate_rounds(seq.token_ids, first, ids, tempered, b)
        for t in args.temperatures:
            print(
                f"| {category} | {num_tokens} | {t:g} | "
                + " | ".join(f"{num_tokens / rounds[(t, b)]:.3f}" for b in args.budgets)
                + " |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
