"""What admissions cost a loaded engine: the offline engine kept at C requests in a closed loop (a finished request
is replaced at once, every answer `--max-tokens` long), with two arrival patterns and two ways of taking in the
admitted prompts, all alternating in one run:

- lockstep: the first C requests start together, so they finish together and their replacements are admitted
  together;
- staggered: the first C requests get 4..max_tokens tokens, so requests finish one or two at a time from then on, and
  almost every round admits one or two (as under steady load from many users);
- own pass (`max_folded_prompt_tokens=0`): the admitted prompts are prefilled in a target pass of their own before
  the round;
- in verify (the default): they join the round's verify pass.

Tokens/s count from the start to the last request's admission, while C requests are in flight: the drain after it
differs between the patterns (lockstep requests leave together, staggered ones one by one) and is not counted. On a CPU
each pass reads every weight once, the cost of a decode step. `--modes off,auto` adds the adaptive mode, whose
requests drift apart by themselves (they commit different numbers of tokens per round).

    python benchmarks/bench_arrivals.py [--modes off,auto] [--concurrency 16] [--num-requests 96] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddtree.engine import Engine, EngineConfig
from ddtree.loaders import build_workers
from ddtree.sampling_params import SamplingParams
from ddtree.training.prompts import load_eval_conversations


def run(engine: Engine, prompts: list[list[int]], args, staggered: bool) -> tuple[float, int, int]:
    """One closed loop of `args.num_requests` requests: (output tokens/s, prefill passes, prompts taken in by verify
    passes), all counted while the loop is full, from the start to the last request's admission (the drain after it
    differs between the arrival patterns: lockstep requests leave together, staggered ones one by one)."""
    timings = engine.timings
    prefills_before, in_verify_before = timings.num_prefill_calls, timings.num_prompts_in_verify
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
    while sent < args.num_requests or engine.num_waiting:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.finished and sent < args.num_requests:
                send(n)
    seconds = time.perf_counter() - t0
    counts = timings.num_prefill_calls - prefills_before, timings.num_prompts_in_verify - in_verify_before
    while engine.has_unfinished_requests():  # the drain, not counted
        engine.step()
    return num_tokens / seconds, *counts


SPECULATION = {"off": {"speculation": "off"}, "auto": {"speculation": "ddtree", "budget": "auto"}}
ADMISSIONS = {"own pass": 0, "in verify": EngineConfig.max_folded_prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="off", help="comma-separated: off, auto")
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
    modes = args.modes.split(",")
    if not modes or any(m not in SPECULATION for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes takes distinct names of {', '.join(SPECULATION)}, got {args.modes!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, drafter, tokenizer = build_workers(need_drafter="auto" in modes)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in load_eval_conversations(16)
    ]
    engines = {}
    for mode in modes:
        for admission, max_folded in ADMISSIONS.items():
            config = EngineConfig(
                **SPECULATION[mode], max_num_seqs=args.concurrency, max_folded_prompt_tokens=max_folded
            )
            engines[mode, admission] = Engine(config, target, drafter if mode != "off" else None, tokenizer)
    warm_up = argparse.Namespace(**{**vars(args), "num_requests": args.concurrency})
    for engine in engines.values():
        run(engine, prompts, warm_up, staggered=False)
    cases = [(key, staggered) for key in engines for staggered in (False, True)]
    rates: dict[tuple, list[float]] = {case: [] for case in cases}
    passes: dict[tuple, tuple[int, int]] = {}
    for p in range(args.passes):
        for key, staggered in cases if p % 2 == 0 else cases[::-1]:
            engine = engines[key]
            rate, *counts = run(engine, prompts, args, staggered)
            rates[key, staggered].append(rate)
            passes[key, staggered] = tuple(counts)
            arrivals = "staggered" if staggered else "lockstep"
            print(f"  pass {p + 1}: {key[0]}, {key[1]}, {arrivals}: {rate:.1f} tok/s", flush=True)
    print(
        f"\n{args.concurrency} requests in flight, {args.num_requests} requests of {args.max_tokens} tokens, "
        f"T=0, {torch.get_num_threads()} torch thread(s); median over {args.passes} passes, counted from the start "
        "to the last request's admission\n"
    )
    print("| mode | prompts | arrivals | tokens/s | x off, own pass, lockstep | prefill passes | prompts in verify |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(rates[(modes[0], "own pass"), False]) if modes[0] == "off" else None
    for (mode, admission), staggered in cases:
        r = rates[(mode, admission), staggered]
        median = statistics.median(r)
        ratio = f"{median / base:.2f}" if base else "-"
        num_prefills, num_in_verify = passes[(mode, admission), staggered]
        print(
            f"| {mode} | {admission} | {'staggered' if staggered else 'lockstep'} | {median:.1f} "
            f"({min(r):.1f}-{max(r):.1f}) | {ratio} | {num_prefills} | {num_in_verify} |"
        )


if __name__ == "__main__":
    main()
