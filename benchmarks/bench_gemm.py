"""Small-M float32 GEMMs with weights out of cache: what a verify pass of M packed tokens costs per layer matrix.

    python benchmarks/bench_gemm.py                  # M = 1 2 4 8 9 16 33, 40 distinct [576, 3072] matrices, 1 thread

A decode step (M = 1) streams the weights once; a verify of M tokens does M times the arithmetic on the same
weights. The ideal cost is about max(bandwidth time, compute time); the table shows what torch's CPU GEMM
(MKL here) delivers for the runner's plain layout (x @ W, W [K, N]), nn.Linear's layout (W [N, K]), MKL's packed
weights, oneDNN's packed weights (the runner's GEMM without the native ops, `pack_gemm_weights`) and the
project's native panel GEMM (`ddtree.kernels`: float32 panels, and split panels on AMX tiles where the CPU has
them, the runner's float32 GEMM there), with 40 distinct matrices (283 MB) so that nothing stays in cache. GB/s and
GFLOP/s are the runner's kernel's (split panels, else float32 panels, else x @ W).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 9, 16, 33], help="M: tokens per pass")
    parser.add_argument("--shape", type=int, nargs=2, default=[576, 3072], help="K N of each weight matrix")
    parser.add_argument("--num-matrices", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    k, n = args.shape
    weights = [torch.randn(k, n) for _ in range(args.num_matrices)]  # [K, N]: the runner's x @ W layout
    linear_weights = [w.t().contiguous() for w in weights]  # [N, K]: nn.Linear's layout

    def best_ms(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return 1000 * best

    megabytes = args.num_matrices * k * n * 4 / 1e6
    print(
        f"\n{args.num_matrices} x [{k}, {n}] float32 ({megabytes:.0f} MB), {args.threads} thread(s), best of "
        f"{args.repeats}"
    )
    from ddtree.kernels import cpu_ops, pack_panels, pack_split_panels, split_panels_pay

    ops = cpu_ops()
    panel_weights = [pack_panels(w) for w in weights] if ops is not None else []
    split_weights = [pack_split_panels(w) for w in weights] if split_panels_pay() else []
    no_add = torch.empty(0)
    print(
        f"{'M':>4}{'x @ W ms':>10}{'linear ms':>11}{'mkl packed ms':>15}{'onednn packed ms':>18}"
        f"{'native panels ms':>18}{'split panels ms':>17}{'x M=1':>8}{'GB/s':>7}{'GFLOP/s':>9}"
    )
    onednn_weights = [torch.ops.mkldnn._reorder_linear_weight(w) for w in linear_weights]
    base = None
    for m in args.rows:
        x = torch.randn(m, k)
        runner = best_ms(lambda: [x @ w for w in weights])
        linear = best_ms(lambda: [torch.nn.functional.linear(x, w) for w in linear_weights])
        if hasattr(torch.ops.mkl, "_mkl_linear"):
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in linear_weights]
            mkl = best_ms(lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(packed, linear_weights)])
        else:
            mkl = float("nan")
        onednn = best_ms(
            lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn_weights]
        )
        native = (
            best_ms(lambda: [ops.panel_linear(x, p, n, no_add, no_add) for p in panel_weights])
            if ops is not None
            else float("nan")
        )
        split = (
            best_ms(lambda: [ops.panel_linear(x, p, n, no_add, no_add) for p in split_weights])
            if split_weights
            else float("nan")
        )
        ours = split if split_weights else native if ops is not None else runner
        base = base or ours
        gflop = 2 * m * k * n * args.num_matrices / 1e9
        print(
            f"{m:>4}{runner:>10.1f}{linear:>11.1f}{mkl:>15.1f}{onednn:>18.1f}{native:>18.1f}{split:>17.1f}"
            f"{ours / base:>8.2f}{megabytes / ours:>7.1f}{gflop / (ours / 1000):>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
