"""What separate prefill passes cost: the offline engine (`off`) kept at C requests in a closed loop (a finished
request is replaced at once, every answer `--max-tokens` long), with two arrival patterns, alternating:

- lockstep: the first C requests start together, so they finish together and their replacements are admitted
  together, one prefill pass for all of them;
- staggered: the first C requests get 4..max_tokens tokens, so requests finish one or two at a time from then on, and
  almost every round first runs a prefill pass of its own for the one or two admitted.

The rounds' work is the same (the same prompts, the same tokens decoded); the difference is the prefill passes. On a
CPU each pass reads every weight once, the cost of a decode step.

    python benchmarks/bench_arrivals.py [--concurrency 16] [--num-requests 96] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import load_messages  # noqa: E402

from ddtree.engine import Engine, EngineConfig  # noqa: E402
from ddtree.loaders import build_workers  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], args, staggered: bool) -> tuple[float, int]:
    """(output tokens/s, prefill passes) of one closed loop of `args.num_requests` requests."""
    prefills_before = engine.timings.num_prefill_calls
    sent = num_tokens = 0

    def send(max_tokens: int) -> None:
        nonlocal sent
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(prompts[sent % len(prompts)], params, request_id=f"{staggered}-{time.monotonic()}-{sent}")
        sent += 1

    c, n = args.concurrency, args.max_tokens
    t0 = time.perf_counter()
    for i in range(c):
        send(4 + i * (n - 4) // max(1, c - 1) if staggered else n)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.token_ids)
                if sent < args.num_requests:
                    send(n)
    return num_tokens / (time.perf_counter() - t0), engine.timings.num_prefill_calls - prefills_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: one per core)")
    args = parser.parse_args()
    for flag, value, least in (
        ("--concurrency", args.concurrency, 1),
        ("--num-requests", args.num_requests, args.concurrency),
        ("--max-tokens", args.max_tokens, 5),
        ("--passes", args.passes, 1),
    ):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, _, tokenizer = build_workers(need_drafter=False)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in load_messages(16)
    ]
    engine = Engine(EngineConfig(speculation="off", max_num_seqs=args.concurrency), target, None, tokenizer)
    run(engine, prompts, argparse.Namespace(**{**vars(args), "num_requests": args.concurrency}), staggered=False)
    rates: dict[bool, list[float]] = {False: [], True: []}
    prefills: dict[bool, int] = {}
    for p in range(args.passes):
        for staggered in (False, True) if p % 2 == 0 else (True, False):
            rate, prefills[staggered] = run(engine, prompts, args, staggered)
            rates[staggered].append(rate)
            print(f"  pass {p + 1}: {'staggered' if staggered else 'lockstep'} {rate:.1f} tok/s", flush=True)
    print(
        f"\noff, {args.concurrency} requests in flight, {args.num_requests} requests of {args.max_tokens} tokens, "
        f"T=0, {torch.get_num_threads()} torch thread(s); median over {args.passes} passes\n"
    )
    print("| arrivals | tokens/s | x lockstep | prefill passes |")
    print("|---|---|---|---|")
    base = statistics.median(rates[False])
    for staggered in (False, True):
        median = statistics.median(rates[staggered])
        name = "staggered" if staggered else "lockstep"
        print(
            f"| {name} | {median:.1f} ({min(rates[staggered]):.1f}-{max(rates[staggered]):.1f}) | "
            f"{median / base:.2f} | {prefills[staggered]} |"
        )


if __name__ == "__main__":
    main()
