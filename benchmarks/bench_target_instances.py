"""Loads of the same target against one another: how much a benchmark's ratio can owe to which load a mode ran on.

    python benchmarks/bench_target_instances.py                 # 8 requests at a time, T=1.0, 4 passes
    python benchmarks/bench_target_instances.py --concurrency 1 --temperature 0

Three targets are loaded in one process: one that computes and keeps every token's features for a drafter (as the
speculative modes' target does) and two without (as `speculation="off"` loads it). An `off` engine on each decodes
the same held-out prompts in groups of `--concurrency`, the three in turn, the order reversed every other pass, and
the table gives tokens/s and the verify pass's milliseconds per round, each over the first plain target's. Where two
loads without features differ by more than the features' load differs from either, the features' own cost is below
what placing the weights in memory moves, and modes compared on different loads carry that difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=11, help="per category (code, math, chat)")
    p.add_argument("--passes", type=int, default=4)
    args = p.parse_args(argv)
    if min(args.concurrency, args.max_tokens, args.num_prompts, args.passes) < 1 or args.temperature < 0:
        p.error("--concurrency, --max-tokens, --num-prompts and --passes must be >= 1, --temperature >= 0")
    if args.concurrency > 3 * args.num_prompts:
        p.error(f"--concurrency {args.concurrency} needs at least that many prompts (3 x --num-prompts)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from ddtree.engine import Engine, EngineConfig
    from ddtree.loaders import build_workers
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_conversations

    with_features, _, tokenizer = build_workers(None, None, device="cpu", dtype=None, need_drafter=True)
    targets = {"features": with_features}
    for name in ("plain A", "plain B"):
        targets[name] = build_workers(None, None, device="cpu", dtype=None, need_drafter=False)[0]
    messages = load_eval_conversations(args.num_prompts)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in messages
    ]
    engines = {
        name: Engine(EngineConfig(speculation="off", max_num_seqs=args.concurrency), target, None, tokenizer)
        for name, target in targets.items()
    }
    totals = {name: {"tokens": 0, "seconds": 0.0, "verify": 0.0, "rounds": 0} for name in engines}
    c = args.concurrency
    for p in range(args.passes):
        for name in list(engines) if p % 2 == 0 else list(engines)[::-1]:
            engine, total = engines[name], totals[name]
            verify, rounds = engine.timings.verify, engine.timings.num_rounds
            for start in range(0, len(prompts) - c + 1, c):
                for i, prompt in enumerate(prompts[start : start + c]):
                    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
                    engine.add_request(prompt, params)
                t0 = time.perf_counter()
                while engine.has_unfinished_requests():
                    total["tokens"] += sum(len(o.token_ids) for o in engine.step() if o.finished)
                total["seconds"] += time.perf_counter() - t0
            total["verify"] += engine.timings.verify - verify
            total["rounds"] += engine.timings.num_rounds - rounds
        print(f"  done: pass {p + 1} of {args.passes}", flush=True)
    base = totals["plain A"]
    base_rate, base_verify = base["tokens"] / base["seconds"], base["verify"] / base["rounds"]
    print(f"\n{c} requests at a time, T={args.temperature}, {args.max_tokens} new tokens, {args.passes} passes\n")
    print("| target | tok/s | x plain A | verify ms/round | x plain A |")
    print("|---|---|---|---|---|")
    for name, t in totals.items():
        rate, verify = t["tokens"] / t["seconds"], t["verify"] / t["rounds"]
        print(f"| {name} | {rate:.1f} | {rate / base_rate:.3f} | {1e3 * verify:.2f} | {verify / base_verify:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
