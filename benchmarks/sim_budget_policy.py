"""Budget policies replayed on real drafter traces: which one commits the most tokens per second (T=0).

Records, for the evaluation data (`ddtree train-drafter eval-data`: its prompts, the target's greedy responses and
features), what a round at every position accepts with the first n nodes of the drafter's tree (one drafter
forward per position, as the offline tau evaluation), then replays the engine's own `BudgetPolicy` on these traces
(`ddtree/budget_replay.py`) with a cost model measured on this machine (the one the engine measures at start-up).
No model runs during the replay, so policies compare without timing noise:

    python benchmarks/sim_budget_policy.py [--num-sequences 10] [--max-tokens 48 --first-sequences 2]
                                           [--concurrency 1] [--draft-cost-scale 1] [--threads 1]

Prints, per category and over all, the simulated tokens per second of `off`, fixed budgets, `auto` (the engine's
policy, with its n-gram chains), `auto, no n-gram`, `auto, no fallback`, and `oracle` (each round the n in
0..max_budget best for that round alone, knowing its outcome, drafter only: a reference for what better predictions
could win), with tau, the share of request-rounds drafted and the share of tokens from chains verified without a
draft.

Traces and the cost model are cached under work/sim_budget/ (delete them to remeasure; the cost model is measured
with --threads threads: measure it on a quiet machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree.budget import BudgetConfig, BudgetPolicy  # noqa: E402
from ddtree.budget_replay import Replay, Result, Trace  # noqa: E402
from ddtree.cost import CostModel  # noqa: E402


def compute_traces(
    drafter_dir: Path, eval_dir: Path, categories: list[str], num_sequences: int, max_budget: int
) -> list[Trace]:

    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids
    from ddtree.training.evaluate import draft_topk_at_every_anchor, load_for_evaluation
    from ddtree.tree import build_tree_from_topk

    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(drafter_dir)
    traces = []
    for category in categories:
        data_dir = eval_dir / category
        reader = FeatureReader(data_dir, stored_layer_ids(data_dir), drafter.config.target_layer_ids)
        for seq in read_sequences(data_dir)[:num_sequences]:
            first = seq.prompt_length
            values, ids = draft_topk_at_every_anchor(
                drafter, embed, lm_head, reader(seq), seq.token_ids, first, max_budget, draft_token_ids=draft_token_ids
            )
            trace = Trace(category, [], [], [], [], list(seq.token_ids), first)
            for row, anchor in enumerate(range(first, len(seq.token_ids) - 1)):
                tree = build_tree_from_topk(values[row], ids[row], max_budget)
                trace.path_probs.append(tree.path_logprobs.exp().tolist())
                trace.matched_nodes.append(_matched_nodes(tree, seq.token_ids[anchor + 1 :]))
                trace.tree_tokens.append(tree.token_ids.tolist())
                trace.tree_parents.append(tree.parents.tolist())
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
    from ddtree.loaders import build_workers

    target, drafter, tokenizer = build_workers()
    engine = Engine(EngineConfig(max_num_seqs=16, max_budget=max_budget), target, drafter, tokenizer)
    return engine.budget.cost


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
    parser.add_argument(
        "--draft-cost-scale",
        type=float,
        default=1.0,
        help="multiply the drafter's measured seconds (a slower drafter: where drafting pays less)",
    )
    parser.add_argument(
        "--ngram-tokens",
        type=int,
        default=3,
        help="n-gram chain length of the auto rows (as the engine's default); 'auto, no n-gram' runs without",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from ddtree.loaders import resolve_drafter_path
    from ddtree.training.prompts import CATEGORIES

    torch.set_num_threads(args.threads)
    drafter_dir = resolve_drafter_path(None, args.drafter)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    weights = drafter_dir / "model.safetensors"
    key = hashlib.sha1(f"{weights.resolve()}:{weights.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    traces_path = args.cache_dir / f"traces-v2-{key}-{args.num_sequences}-{args.max_budget}.json"  # v2: tokens
    if traces_path.exists():
        traces = [Trace(**t) for t in json.loads(traces_path.read_text())]
    else:
        traces = compute_traces(drafter_dir, args.eval_dir, list(CATEGORIES), args.num_sequences, args.max_budget)
        traces_path.write_text(json.dumps([t.__dict__ for t in traces]))
    if args.first_sequences is not None:
        traces = [t for c in CATEGORIES for t in [t for t in traces if t.category == c][: args.first_sequences]]
    if args.max_tokens is not None:
        traces = [t.truncated(args.max_tokens - 1) for t in traces]
    cost_path = args.cache_dir / f"cost-{args.threads}threads.json"
    if cost_path.exists():
        points = json.loads(cost_path.read_text())
        cost = CostModel([tuple(p) for p in points["verify"]], [tuple(p) for p in points["draft"]])
    else:
        cost = measure_cost_model(args.max_budget)
        cost_path.write_text(json.dumps({"verify": cost.verify_points, "draft": cost.draft_points}))
    # the replay's clock is this model: it never drifts (no refresh)
    draft_points = [(n, seconds * args.draft_cost_scale) for n, seconds in cost.draft_points]
    cost = CostModel(cost.verify_points, draft_points, refresh_weight=0.0)
    print(
        "\nverify ms: "
        + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cost.verify_points)
        + "; draft ms: "
        + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cost.draft_points)
    )

    replay = Replay(cost, args.concurrency)
    rows: dict[str, dict[str, Result]] = {}
    rows["off"] = replay.run_off(traces)
    for b in args.budgets:
        rows[f"B={b}"] = replay.run_policy(BudgetPolicy(BudgetConfig(fixed_budget=b), cost), traces)
    rows["auto"] = replay.run_policy(
        BudgetPolicy(BudgetConfig(max_budget=args.max_budget), cost), traces, ngram_tokens=args.ngram_tokens
    )
    rows["auto, no n-gram"] = replay.run_policy(BudgetPolicy(BudgetConfig(max_budget=args.max_budget), cost), traces)
    rows["auto, no fallback"] = replay.run_policy(
        BudgetPolicy(BudgetConfig(max_budget=args.max_budget, allow_fallback=False), cost),
        traces,
        ngram_tokens=args.ngram_tokens,
    )
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
    print("| policy | " + " | ".join(categories) + " | tau (all) | drafted (all) | n-gram tokens (all) |")
    print("|---" * (4 + len(categories)) + "|")
    for name, res in rows.items():
        cells = [f"{res[c].tokens_per_second:.1f} ({res[c].tokens_per_second / base[c]:.2f}x)" for c in categories]
        a = res["all"]
        print(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {a.tau:.2f} | {100 * a.drafted_request_rounds / max(a.request_rounds, 1):.0f}%"
            + f" | {100 * a.ngram_tokens / max(a.tokens, 1):.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
