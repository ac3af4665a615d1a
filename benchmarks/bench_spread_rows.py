"""Extra verify rows in one request against the same rows spread over many: what a loaded round's chains cost.

    python benchmarks/bench_spread_rows.py                       # 16 requests of 128 cached tokens, 2 threads
    python benchmarks/bench_spread_rows.py --requests 8 --threads 1

A verify pass over R requests carries each request's root, and some of them also carry a tree or an n-gram chain.
The cost model (ddtree/cost.py) prices such a pass by its packed tokens N and its requests R alike, wherever the
rows beyond the roots sit. On the CPU kernels a request with rows beyond its root attends through the masked path
(a dense mask per tree, ddtree/models/target.py), so where the same rows sit matters. The passes below all verify R
roots; the extra rows sit in one request (one chain) or spread over several (a chain each), the modes interleaved
and timed as the median of `--repeats`. "x spread" is a pass's time over the one-chain pass of the same N, the
pass the cost model prices alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="cached tokens per request")
    p.add_argument("--extra", type=int, nargs="+", default=[8, 16], help="rows beyond the roots")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    if min(args.requests, args.context, args.threads, args.repeats, *args.extra) < 1:
        p.error("--requests, --context, --extra, --threads and --repeats must be >= 1")
    return args


def layouts(num_requests: int, extra: int) -> dict[str, list[int]]:
    """Chain lengths per request for `extra` rows beyond the roots: one request, then spread evenly over more."""
    out = {}
    for holders in (1, 2, 4, 8, 16, 32):
        if holders > num_requests or extra % holders:
            continue
        out[f"{extra} rows in {holders} request{'s' if holders > 1 else ''}"] = [extra // holders] * holders + [0] * (
            num_requests - holders
        )
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from ddtree.models.target import TargetModel
    from ddtree.packing import pack
    from ddtree.tree import DraftTree

    torch.set_num_threads(args.threads)
    model = TargetModel.load("default", dtype=torch.float32, max_kv_bytes=2**30)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    seq_ids = list(range(args.requests))
    for s in seq_ids:
        model.kv.allocate(s, args.context + max(args.extra) + 1)
    model.prefill(seq_ids, [context] * args.requests)

    def packed_of(lengths: list[int]):
        trees = [
            DraftTree.chain(torch.randint(0, vocab, (n,), generator=gen).tolist()) if n else DraftTree.empty()
            for n in lengths
        ]
        return pack(trees, [context[-1]] * args.requests, [args.context] * args.requests)

    roots_only = f"{args.requests} roots"
    cases = {roots_only: packed_of([0] * args.requests)}
    for extra in args.extra:
        cases.update({name: packed_of(lengths) for name, lengths in layouts(args.requests, extra).items()})

    def verify(packed) -> float:
        t0 = time.perf_counter()
        model.verify(seq_ids, packed)
        seconds = time.perf_counter() - t0
        for s in seq_ids:
            model.commit(s, [])  # back to the cached context: every pass sees the same cache
        return seconds

    for _ in range(3):  # warm-up
        for packed in cases.values():
            verify(packed)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, packed in cases.items():
            times[name].append(verify(packed))
    median = {name: statistics.median(t) for name, t in times.items()}
    roots = median[roots_only]
    print(
        f"{args.requests} requests of {args.context} cached tokens, {args.threads} thread(s), median of {args.repeats}:"
    )
    print("| pass | packed tokens | ms | x roots | x spread |")
    print("|---|---|---|---|---|")
    print(f"| {roots_only} | {args.requests} | {1000 * roots:.1f} | 1.00 | - |")
    for extra in args.extra:
        one = median[f"{extra} rows in 1 request"]
        for name in layouts(args.requests, extra):
            print(
                f"| {name} | {args.requests + extra} | {1000 * median[name]:.1f} | {median[name] / roots:.2f} | "
                f"{median[name] / one:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
