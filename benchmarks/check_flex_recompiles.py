"""How many compiled variants FlexAttention needs over varied verify batches (dynamo compiles one per pattern of
sizes that are 1 or happen to be equal; past `recompile_limit` it would run flex_attention eagerly). Dynamo's
guards do not depend on the device, so this CPU run (inductor's CPU template) counts what a GPU would compile.

    python benchmarks/check_flex_recompiles.py [--num-batches 40] [--threads 2]

Prints one row per batch: requests, packed tokens, ancestor-bit words, seconds, compiled variants so far. Batches of
one query block (<= 128 packed tokens) fail to compile on the CPU with torch 2.13 (an inductor C++ codegen bug,
not on GPUs): shown as `CPU compile bug` and not counted."""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import flex_attention

from ddtree.packing import FLEX_BLOCK_SIZE, pack
from ddtree.tree import build_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-batches", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # as the runner sets it on GPUs
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=True)
    pool = torch.zeros(2, 3, 40_000, 64)  # [k/v, kv_heads, slots, head_dim], SmolLM2's attention shape
    print("| batch | requests | packed tokens | bit words | seconds | variants |")
    print("|---|---|---|---|---|---|")
    for i in range(args.num_batches):
        num_requests = rnd.choice([1, 2, 3, 4, 8, 16, 32])
        budgets = [rnd.choice([0, 1, 4, 8, 16, 32, 64, 100]) for _ in range(num_requests)]
        cached = [rnd.randint(1, 600) for _ in range(num_requests)]
        trees = [build_tree(torch.log_softmax(torch.randn(8, 30, generator=g), -1), b) for b in budgets]
        packed = pack(trees, [1] * num_requests, cached)
        if packed.num_tokens == num_requests:
            continue  # root-only batches do not use FlexAttention
        lens = [c + packed.segment_len(r) for r, c in enumerate(cached)]
        offsets = [sum(lens[:r]) + 10 * r for r in range(num_requests)]  # regions with free slots between
        end = offsets[-1] + lens[-1]
        block_mask = packed.flex_block_mask(kv_offsets=offsets, num_keys=end)
        q = torch.randn(1, 9, packed.num_tokens, 64, generator=g)
        start = time.perf_counter()
        try:
            flex(
                q, pool[0, :, :end].unsqueeze(0), pool[1, :, :end].unsqueeze(0), block_mask=block_mask, enable_gqa=True
            )
            status = ""
        except Exception as e:  # noqa: BLE001 - the CPU inductor bug, reported in the row
            if packed.num_tokens > FLEX_BLOCK_SIZE:
                raise
            status = f" (CPU compile bug: {type(e).__name__})"
        variants = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(
            f"| {i} | {num_requests} | {packed.num_tokens} | {packed.ancestor_bits.shape[1]} | "
            f"{time.perf_counter() - start:.2f}{status} | {variants} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
