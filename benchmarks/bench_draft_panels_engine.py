"""The shipped drafter on float32 vs bfloat16 panels inside the engine: acceptance, speed and outputs.

    python benchmarks/bench_draft_panels_engine.py                       # B=4, 4 prompts per category, 64 tokens
    python benchmarks/bench_draft_panels_engine.py --budget 16 --passes 3

One target, two drafter workers over it (`DFlashDrafter(kernel_weight_dtype=...)` float32 and bfloat16 panels; the
default is bfloat16 where the CPU has bf16 dot products); every pass runs the evaluation prompts (code, math, chat)
one request at a time, T=0, with each drafter in turn. Prints tokens/s per pass, the mean acceptance length (tau)
and whether the two drafters' outputs are identical (they must be: the target's verify decides every token; only tau
and speed may move).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=4, help="per category")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from ddtree.drafter import DFlashDrafter
    from ddtree.engine import Engine, EngineConfig
    from ddtree.loaders import build_workers, resolve_drafter_path
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_prompts
    from ddtree.workers import DrafterWorker

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = build_workers(None, None)
    if not drafter.drafter.uses_cpu_kernels:
        print("the native kernels are not available here: both drafters would run on torch", file=sys.stderr)
        return 1
    head, path = target.model.head(), resolve_drafter_path(None, None)
    f32_drafter = DrafterWorker(DFlashDrafter.load(path, head, kernel_weight_dtype=torch.float32))
    bf16_drafter = DrafterWorker(DFlashDrafter.load(path, head, kernel_weight_dtype=torch.bfloat16))
    drafters = {"float32 panels": f32_drafter, "bfloat16 panels": bf16_drafter}
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for category in ("code", "math", "chat")
        for p in load_eval_prompts(category)[: args.num_prompts]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(drafter) -> tuple[float, float, list[list[int]]]:
        engine = Engine(
            EngineConfig(speculation="ddtree", budget=args.budget, max_num_seqs=1), target, drafter, tokenizer
        )
        outputs, acceptance, start = [], [], time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(list(ids), params, request_id=str(i))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs.append(out.token_ids)
                        acceptance += out.acceptance_lengths
        seconds = time.perf_counter() - start
        return sum(map(len, outputs)) / seconds, sum(acceptance) / len(acceptance), outputs

    results = {name: [] for name in drafters}
    for _ in range(args.passes):  # in turn, so that other jobs disturb both alike
        for name, drafter in drafters.items():
            results[name].append(run(drafter))
    print(f"\n{len(prompts)} prompts, B={args.budget}, {args.max_tokens} tokens, {args.threads} thread(s)\n")
    print("| drafter | tokens/s per pass | tau |\n|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {' / '.join(f'{r[0]:.1f}' for r in runs)} | {runs[0][1]:.3f} |")
    same = all(a[2] == b[2] for a, b in zip(*results.values()))
    print(f"\noutputs identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
