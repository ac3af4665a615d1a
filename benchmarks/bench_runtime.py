"""Target runtime on this CPU: decode step vs the memory-bandwidth bound, verify and batched-decode costs.

    python benchmarks/bench_runtime.py                      # SmolLM2-135M float32, 1 and 2 threads
    python benchmarks/bench_runtime.py --threads 1 --dtype bfloat16 --skip-hf
    python benchmarks/bench_runtime.py --threads 2 --kernel-weight-dtype bfloat16   # bf16 panels, float32 activations

Prints one table per thread count (bandwidth measured in the same run, model bytes / read bandwidth = bound; targets:
decode step <= bound / 0.7, verify of 32 packed tree tokens <= 2.5 decode steps, 16-request decode <= 3 steps)
and the verify cost curves the scheduler uses (one request by tokens; R one-token requests against one request of R
tokens: what each request adds beyond its tokens). The measurements run round-robin, --repeats rounds; times are the
minimum (median in brackets): other jobs on a shared machine only ever add time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ddtree.cost import verify_cost_counts
from ddtree.models.target import TargetModel, measure_batch_cost_curve, measure_verify_cost_curve
from ddtree.models.testing import random_draft_tree
from ddtree.packing import pack
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree
from ddtree.workers import TargetWorker

REPO = Path(__file__).resolve().parents[1]
CURVE_TOKENS = verify_cost_counts(256)  # the engine's start-up profile: powers of two, row tiles, one past each
CURVE_REQUESTS = [2, 4, 8, 16, 32]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def timed_interleaved(fns: dict, repeats: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """{name: (min, median) seconds}, running the functions round-robin so that each sees the same interference
    from other jobs; the minimum is the least disturbed run."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def bandwidth_probes(num_bytes: int = 512 * 2**20) -> dict:
    """A copy (read + write) and a pure read stream (a sum) over a buffer far larger than the caches; a decode
    step's weight traffic is a read stream."""
    src = torch.rand(num_bytes // 4)  # touched, so its pages are real memory
    dst = torch.empty_like(src)
    return {"copy": lambda: dst.copy_(src), "read": lambda: src.sum()}


def hf_decode_step(model_dir: Path, context: list[int]):
    """A function running one Hugging Face decode step at a constant context length."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([context]), past_key_values=cache, use_cache=True)
    token = torch.tensor([[context[-1]]])
    position = torch.tensor([[len(context)]])

    @torch.inference_mode()
    def step():
        model(token, position_ids=position, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to the context length (transformers 5: a negative count of tokens)

    return step


def constant_context_decode(runner: TargetModel, seq_ids: list[int], context: list[int]):
    """A function running one decode step of `seq_ids` (prefilled with `context`) at a constant context length."""

    def decode(ids=seq_ids):
        runner.decode(ids, [context[-1]] * len(ids))
        for s in ids:
            runner.kv.handle(s).num_committed = len(context)  # drop the appended token: constant context

    return decode


def run(runner: TargetModel, torch_kernels_runner: TargetModel | None, args, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    # As the engine verifies (TargetWorker.verify: pack, forward, the target's tokens from the LM head on the rows the
    # acceptance walk reaches, the walk, KV compaction) a DDTree of 31 nodes built best-first from 7 positions'
    # draft distributions (block size 8), against the engine's decode step (the same call without a tree).
    worker = TargetWorker(runner, keep_features=False)
    worker.allocate("engine", args.context + 64, SamplingParams(temperature=0.0))
    engine_seq = worker.seq_id("engine")
    worker.prefill(["engine"], [context])
    draft_logprobs = torch.log_softmax(3 * torch.randn(7, vocab, generator=gen), dim=-1)
    ddtree32 = build_tree(draft_logprobs, 31)

    def engine_round(tree):
        worker.verify(["engine"], [tree], [context[-1]])
        runner.kv.handle(engine_seq).num_committed = len(context)  # back to the context: constant length

    seq_ids = list(range(1, 17))  # seq 0: the engine's request (above)
    for s in seq_ids:
        runner.kv.allocate(s, args.context + 64)
    runner.prefill(seq_ids, [context] * 16)
    decode = constant_context_decode(runner, seq_ids, context)

    tree = random_draft_tree(31, 8, vocab, gen)
    packed32 = pack([tree], [context[-1]], [args.context])

    def verify32():
        runner.verify(seq_ids[:1], packed32)
        runner.commit(seq_ids[0], [])

    fns = dict(bandwidth_probes())
    fns.update(
        {
            "decode1": lambda: decode(seq_ids[:1]),
            "decode16": lambda: decode(seq_ids),
            "verify32": verify32,
            "engine_decode": lambda: engine_round(None),
            "engine_verify32": lambda: engine_round(ddtree32),
        }
    )
    if torch_kernels_runner is not None:
        torch_kernels_runner.kv.allocate(0, args.context + 64)
        torch_kernels_runner.prefill([0], [context])
        fns["decode1_torch"] = constant_context_decode(torch_kernels_runner, [0], context)
    if not args.skip_hf:
        fns["hf"] = hf_decode_step(runner.source_path, context)
    t = timed_interleaved(fns, args.repeats)
    for s in seq_ids:
        runner.free(s)
    worker.free("engine")
    if torch_kernels_runner is not None:
        torch_kernels_runner.free(0)
    curve = measure_verify_cost_curve(
        runner, CURVE_TOKENS, num_context_tokens=args.context, num_repeats=max(3, args.repeats // 3)
    )
    batch_curve = measure_batch_cost_curve(
        runner, CURVE_REQUESTS, num_context_tokens=args.context, num_repeats=max(3, args.repeats // 3)
    )

    model_bytes = runner.num_weight_bytes
    copy_bandwidth = 2 * 512 * 2**20 / t["copy"][0]
    bandwidth = 512 * 2**20 / t["read"][0]
    bound = model_bytes / bandwidth  # a decode step is one read stream over the weights
    d1, d16, v32 = t["decode1"], t["decode16"], t["verify32"]

    def ms(x):
        return f"{x[0] * 1e3:.1f} ({x[1] * 1e3:.1f})"

    def check(ok):
        return "yes" if ok else "NO"

    load = os.getloadavg()[0]
    print(
        f"\n## {num_threads} thread(s), dtype {str(runner.dtype).removeprefix('torch.')}, context {args.context} "
        f"tokens, load average {load:.2f}\n"
    )
    print("| measure | value | target | met |")
    print("|---|---|---|---|")
    print(f"| memory bandwidth, 512 MiB copy (read + write) | {copy_bandwidth / 1e9:.1f} GB/s | | |")
    print(f"| memory bandwidth, 512 MiB read stream | {bandwidth / 1e9:.1f} GB/s | | |")
    print(f"| weight bytes read per step | {model_bytes / 1e6:.0f} MB | | |")
    print(f"| bound per decode step: weight bytes / read bandwidth | {bound * 1e3:.1f} ms | | |")
    print(
        f"| (same with the copy figure) | {model_bytes / copy_bandwidth * 1e3:.1f} ms | | "
        f"({model_bytes / copy_bandwidth / d1[0]:.0%} of it) |"
    )
    print(
        f"| decode step, 1 request, ms | {ms(d1)} | <= {bound / 0.7 * 1e3:.1f} (70% of bound) "
        f"| {check(d1[0] <= bound / 0.7)} ({bound / d1[0]:.0%} of bound) |"
    )
    if "decode1_torch" in t:
        d1t = t["decode1_torch"]
        torch_bound = torch_kernels_runner.num_weight_bytes / bandwidth  # its own weights (float32 matrices)
        print(
            f"| decode step, 1 request, torch's kernels (cpu_kernels=False), ms | {ms(d1t)} | | "
            f"({torch_bound / d1t[0]:.0%} of its bound; {d1t[0] / d1[0]:.2f}x ours) |"
        )
    if "hf" in t:
        print(f"| Hugging Face forward, 1 token, ms | {ms(t['hf'])} | | ({t['hf'][0] / d1[0]:.2f}x ours) |")
    print(f"| verify 32 packed tree tokens, logits of all rows, ms | {ms(v32)} | | ({v32[0] / d1[0]:.2f}x) |")
    ed, ev = t["engine_decode"], t["engine_verify32"]
    print(f"| engine's decode step (TargetWorker.verify, no tree), ms | {ms(ed)} | | |")
    print(
        f"| engine's verify of 32 packed tree tokens (LM head on the rows the walk reaches), ms | {ms(ev)} | "
        f"<= 2.5 engine decode steps | {check(ev[0] <= 2.5 * ed[0])} ({ev[0] / ed[0]:.2f}x) |"
    )
    print(
        f"| decode 16 requests, ms | {ms(d16)} | <= 3 decode steps | "
        f"{check(d16[0] <= 3 * d1[0])} ({d16[0] / d1[0]:.2f}x) |"
    )
    print("\nverify cost curve (measure_verify_cost_curve, min of runs):\n")
    print("| packed tokens | ms | ms per token | x decode step |")
    print("|---|---|---|---|")
    for n, sec in curve:
        print(f"| {n} | {sec * 1e3:.1f} | {sec * 1e3 / n:.2f} | {sec / d1[0]:.2f} |")
    one_request = dict(curve)
    print("\nverify cost by requests (measure_batch_cost_curve: R requests of one token each, min of runs):\n")
    print("| requests R | ms | one request of R tokens, ms | ms per request beyond its token |")
    print("|---|---|---|---|")
    for r, sec in batch_curve:
        single = one_request.get(r)
        extra = "" if single is None else f"{(sec - single) * 1e3 / (r - 1):.2f}"
        print(f"| {r} | {sec * 1e3:.1f} | {'' if single is None else f'{single * 1e3:.1f}'} | {extra} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint folder, .gguf or 'default'")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=128, help="cached tokens per request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face comparison")
    parser.add_argument(
        "--skip-torch-kernels", action="store_true", help="skip the decode step on torch's kernels (cpu_kernels=False)"
    )
    parser.add_argument(
        "--kernel-weight-dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="the native ops' panels (float32 runner only): bfloat16 = bf16 weights and products",
    )
    parser.add_argument("--cache-dir", default=str(REPO / ".cache" / "ddtree"))
    args = parser.parse_args()
    runner = TargetModel.load(
        args.model,
        dtype=DTYPES[args.dtype],
        max_kv_bytes=2**30,
        cache_dir=args.cache_dir,
        kernel_weight_dtype=DTYPES[args.kernel_weight_dtype],
    )
    torch_kernels_runner = None
    if runner.uses_cpu_kernels and not args.skip_torch_kernels:  # the same model on torch's kernels, side by side
        torch_kernels_runner = TargetModel.load(
            args.model, dtype=DTYPES[args.dtype], max_kv_bytes=2**24, cache_dir=args.cache_dir, cpu_kernels=False
        )
    print(
        f"model {runner.source_path}, {runner.config.num_hidden_layers} layers, torch {torch.__version__}, "
        f"native one-token ops: {'yes' if runner.uses_cpu_kernels else 'no'}, their weights: "
        f"{str(runner.kernel_weight_dtype).removeprefix('torch.')}"
    )
    for n in args.threads:
        run(runner, torch_kernels_runner, args, n)


if __name__ == "__main__":
    main()
