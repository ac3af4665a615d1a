"""One draft forward of the shipped drafter: full vocabulary vs its draft vocabulary (draft_vocab.json), and the
draft vocabulary on torch's kernels vs the native panel GEMM (ddtree.kernels) with float32 and with bfloat16
panels (the default: bf16 dot products).

    python benchmarks/bench_draft.py                 # batch sizes 1 4 16, top-K 64, 128 context tokens, 1 thread

The drafter shares the target's LM head ([576, 49152] for SmolLM2); over the draft vocabulary it computes the logits
of those tokens only. The variants share the target's weights and run alternating, best of `--repeats`
(DFlashDrafter.measure_draft_cost); the table prints ms per draft forward and the ratios to the last column.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    from ddtree.drafter import DFlashDrafter
    from ddtree.loaders import load_target_worker, resolve_drafter_path

    torch.set_num_threads(args.threads)
    path = resolve_drafter_path(None, args.drafter)
    head = load_target_worker(None, path).model.head()
    drafters = {
        "full vocab, torch": DFlashDrafter.load(path, head, use_draft_vocab=False, cpu_kernels=False),
        "draft vocab, torch": DFlashDrafter.load(path, head, cpu_kernels=False),
        "draft vocab, native f32": DFlashDrafter.load(path, head, kernel_weight_dtype=torch.float32),
        "draft vocab, native bf16": DFlashDrafter.load(path, head, kernel_weight_dtype=torch.bfloat16),
    }
    if drafters["draft vocab, torch"].draft_token_ids is None:
        raise ValueError(f"{path} has no draft_vocab.json")
    if not drafters["draft vocab, native bf16"].uses_cpu_kernels:  # no compiler here: torch's kernels only
        del drafters["draft vocab, native f32"], drafters["draft vocab, native bf16"]
    best = {name: {b: float("inf") for b in args.batch_sizes} for name in drafters}
    for _ in range(args.repeats):  # alternate, so that load from other jobs hits both alike
        for name, drafter in drafters.items():
            for b, seconds in drafter.measure_draft_cost(args.batch_sizes, args.top_k, num_repeats=1):
                best[name][b] = min(best[name][b], seconds)
    vocab_size = drafters["draft vocab, torch"].draft_token_ids.numel()
    print(
        f"\n{path.name}: draft vocabulary {vocab_size} of {head.config.vocab_size} tokens; top-K {args.top_k}, "
        f"{args.threads} thread(s), best of {args.repeats}; ms per draft forward (x the last column)"
    )
    names = list(drafters)
    print(f"{'requests':>9}" + "".join(f"{name:>26}" for name in names))
    for b in args.batch_sizes:
        last = best[names[-1]][b]
        print(f"{b:>9}" + "".join(f"{1000 * best[n][b]:>18.2f} ({best[n][b] / last:4.2f}x)" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
