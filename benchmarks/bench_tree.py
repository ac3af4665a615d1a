"""Tree building and packing: the reference heap (Python, one request at a time) vs the batched builder.

    python -m benchmarks.bench_tree [--vocab 49152] [--positions 15] [--budgets 16 64 256 1024]
                                    [--requests 1 16 64] [--threads 1] [--clock cpu] [--scale 3] [--device cpu]

Per (requests R, budget B): the per-position top-K alone (K = min(B, V)), R heaps looped in Python, the batched
builder (both from the same top-K), the speedup heap / batched, and pack() of the batched trees. Draft log-probs
are log_softmax(randn * scale) with fixed seeds (scale 3 by default); each timing cycles over a few different
inputs (repeating one input lets the branch predictor learn the sorts), and reports the median in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddtree.packing import pack
from ddtree.tree import build_tree_from_topk, build_trees_from_topk, topk_logprobs

NUM_INPUTS = 3


def median_ms(fns, sync, clock, min_repeats: int = 6, min_seconds: float = 0.5) -> float:
    """Median time of fns[i % len(fns)]() over repeats, after one warm-up call of each."""
    for fn in fns:
        fn()
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < min_seconds and len(times) < 300):
        fn = fns[len(times) % len(fns)]
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def heap_with_visibility(values: torch.Tensor, token_ids: torch.Tensor, budget: int):
    """The per-request baseline of the issue: the Python heap plus its dense visibility matrix built node by node
    (each row = the parent's row + itself), as a batch-size-1 implementation builds its verify mask."""
    tree = build_tree_from_topk(values, token_ids, budget)
    n = tree.num_nodes
    visibility = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [1 + B, 1 + B], row 0 = the root
    visibility[0, 0] = True
    for i, parent in enumerate(tree.parents.tolist()):
        visibility[i + 1] = visibility[parent + 1]
        visibility[i + 1, i + 1] = True
    return tree, visibility


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--positions", type=int, default=15)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (time.process_time), steadier on a shared machine; use with --threads 1",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=3.0, help="logits = randn * scale (larger: deeper trees)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"# V={args.vocab} L={args.positions} logits=randn*{args.scale:g} device={device} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} (median ms of {args.clock} time)"
    )
    header = (
        "R",
        "B",
        "top-K",
        "heap x R",
        "batched",
        "speedup",
        "pack",
        "heap+mask x R",
        "speedup vs batched+pack",
        "nodes/req",
        "max depth",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for num_requests in args.requests:
        inputs = []
        for i in range(NUM_INPUTS):
            g = torch.Generator().manual_seed(args.seed * 1000 + i)
            logits = torch.randn(num_requests, args.positions, args.vocab, generator=g) * args.scale
            inputs.append(torch.log_softmax(logits, dim=-1).to(device))  # [R, L, V]
            del logits
        for budget in args.budgets:
            k = min(budget, args.vocab)
            budgets = [budget] * num_requests
            topk_ms = median_ms([lambda lp=lp: topk_logprobs(lp, k) for lp in inputs], sync, clock)
            topks = [topk_logprobs(lp, k) for lp in inputs]
            # The heap runs on the host, as in the reference; the copy is not timed.
            host_topks = [(v.cpu(), i.cpu()) for v, i in topks]
            heap_ms = median_ms(
                [
                    lambda v=v, i=i: [build_tree_from_topk(v[r], i[r], budget) for r in range(num_requests)]
                    for v, i in host_topks
                ],
                sync,
                clock,
                min_repeats=3,
                min_seconds=0.3,
            )
            batched_ms = median_ms(
                [lambda v=v, i=i: build_trees_from_topk(v, i, budgets) for v, i in topks], sync, clock
            )
            heap_mask_ms = median_ms(
                [
                    lambda v=v, i=i: [heap_with_visibility(v[r], i[r], budget) for r in range(num_requests)]
                    for v, i in host_topks
                ],
                sync,
                clock,
                min_repeats=3,
                min_seconds=0.3,
            )
            all_trees = [build_trees_from_topk(v, i, budgets) for v, i in topks]
            roots, cached = [0] * num_requests, [100] * num_requests
            pack_ms = median_ms([lambda t=t: pack(t, roots, cached) for t in all_trees], sync, clock)
            trees = all_trees[0]
            row = (
                num_requests,
                budget,
                f"{topk_ms:.2f}",
                f"{heap_ms:.2f}",
                f"{batched_ms:.2f}",
                f"{heap_ms / batched_ms:.1f}x",
                f"{pack_ms:.2f}",
                f"{heap_mask_ms:.2f}",
                f"{heap_mask_ms / (batched_ms + pack_ms):.1f}x",
                trees[0].num_nodes,
                max(int(t.depths.max()) for t in trees if t.num_nodes),
            )
            print("| " + " | ".join(str(x) for x in row) + " |", flush=True)


if __name__ == "__main__":
    main()
