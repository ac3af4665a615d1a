"""float32 vs bfloat16 panels for the native CPU kernels, side by side in one run.

    python benchmarks/bench_panel_dtype.py                  # 2 threads, the embedded SmolLM2-135M
    python benchmarks/bench_panel_dtype.py --threads 1 --repeats 30

Two tables. (1) `panel_linear` alone on the shapes of SmolLM2's layers, its LM head and the drafter's draft head
(16,384 tokens), at 1, 8 and 16 rows: ms per product for float32 and bfloat16 panels (bf16-rounded inputs and
weights, float32 sums), and the ratio. (2) The target runner loaded twice, float32 panels and bfloat16 panels
(`TargetModel(kernel_weight_dtype=...)`, what `dtype="bfloat16"` gives on a CPU): a one-request decode step, a
verify of 32 packed tree tokens and a 16-request decode step, at 128 cached tokens. Every measurement runs
round-robin with its counterpart, `--repeats` rounds; times are the minimum (median in brackets).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_runtime import timed_interleaved  # noqa: E402  (round-robin timing: min and median)


def ms(x: tuple[float, float]) -> str:
    return f"{1e3 * x[0]:.3f} ({1e3 * x[1]:.3f})"


def gemm_table(ops, repeats: int) -> None:
    from ddtree.kernels import NO_TENSOR, pack_panels

    shapes = [
        ("q/k/v", 576, 960),
        ("o", 576, 576),
        ("gate/up", 576, 3072),
        ("down", 1536, 576),
        ("draft head", 576, 16384),
        ("LM head", 576, 49152),
    ]
    gen = torch.Generator().manual_seed(0)
    print("\n| matrix [K, N] | rows | float32 ms | bfloat16 ms | float32 / bfloat16 |\n|---|---|---|---|---|")
    for name, k, n in shapes:
        w = torch.randn(k, n, generator=gen)
        panels = {dtype: pack_panels(w, dtype) for dtype in (torch.float32, torch.bfloat16)}
        for rows in (1, 8, 16):
            x = torch.randn(rows, k, generator=gen)
            t = timed_interleaved(
                {dtype: (lambda p=p: ops.panel_linear(x, p, n, NO_TENSOR, NO_TENSOR)) for dtype, p in panels.items()},
                repeats,
            )
            f32, bf16 = t[torch.float32], t[torch.bfloat16]
            print(f"| {name} [{k}, {n}] | {rows} | {ms(f32)} | {ms(bf16)} | {f32[0] / bf16[0]:.2f} |")


def runner_table(args) -> None:
    from ddtree.models.target import TargetModel
    from ddtree.models.testing import random_draft_tree
    from ddtree.packing import pack

    runners = {
        dtype: TargetModel.load(args.model, max_kv_bytes=2**28, kernel_weight_dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }
    gen = torch.Generator().manual_seed(0)
    vocab = runners[torch.float32].config.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    tree = random_draft_tree(31, 8, vocab, gen)
    fns = {}
    for dtype, runner in runners.items():
        seq_ids = list(range(16))
        for s in seq_ids:
            runner.kv.allocate(s, args.context + 64)
        runner.prefill(seq_ids, [context] * 16)
        packed = pack([tree], [context[-1]], [args.context])

        def decode(ids, runner=runner):
            runner.decode(ids, [context[-1]] * len(ids))
            for s in ids:
                runner.kv.handle(s).num_committed = len(context)  # constant context length

        def verify32(runner=runner, packed=packed):
            runner.verify([0], packed)
            runner.commit(0, [])

        fns[("decode 1 request", dtype)] = lambda decode=decode: decode([0])
        fns[("verify 32 tree tokens", dtype)] = verify32
        fns[("decode 16 requests", dtype)] = lambda decode=decode, ids=seq_ids: decode(ids)
    t = timed_interleaved(fns, args.repeats)
    weight_mb = {dtype: runner.num_weight_bytes / 1e6 for dtype, runner in runners.items()}
    print(
        f"\nrunner, {args.context} cached tokens; weight bytes read per step: float32 {weight_mb[torch.float32]:.0f} "
        f"MB, bfloat16 panels {weight_mb[torch.bfloat16]:.0f} MB\n"
    )
    print("| forward | float32 ms | bfloat16 ms | float32 / bfloat16 |\n|---|---|---|---|")
    for name in ("decode 1 request", "verify 32 tree tokens", "decode 16 requests"):
        f32, bf16 = t[(name, torch.float32)], t[(name, torch.bfloat16)]
        print(f"| {name} | {ms(f32)} | {ms(bf16)} | {f32[0] / bf16[0]:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint folder, .gguf or 'default'")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=128, help="cached tokens per request")
    parser.add_argument("--skip-runner", action="store_true", help="only the GEMM table")
    args = parser.parse_args(argv)

    from ddtree.kernels import cpu_ops

    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    if ops is None:
        print("the native kernels are not available here (no compiler, or DDTREE_CPU_KERNELS=0)", file=sys.stderr)
        return 1
    print(f"{args.threads} thread(s), best of {args.repeats} (median in brackets)")
    gemm_table(ops, args.repeats * 10)
    if not args.skip_runner:
        runner_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
