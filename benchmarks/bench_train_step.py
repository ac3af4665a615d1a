"""Seconds per drafter training step (forward, backward, optimiser) for several sampled-softmax sizes, side by side.

    python benchmarks/bench_train_step.py --num-negatives 8192 4096 0 --steps 6

The same batches (real sequences and cached features of `<data-dir>`, the shipped drafter's shape and weights) run
through each variant in turn, `--rounds` times, so load from other jobs hits every variant alike; the table prints
the median seconds of each part and the ratio of the total to the first variant. The softmax vocabulary is what
training uses: the response tokens of the data set plus `--num-negatives` sampled other tokens (`--full-softmax`
adds the full vocabulary as a last variant).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=REPO / "work" / "drafter_data")
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--num-negatives", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--full-softmax", action="store_true")
    parser.add_argument("--steps", type=int, default=6, help="batches per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-anchors", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from ddtree.loaders import resolve_drafter_path
    from ddtree.models.dflash import load_dflash
    from ddtree.training.blocks import default_gamma
    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids
    from ddtree.training.target import load_target
    from ddtree.training.train import FrozenTargetHead, block_loss, compute_precision, make_batch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")
    target_model, _ = load_target("smollm2-135m-instruct", dtype=dtype)
    head = FrozenTargetHead(target_model)
    del target_model
    config, drafter = load_dflash(resolve_drafter_path(None, args.drafter))
    drafter.float().train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-7)  # the step's cost, not its effect
    sequences = read_sequences(args.data_dir)
    if len(sequences) < args.steps * args.batch_size:
        raise ValueError(f"{args.data_dir} has {len(sequences)} sequences; need {args.steps * args.batch_size}")
    response_tokens = torch.tensor(sorted({t for s in sequences for t in s.token_ids[s.prompt_length :]}))
    reader = FeatureReader(args.data_dir, stored_layer_ids(args.data_dir), config.target_layer_ids)
    rng = random.Random(0)
    batches = [
        make_batch(
            sequences[i * args.batch_size : (i + 1) * args.batch_size],
            reader,
            config,
            args.max_anchors,
            rng,
            default_gamma(config.block_size),
        )[:2]  # (features, blocks)
        for i in range(args.steps)
    ]

    variants = {f"{len(response_tokens)} + {n} negatives": n for n in args.num_negatives}
    if args.full_softmax:
        variants[f"full ({head.vocab_size})"] = None
    parts = ("forward", "backward", "optimiser")
    times = {name: {p: [] for p in parts} for name in variants}

    def step(features, batch) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with compute_precision(device, dtype):
            loss, _ = block_loss(drafter, head, features.float(), batch)
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, num_negatives in variants.items():
            head.restrict_softmax(None if num_negatives is None else response_tokens, num_negatives or 0)
            for features, batch in batches:
                measured = step(features, batch)
                if round_ > 0:
                    for p, seconds in zip(parts, measured):
                        times[name][p].append(seconds)

    print(
        f"\n{len(sequences)} sequences in {args.data_dir}; batches of {args.batch_size} sequences x "
        f"{args.max_anchors} anchors; {args.dtype}, {args.threads} thread(s); median seconds over "
        f"{args.rounds} x {args.steps} steps\n"
    )
    print("| softmax vocabulary | forward | backward | optimiser | total | x first |")
    print("|---|---|---|---|---|---|")
    first_total = None
    for name in variants:
        medians = [statistics.median(times[name][p]) for p in parts]
        total = sum(medians)
        first_total = first_total or total
        print(
            f"| {name} | " + " | ".join(f"{m:.3f}" for m in medians) + f" | {total:.3f} | {total / first_total:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
