"""FlexAttention block masks for packed verify batches: `create_block_mask` (the mask evaluated over the whole
query x key grid) against `PackedBatch.flex_block_mask` (the block list from the batch layout), side by side.

    python benchmarks/bench_flex_mask.py [--threads 2]

Prints one row per batch shape: milliseconds to build each mask (best of --repeats) and their ratio, and the
number of key blocks each lists (the layout may list a block that holds only keys no query of it sees)."""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from ddtree.packing import pack
from ddtree.tree import build_tree

SHAPES = [(1, 16, 256), (4, 16, 256), (8, 32, 1024), (32, 64, 2048)]  # requests, budget, cached tokens each


def best_ms(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(
        "| requests | packed tokens | keys | create_block_mask ms | from layout ms | ratio | blocks (grid / layout) |"
    )
    print("|---|---|---|---|---|---|---|")
    for num_requests, budget, num_cached in SHAPES:
        trees = [
            build_tree(torch.log_softmax(torch.randn(8, 200, generator=g), -1), budget) for _ in range(num_requests)
        ]
        packed = pack(trees, [1] * num_requests, [num_cached] * num_requests)
        num_keys = packed.kv_starts()[-1]
        grid_ms, grid = best_ms(
            lambda: create_block_mask(packed.flex_mask_mod(), None, None, packed.num_tokens, num_keys, device="cpu"),
            args.repeats,
        )
        layout_ms, layout = best_ms(packed.flex_block_mask, args.repeats)

        def listed(m) -> int:
            return int(m.kv_num_blocks.sum()) + int(m.full_kv_num_blocks.sum())

        print(
            f"| {num_requests} | {packed.num_tokens} | {num_keys} | {grid_ms:.1f} | {layout_ms:.2f} | "
            f"{grid_ms / layout_ms:.0f}x | {listed(grid)} / {listed(layout)} |"
        )


if __name__ == "__main__":
    main()
