"""Two request groups in flight vs one: what overlapping the draft of one group with the verify of the other gains
when the target and the drafter run on separate Ray actors (as an engine replica runs them).

    python benchmarks/bench_pipeline.py                                   # shipped drafter, concurrency 1 2 4 8
    python benchmarks/bench_pipeline.py --drafter random --concurrency 2 4 --budget 16

For each concurrency the same prompts are decoded at T=0 with a fixed budget (no fallback, so every mode does the
same work per request round) by three engines on the SAME two actors: `sequential` (pipeline=False: draft all, then
verify all), `pipelined` (pipeline=True: phases where the drafter actor drafts group A while the target actor
verifies group B) and `auto` (pipeline="auto": the engine chooses from its cost model each phase). The modes
alternate for `--passes` passes so that load from other jobs hits them alike. The table reports tokens/s of each,
the ratios to sequential, the speedup the cost model predicts for two groups (`BudgetPolicy.pipeline_speedup`, from
the sequential engine's live cost curves; auto pipelines above 1.08), the mean round / phase time, and the engine's
own split (seconds inside the drafter and inside the target per committed token): overlap can at best hide the
smaller of the two.

The two groups split the verify pass in two, so the target reads its weights twice as often: pipelining pays when
the drafter's time is comparable to the verify's and the verify is compute-bound (large packed batches), and loses
when the verify is bandwidth-bound (few tokens) and the drafter cheap. The outputs must be identical in both modes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

# The in-process engine's OpenMP threads wait, and its memory takes pages, as the worker actors' do (before torch).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deployments.config import use_worker_env  # noqa: E402

use_worker_env()

from benchmarks.bench_actors import Result, make_random_drafter, run_engine  # noqa: E402


def predicted_speedup(engine, concurrency: int, budget: int) -> float:
    """What the engine's cost model predicts for two groups of `concurrency` requests verifying `budget` nodes each."""
    from ddtree.budget import BudgetConfig, BudgetPolicy

    policy = BudgetPolicy(BudgetConfig(fixed_budget=budget), engine.budget.cost)
    ids = [f"r{i}" for i in range(concurrency)]
    for rid in ids:
        policy.add(rid)
        policy.states[rid].nodes = float(budget)
    return policy.pipeline_speedup(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--drafter",
        default=None,
        help="DFlash drafter (default: the shipped one); 'random': a random 1-layer drafter drafting "
        "over the full vocabulary (a drafter as costly as a verify pass)",
    )
    parser.add_argument("--budget", type=int, default=16, help="fixed nodes per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs: one per actor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each actor")
    parser.add_argument("--passes", type=int, default=2, help="measured passes per mode, alternating")
    args = parser.parse_args(argv)
    if args.drafter == "random":
        args.drafter = str(make_random_drafter(args.model, Path("work/bench_actors/random-drafter")))

    import ray
    import torch

    from ddtree.engine import Engine, EngineConfig
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_prompts
    from deployments.actors import start_worker_actors
    from deployments.config import AppArgs, WorkerSpec

    torch.set_num_threads(1)
    app_args = AppArgs(
        model=args.model,
        drafter=args.drafter,
        speculation="ddtree",
        budget=args.budget,
        max_budget=args.budget,
        max_num_seqs=max(args.concurrency),
        worker_torch_threads=args.threads,
    )
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    layout = app_args.worker_layout()
    actors = start_worker_actors(WorkerSpec.from_args(app_args), layout.target, layout.drafter)
    tokenizer = actors.target_proxy.tokenizer
    num_prompts = max(args.concurrency) * 2
    texts = [p for c in ("chat", "code", "math") for p in load_eval_prompts(c)][:num_prompts]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    rows, cost = [], None
    for concurrency in args.concurrency:
        engines = {}
        for name, pipeline in (("sequential", False), ("pipelined", True), ("auto", "auto")):
            config = EngineConfig(
                speculation="ddtree",
                budget=args.budget,
                max_budget=args.budget,
                max_num_seqs=concurrency,
                allow_fallback=False,
                pipeline=pipeline,
            )
            engine = Engine(
                config,
                actors.target_proxy,
                actors.drafter_proxy,
                tokenizer,
                cost=copy.deepcopy(cost) if cost is not None else None,
            )
            cost = cost or copy.deepcopy(engine.budget.cost)  # measured once, on the actors
            engines[name] = engine
            run_engine(engine, prompts[: 2 * concurrency], params, concurrency, "warm-up", actors.hops)
        totals = {name: Result(name) for name in engines}
        for _ in range(args.passes):
            for name, engine in engines.items():
                run = run_engine(engine, prompts[: 2 * concurrency], params, concurrency, name, actors.hops)
                total = totals[name]
                total.round_seconds += run.round_seconds
                total.num_tokens += run.num_tokens
                total.seconds += run.seconds
                total.outputs = run.outputs
                total.tau = run.tau
                for k, v in run.stage_seconds.items():
                    total.stage_seconds[k] = total.stage_seconds.get(k, 0.0) + v
        seq, pipe, auto = totals["sequential"], totals["pipelined"], totals["auto"]
        predicted = predicted_speedup(engines["sequential"], concurrency, args.budget)
        rows.append((concurrency, seq, pipe, auto, predicted, seq.outputs == pipe.outputs == auto.outputs))
    actors.kill()
    ray.shutdown()

    print(
        f"\nbudget={args.budget} (fixed), max_tokens={args.max_tokens}, 2 x concurrency prompts, "
        f"{args.passes} passes, drafter={args.drafter or 'shipped'}, actors: {args.threads} torch thread(s) each"
    )
    print(
        f"{'conc':>5}{'seq tok/s':>11}{'pipe tok/s':>12}{'auto tok/s':>12}{'pipe/seq':>10}{'auto/seq':>10}"
        f"{'predicted':>11}{'seq round ms':>14}{'pipe phase ms':>15}{'draft ms/tok':>14}{'verify ms/tok':>15}"
        f"{'identical':>11}"
    )
    for concurrency, seq, pipe, auto, predicted, same in rows:
        draft = 1000 * seq.stage_seconds["draft"] / seq.num_tokens
        verify = 1000 * (seq.stage_seconds["verify"] + seq.stage_seconds["accept"]) / seq.num_tokens
        rate = {r.name: r.num_tokens / r.seconds for r in (seq, pipe, auto)}
        print(
            f"{concurrency:>5}{rate['sequential']:>11.1f}{rate['pipelined']:>12.1f}{rate['auto']:>12.1f}"
            f"{rate['pipelined'] / rate['sequential']:>10.3f}{rate['auto'] / rate['sequential']:>10.3f}"
            f"{predicted:>11.2f}{1000 * statistics.fmean(seq.round_seconds):>14.1f}"
            f"{1000 * statistics.fmean(pipe.round_seconds):>15.1f}{draft:>14.2f}{verify:>15.2f}{str(same):>11}"
        )
    return 0 if all(same for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
