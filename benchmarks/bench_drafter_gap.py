"""Where a drafter's acceptance is lost: on its training sequences, on unseen sequences of the same distribution, or
on the held-out evaluation sets (other templates, topics and HumanEval).

    python benchmarks/bench_drafter_gap.py --drafter work/drafter_train3/drafter --num-seen 4088 --num-sequences 15

`--num-seen N`: the first N sequences of `<data-dir>/responses.jsonl` were in the drafter's training data; the ones
after them (generated later) were not, and come from the same prompt generators. Prints offline tau (chain and
DDTree at the budgets) per category for the last `--num-sequences` seen sequences, the first unseen ones, and the
first evaluation sequences: seen ~ unseen means no overfitting; unseen >> evaluation means the evaluation prompts
are out of the training distribution, so broader training prompts (not more of the same) would raise tau there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--data-dir", type=Path, default=REPO / "work" / "drafter_data")
    parser.add_argument("--eval-dir", type=Path, default=REPO / "work" / "drafter_eval")
    parser.add_argument("--num-seen", type=int, required=True, help="sequences of the data set the drafter trained on")
    parser.add_argument("--num-sequences", type=int, default=15, help="per category and group")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from ddtree.loaders import resolve_drafter_path
    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids
    from ddtree.training.evaluate import evaluate_tau, load_for_evaluation
    from ddtree.training.prompts import CATEGORIES

    torch.set_num_threads(args.threads)
    drafter_dir = resolve_drafter_path(None, args.drafter)
    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(drafter_dir)
    sequences = read_sequences(args.data_dir)
    if not 0 < args.num_seen < len(sequences):
        raise ValueError(f"--num-seen must be in (0, {len(sequences)}): the data set has {len(sequences)} sequences")
    seen, unseen = sequences[: args.num_seen], sequences[args.num_seen :]
    reader = FeatureReader(args.data_dir, stored_layer_ids(args.data_dir), drafter.config.target_layer_ids)
    budgets = tuple(args.budgets)
    print(
        f"\n{drafter_dir}: {len(seen)} seen, {len(unseen)} unseen sequences; {args.num_sequences} per category and "
        f"group\n"
    )
    print("| category | group | seqs | tokens | tau chain | " + " | ".join(f"tau B={b}" for b in budgets) + " |")
    print("|---" * (5 + len(budgets)) + "|")
    for category in CATEGORIES:
        eval_dir = args.eval_dir / category
        groups = {
            "seen (trained on)": ([s for s in seen if s.category == category][-args.num_sequences :], reader),
            "unseen, same generators": ([s for s in unseen if s.category == category][: args.num_sequences], reader),
            "evaluation set": (
                read_sequences(eval_dir)[: args.num_sequences],
                FeatureReader(eval_dir, stored_layer_ids(eval_dir), drafter.config.target_layer_ids),
            ),
        }
        for group, (group_sequences, group_reader) in groups.items():
            r = evaluate_tau(
                drafter,
                embed,
                lm_head,
                group_sequences,
                group_reader,
                category,
                budgets,
                draft_token_ids=draft_token_ids,
            )
            print(
                f"| {category} | {group} | {r.num_sequences} | {r.num_tokens} | {r.tau_chain:.2f} | "
                + " | ".join(f"{r.tau_tree(b):.2f}" for b in budgets)
                + " |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
