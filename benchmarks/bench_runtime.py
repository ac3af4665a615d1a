"""Target runtime on this CPU: decode step vs the memory-bandwidth bound, verify and batched-decode costs.

    python benchmarks/bench_runtime.py                      # SmolLM2-135M float32, 1 and 2 threads
    python benchmarks/bench_runtime.py --threads 1 --dtype bfloat16 --skip-hf

Prints one table per thread count (bandwidth measured in the same run, model bytes / bandwidth = bound; targets:
decode step <= bound / 0.7, verify of 32 packed tree tokens <= 2.5 decode steps, 16-request decode <= 3 steps)
and the verify cost curve the scheduler uses. Times are the minimum over --repeats runs (median in brackets):
other jobs on a shared machine only ever add time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ddtree.models.target import TargetModel, measure_verify_cost_curve
from ddtree.models.testing import random_draft_tree
from ddtree.packing import pack

REPO = Path(__file__).resolve().parents[1]
CURVE_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def timed(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(min, median) seconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def memory_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes moved per second by a large copy (read + write), the figure a weight-streaming step is bound by."""
    src = torch.rand(num_bytes // 4)  # touched, so its pages are real memory
    dst = torch.empty_like(src)
    best, _ = timed(lambda: dst.copy_(src), repeats, warmup=1)
    return 2 * num_bytes / best


def hf_decode_step(model_dir: Path, context: list[int], repeats: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([context]), past_key_values=cache, use_cache=True)
        token = torch.tensor([[context[-1]]])
        position = torch.tensor([[len(context)]])

        def step():
            model(token, position_ids=position, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to the context length (transformers 5: a negative count of tokens)

        return timed(step, repeats)


def run(runner: TargetModel, args, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    bandwidth = memory_bandwidth()
    model_bytes = runner.num_weight_bytes
    bound = model_bytes / bandwidth

    seq_ids = list(range(16))
    for s in seq_ids:
        runner.kv.allocate(s, args.context + 2 * args.repeats + 300)
    runner.prefill(seq_ids, [context] * 16)

    def reset():
        for s in seq_ids:
            runner.kv.handle(s).num_committed = args.context  # drop what the last timing appended

    def decode1():
        runner.decode([0], [context[-1]])
        reset()

    def decode16():
        runner.decode(seq_ids, [context[-1]] * 16)
        reset()

    tree = random_draft_tree(31, 8, vocab, gen)
    packed32 = pack([tree], [context[-1]], [args.context])

    def verify32():
        runner.verify([0], packed32)
        runner.commit(0, [])

    d1 = timed(decode1, args.repeats)
    d16 = timed(decode16, args.repeats)
    v32 = timed(verify32, args.repeats)
    for s in seq_ids:
        runner.free(s)
    hf = None if args.skip_hf else hf_decode_step(runner.source_path, context, args.repeats)
    curve = measure_verify_cost_curve(runner, CURVE_TOKENS, num_context_tokens=args.context,
                                      num_repeats=max(3, args.repeats // 3))

    def ms(t):
        return f"{t[0] * 1e3:.1f} ({t[1] * 1e3:.1f})"

    def check(ok):
        return "yes" if ok else "NO"

    load = os.getloadavg()[0]
    print(f"\n## {num_threads} thread(s), dtype {str(runner.dtype).removeprefix('torch.')}, context {args.context} "
          f"tokens, load average {load:.2f}\n")
    print("| measure | value | target | met |")
    print("|---|---|---|---|")
    print(f"| memory bandwidth (512 MiB copy, read+write) | {bandwidth / 1e9:.1f} GB/s | | |")
    print(f"| weight bytes read per step | {model_bytes / 1e6:.0f} MB | | |")
    print(f"| bandwidth bound per decode step | {bound * 1e3:.1f} ms | | |")
    print(f"| decode step, 1 request, ms | {ms(d1)} | <= {bound / 0.7 * 1e3:.1f} (70% of bound) "
          f"| {check(d1[0] <= bound / 0.7)} ({bound / d1[0]:.0%} of bound) |")
    if hf is not None:
        print(f"| Hugging Face forward, 1 token, ms | {ms(hf)} | | ({hf[0] / d1[0]:.2f}x ours) |")
    print(f"| verify 32 packed tree tokens, ms | {ms(v32)} | <= 2.5 decode steps | "
          f"{check(v32[0] <= 2.5 * d1[0])} ({v32[0] / d1[0]:.2f}x) |")
    print(f"| decode 16 requests, ms | {ms(d16)} | <= 3 decode steps | "
          f"{check(d16[0] <= 3 * d1[0])} ({d16[0] / d1[0]:.2f}x) |")
    print("\nverify cost curve (measure_verify_cost_curve, min of runs):\n")
    print("| packed tokens | ms | ms per token | x decode step |")
    print("|---|---|---|---|")
    for n, s in curve:
        print(f"| {n} | {s * 1e3:.1f} | {s * 1e3 / n:.2f} | {s / d1[0]:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint folder, .gguf or 'default'")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=128, help="cached tokens per request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face comparison")
    parser.add_argument("--cache-dir", default=str(REPO / ".cache" / "ddtree"))
    args = parser.parse_args()
    runner = TargetModel.load(args.model, dtype=DTYPES[args.dtype], max_kv_bytes=2**30, cache_dir=args.cache_dir)
    print(f"model {runner.source_path}, {runner.config.num_hidden_layers} layers, torch {torch.__version__}")
    for n in args.threads:
        run(runner, args, n)


if __name__ == "__main__":
    main()
