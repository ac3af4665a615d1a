"""The drafter's context, on the shipped drafter: (1) the per-round extension, one `add_context` per request
against one `add_contexts` for all (one projection over every request's new tokens), side by side; (2) one draft
forward by context length (requests' contexts of unequal lengths, as in serving).

    python benchmarks/bench_draft_context.py [--threads 2] [--new-tokens 3] [--context-lengths 128 512 2048]

(1): each request holds 128 context tokens and gains `--new-tokens` (a round's accepted tokens); best of
--repeats, the two variants alternating; ms per round's extension and the ratio. (2): ms per draft forward (top-K
64), best of --repeats."""

from __future__ import annotations

import argparse
import time

import torch

from ddtree.loaders import build_workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[128, 512, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, worker, _ = build_workers()
    drafter = worker.drafter
    width = drafter.config.num_target_features
    print("| requests | one add_context per request ms | add_contexts ms | ratio |")
    print("|---|---|---|---|")
    for size in args.batch_sizes:
        ids = [f"r{i}" for i in range(size)]
        drafter.add_contexts(ids, [torch.randn(128, width) for _ in ids])
        best = {"each": float("inf"), "batched": float("inf")}
        for _ in range(args.repeats):
            for mode in best:
                features = [torch.randn(args.new_tokens, width) for _ in ids]
                start = time.perf_counter()
                if mode == "each":
                    for seq_id, f in zip(ids, features):
                        drafter.add_context(seq_id, f)
                else:
                    drafter.add_contexts(ids, features)
                best[mode] = min(best[mode], time.perf_counter() - start)
        print(
            f"| {size} | {best['each'] * 1000:.2f} | {best['batched'] * 1000:.2f} | "
            f"{best['each'] / best['batched']:.1f}x |"
        )
        for seq_id in ids:
            drafter.free(seq_id)

    print()
    print("| requests | " + " | ".join(f"draft ms, context {c}" for c in args.context_lengths) + " |")
    print("|---|" + "---|" * len(args.context_lengths))
    for size in args.batch_sizes:
        row = []
        for length in args.context_lengths:
            ids = [f"r{i}" for i in range(size)]
            drafter.add_contexts(ids, [torch.randn(length + i, width) for i in range(size)])
            best_s = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                drafter.draft(ids, [1] * size, 64)
                best_s = min(best_s, time.perf_counter() - start)
            row.append(f"{best_s * 1000:.1f}")
            for seq_id in ids:
                drafter.free(seq_id)
        print(f"| {size} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
