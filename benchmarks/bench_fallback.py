"""Fallback costs what plain autoregressive decoding costs.

Two engines share the same loaded target: `off`, and `ddtree auto` with a cost model under which drafting never
pays, so every request is in fallback (apart from rare probes, whose rounds are counted apart). Their rounds are
interleaved one by one on the same requests, so machine noise hits both alike; the table compares the median time
of a round in which every request decoded autoregressively.

    python -m benchmarks.bench_fallback [--drafter random] [--requests 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ddtree.cost import CostModel
from ddtree.engine import Engine, EngineConfig
from ddtree.loaders import build_workers
from ddtree.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None, help="default: the shipped drafter; 'random': a random one")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.drafter == "random":
        from benchmarks.bench_actors import make_random_drafter

        args.drafter = str(make_random_drafter(args.model, Path("work/bench_fallback/random-drafter")))
    target, drafter, tokenizer = build_workers(args.model, args.drafter)
    # Drafting looks ruinous: the planner sends every request to fallback after its first probe.
    never_pays = CostModel([(1, 0.03), (2, 1.0), (4096, 100.0)], [(1, 10.0), (64, 10.0)])
    off = Engine(EngineConfig(speculation="off", max_num_seqs=args.requests), target, None, tokenizer, cost=never_pays)
    fallback = Engine(
        EngineConfig(speculation="ddtree", budget="auto", max_num_seqs=args.requests),
        target,
        drafter,
        tokenizer,
        cost=never_pays,
    )
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the history of Rome."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    times = {"off": [], "fallback": []}
    num_probe_rounds = 0
    for rep in range(args.repeats):
        for name, engine in (("off", off), ("fallback", fallback)):
            for i in range(args.requests):
                engine.add_request(list(prompt), params, request_id=f"{name}-{rep}-{i}")
        while off.has_unfinished_requests() or fallback.has_unfinished_requests():
            for name, engine in (("off", off), ("fallback", fallback)):
                if not engine.has_unfinished_requests():
                    continue
                spec_before = engine.timings.num_speculative_request_rounds
                prefills_before = engine.timings.prefill
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                if engine.timings.prefill != prefills_before:
                    continue  # prefill rounds are not decode rounds
                if engine.timings.num_speculative_request_rounds != spec_before:
                    num_probe_rounds += 1
                    continue
                times[name].append(seconds)
    med_off, med_fb = statistics.median(times["off"]), statistics.median(times["fallback"])
    print(f"{args.requests} requests x {args.tokens} tokens x {args.repeats} repeats, rounds interleaved")
    print("| engine | decode rounds | median round ms | mean round ms | ratio to off (median) |")
    print("|---|---|---|---|---|")
    for name, med in (("off", med_off), ("ddtree auto, all in fallback", med_fb)):
        key = "off" if name == "off" else "fallback"
        print(
            f"| {name} | {len(times[key])} | {1000 * med:.2f} | {1000 * statistics.mean(times[key]):.2f} | "
            f"{med / med_off:.3f} |"
        )
    print(f"probe rounds (excluded): {num_probe_rounds}")


if __name__ == "__main__":
    main()
