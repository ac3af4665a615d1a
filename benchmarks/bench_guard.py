"""The closed loop over the budget policy (ddtree/guard.py) against the policy alone and `off`, offline.

    python benchmarks/bench_guard.py                         # 8 requests at once, 64 tokens, 3 passes
    python benchmarks/bench_guard.py --requests 4 --max-tokens 128 --passes 2

The same held-out prompts (code, math, chat in turn), all submitted at once, T=0, through three engines on the same
loaded workers: `off`, `auto` with the loop (the default `max_explore_share`) and `auto` with the policy alone
(`max_explore_share=0`); the engines alternate pass by pass, so the machine's drift hits them alike. Prints tokens/s
per pass, then what the loop measured per batch-size bucket (the policy's speedup over plain decoding, each arm's
rounds, the share of time explored).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ.setdefault("KMP_BLOCKTIME", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    args = p.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens), ("--passes", args.passes)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")

    from ddtree.engine import Engine, EngineConfig
    from ddtree.llm import LLM
    from ddtree.loaders import build_workers
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_prompts

    target, drafter, tokenizer = build_workers(None, None, device="cpu")
    per_category = -(-args.requests // 3)
    texts = [t for c in ("code", "math", "chat") for t in load_eval_prompts(c)[:per_category]][: args.requests]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    n = args.requests
    engines = {
        "off": Engine(EngineConfig(speculation="off", max_num_seqs=n), target, None, tokenizer),
        "auto": Engine(EngineConfig(max_num_seqs=n), target, drafter, tokenizer),
        "auto, policy alone": Engine(EngineConfig(max_num_seqs=n, max_explore_share=0.0), target, drafter, tokenizer),
    }
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.passes):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs = LLM.from_engine(engine).generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
            outputs[name] = [o.token_ids for o in outs]
    print(f"{n} requests at once, max_tokens={args.max_tokens}, T=0, {args.passes} passes\n")
    print("| engine | tokens/s per pass | last pass x off |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} | {values[-1] / rates['off'][-1]:.2f} |")
    same = all(o == outputs["off"] for o in outputs.values())
    print(f"\nT=0 outputs identical to `off`: {same}\n")
    print("| batch sizes | rounds | policy x plain | policy tokens/request (rounds) | plain rounds | time explored |")
    print("|---|---|---|---|---|---|")
    for row in engines["auto"].guard.describe():
        low, high = row["batch_sizes"]
        speedup = "-" if row["policy_speedup"] is None else f"{row['policy_speedup']:.2f}"
        print(
            f"| {low}-{high} | {row['num_rounds']} | {speedup} | {row['policy_tokens_per_request']:.2f} "
            f"({row['policy_rounds']}) | {row['plain_rounds']} | {100 * row['explored_share']:.1f}% |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
