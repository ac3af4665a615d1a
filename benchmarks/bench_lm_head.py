"""A verify's LM head over every packed row, or only over the rows its acceptance walk reaches.

Two engines with the same fixed budget share one target worker and one drafter; before each engine's round the
worker is set to run the LM head on all rows (`lm_head_on_demand_min_tokens` huge) or on the walked rows only
(`TargetWorker._accept_on_demand`: passes of each walking request's current node and its first-child chain).
A third engine decodes the same prompts with speculation off on the same worker: its target time per round is one
decode step, the unit of the runtime issue's goal (a verify of 32 packed tree tokens at most 2.5 decode steps).
Rounds alternate one by one on the same prompts, so machine noise hits all alike; the table gives the median of
the target's time per round (the verify forward plus the acceptance, LM head included), in ms and in decode steps,
and of the whole round. T=0: the two speculative engines' outputs must be identical (else the table says so).

    python -m benchmarks.bench_lm_head [--budgets 16 32 64] [--requests 1 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ddtree.engine import Engine, EngineConfig
from ddtree.loaders import build_workers
from ddtree.sampling_params import SamplingParams
from ddtree.training.prompts import load_eval_prompts

MODES = {"all rows": 10**9, "walked rows": 1}


def run(target, drafter, tokenizer, budget: int, num_requests: int, num_tokens: int) -> dict:
    engines = {
        name: Engine(
            EngineConfig(speculation="ddtree", budget=budget, max_num_seqs=num_requests), target, drafter, tokenizer
        )
        for name in MODES
    }
    engines["off"] = Engine(EngineConfig(speculation="off", max_num_seqs=num_requests), target, None, tokenizer)
    prompts = [p for triple in zip(*(load_eval_prompts(c) for c in ("code", "math", "chat"))) for p in triple]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    target_ms: dict[str, list[float]] = {name: [] for name in engines}
    round_ms: dict[str, list[float]] = {name: [] for name in engines}
    for i, prompt in enumerate(prompts[:num_requests]):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for name, engine in engines.items():  # (ids distinct across the engines: they share the worker)
            engine.add_request(list(ids), params, request_id=f"{name}-{i}")
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            target.lm_head_on_demand_min_tokens = MODES.get(name, 10**9)
            before = engine.timings.verify + engine.timings.accept
            prefill_before = engine.timings.prefill
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[name][out.request_id.removeprefix(name)] = out.token_ids
            seconds = time.perf_counter() - t0
            if engine.timings.prefill == prefill_before:  # rounds without a prefill only
                target_ms[name].append(1000 * (engine.timings.verify + engine.timings.accept - before))
                round_ms[name].append(1000 * seconds)
    return {
        "target": {n: statistics.median(v) for n, v in target_ms.items()},
        "round": {n: statistics.median(v) for n, v in round_ms.items()},
        "identical": outputs["all rows"] == outputs["walked rows"],
        "num_rounds": len(round_ms["all rows"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    target, drafter, tokenizer = build_workers(args.model, args.drafter)
    print(
        "| budget | requests | packed tokens | decode step ms (off) | target ms, all rows (steps) | target ms, "
        "walked rows (steps) | ratio | round ms, all rows | round ms, walked rows | ratio | outputs identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        for num_requests in args.requests:
            r = run(target, drafter, tokenizer, budget, num_requests, args.tokens)
            t, w = r["target"], r["round"]
            step = t["off"]
            print(
                f"| {budget} | {num_requests} | {num_requests * (budget + 1)} | {step:.1f} | "
                f"{t['all rows']:.1f} ({t['all rows'] / step:.2f}) | {t['walked rows']:.1f} "
                f"({t['walked rows'] / step:.2f}) | {t['walked rows'] / t['all rows']:.2f} | {w['all rows']:.1f} | "
                f"{w['walked rows']:.1f} | {w['walked rows'] / w['all rows']:.2f} | {r['identical']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
