"""The target's tokens at T > 0: sampling every packed row of a verify pass, against argmax.

    python benchmarks/bench_sampling.py [--vocab 49152] [--rows 1 16 32] [--threads 2] [--repeats 20]

Per row count: greedy argmax (T=0), the sampler the engine runs (ddtree.accept.target_tokens_sampled, T=1, no
top-k or top-p: one keyed uniform per row and the inverse CDF), and an exponential race over the same rows for
reference (argmax of log p - log E with E a row of Exp(1) draws from a generator per row, the other way to make a
sample a function of a (seed, position) key). Each row is a request of its own at a position of its own, as in a
plain round; logits are randn * 3. Minimum over the repeats, in milliseconds, the modes alternating.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree.accept import _mix_seed, target_tokens_greedy, target_tokens_sampled


def exponential_race(logits: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    noise = torch.stack(
        [torch.empty(logits.shape[1]).exponential_(generator=torch.Generator().manual_seed(s)) for s in seeds]
    )
    return (logits.log_softmax(dim=-1) - noise.log_()).argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"vocab {args.vocab}, {args.threads} threads, torch {torch.__version__}; ms per call (min of {args.repeats})")
    print("| rows | argmax | inverse CDF (engine) | exponential race | race / inverse CDF |")
    print("|---|---|---|---|---|")
    for n in args.rows:
        logits = torch.randn(n, args.vocab, generator=gen) * 3
        seq_index, positions = torch.arange(n), torch.arange(n) + 100
        seeds = list(range(n))
        modes = {
            "argmax": lambda: target_tokens_greedy(logits),
            "inverse": lambda: target_tokens_sampled(
                logits, seq_index, positions, [1.0] * n, [1.0] * n, [0] * n, seeds
            ),
            "race": lambda: exponential_race(logits, [_mix_seed(s, p) for s, p in zip(seeds, positions.tolist())]),
        }
        best = dict.fromkeys(modes, float("inf"))
        for fn in modes.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in modes.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        ms = {k: v * 1e3 for k, v in best.items()}
        print(
            f"| {n} | {ms['argmax']:.2f} | {ms['inverse']:.2f} | {ms['race']:.2f} | {ms['race'] / ms['inverse']:.1f} |"
        )


if __name__ == "__main__":
    main()
