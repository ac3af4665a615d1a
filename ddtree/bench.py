"""`ddtree bench`: speed and acceptance of off / dflash / ddtree (fixed B and auto) / Hugging Face generate().

Every mode runs the same prompts in the same process on the same loaded weights, one request at a time (or
`--concurrency` at once), so the table compares like with like; ratios are against `off` and against HF generate.
The modes alternate group by group (the first `--concurrency` prompts on every mode, then the next ones, ...), and
with `--passes N` the whole run repeats N times, every other pass in the reverse order of modes, so that a slow spell
of a shared machine, or a drift within a pass, hits every mode alike; tokens/s is the median over passes, with the
range beside it, and a mode's ratio to `off` the median of its passes' ratios (each pass's modes ran side by side).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from ddtree.bench_report import ModeResult, print_concurrency_table, print_table, save, save_concurrency
from ddtree.engine import Engine, EngineConfig
from ddtree.llm import LLM
from ddtree.outputs import RequestOutput
from ddtree.sampling_params import SamplingParams

MODES = ("hf", "off", "dflash", "ddtree", "auto", "auto-no-ngram", "auto-no-loop", "auto-open")
# auto-open's rows: each group stepped as a server's loop steps the engine, without `LLM.generate`'s promise that
# nothing more arrives before the group ends (so without auto mode's closed-batch rule, ddtree.budget)
OPEN_BATCH = "ddtree auto, open batch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="DFlash drafter (default: the shipped one)")
    parser.add_argument(
        "--compare-drafter",
        default=None,
        help="a second drafter for the same target: every speculative mode also runs with it, in "
        "turn with the first (rows '<mode> [<its folder name>]'), on the same loaded target",
    )
    parser.add_argument(
        "--prompts", default=None, help="a .jsonl file of {prompt} or {messages} (default: built-in sets)"
    )
    parser.add_argument("--categories", default="code,math,chat", help="built-in sets to use")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=4,
        help="prompts per category (with --prompts: the first N of the file, 0 for all)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (> 0: every request is seeded with --seed, so each mode must "
        "produce the same tokens as `off`)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the requests' seed where --temperature > 0")
    parser.add_argument("--budgets", default="8,16,32,64,128", help="fixed DDTree budgets to run")
    parser.add_argument(
        "--modes",
        default="hf,off,dflash,ddtree,auto",
        help="which modes to run (also: auto-no-ngram, auto without n-gram proposals; auto-no-loop, the budget "
        "policy alone, without the closed loop; auto-open, auto stepped as a server steps it, without the "
        "closed-batch rule)",
    )
    parser.add_argument(
        "--concurrency",
        default="1",
        help="requests in flight at once; several, comma-separated (1,2,4,8,16,32), run in turn on the "
        "same engines and print one table with a row per concurrency and mode",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's, one per core); on a machine shared with another "
        "busy job use fewer threads than cores, or every op waits for the descheduled one",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run every mode this many times, in turn; tokens/s is the median over passes",
    )
    parser.add_argument("--out", default="work/bench", help="folder for results.json and the plot")


def load_prompts(args) -> list[tuple[str, list[dict]]]:
    """(category, messages) pairs; a malformed --prompts line is refused with its file and line number."""
    if args.prompts:
        items = []
        path = Path(args.prompts)
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                items.append(_prompt_line(line, f"{path}:{number}"))
        items = items[: args.num_prompts] if args.num_prompts else items
        if not items:
            raise ValueError(f"--prompts {path}: no prompts in the file")
        return items
    from ddtree.training.prompts import load_eval_prompts

    items = []
    for category in args.categories.split(","):
        prompts = load_eval_prompts(category)[: args.num_prompts]
        items.extend((category, [{"role": "user", "content": p}]) for p in prompts)
    if not items:
        raise ValueError("no prompts: --num-prompts must be at least 1 for the built-in sets")
    return items


def check_prompts_fill(concurrencies: list[int], num_prompts: int) -> None:
    """Each concurrency's first group must hold that many requests, or its row would measure a smaller batch under
    its name."""
    if max(concurrencies) > num_prompts:
        raise ValueError(
            f"--concurrency {max(concurrencies)} needs at least that many prompts, and the run has {num_prompts} "
            "(--num-prompts N takes N from each category, or from the --prompts file)"
        )


def _prompt_line(line: str, where: str) -> tuple[str, list[dict]]:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object with 'prompt' or 'messages', got {type(d).__name__}")
    messages = d.get("messages") or None  # (an empty list: the prompt then)
    if messages is None:
        if not isinstance(d.get("prompt"), str) or not d["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string (or give 'messages')")
        messages = [{"role": "user", "content": d["prompt"]}]
    elif not (
        isinstance(messages, list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    return str(d.get("category", "file")), messages


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, name: str) -> ModeResult:
    """One group of prompts submitted together (they decode as one batch, which shrinks as they finish): through
    `LLM.generate`, a closed batch, or stepped as a server steps the engine for the open-batch mode."""
    result = ModeResult(name)
    engine.timings.__init__()
    t0 = time.perf_counter()
    is_open = name.startswith(OPEN_BATCH)
    outputs = step_open(engine, prompts, params) if is_open else LLM.from_engine(engine).generate(prompts, params)
    for out in outputs:
        result.num_tokens += len(out.token_ids)
        result.acceptance_lengths.extend(out.acceptance_lengths)
        result.budgets.extend(out.stats.budgets)
        result.num_ngram_tokens += out.stats.num_ngram_tokens
        result.outputs.append(out.token_ids)
    result.seconds = time.perf_counter() - t0
    result.timings = engine.timings.as_dict()
    return result


def step_open(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """The prompts' final outputs, in order, the engine stepped with no promise about what arrives next."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    return [finals[rid] for rid in ids]


def run_pass(
    engines: list[tuple[str, Engine]],
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    record,
    reverse: bool = False,
) -> None:
    """One pass of every engine over the prompts, in groups of `concurrency`: each group runs on every engine in
    turn before the next group, so a slow spell of the machine (seconds, not minutes) hits all modes alike; with
    `reverse`, the engines take their turns last to first (`run` reverses every other pass: a machine that speeds up
    or slows down within a group's turns favours neither the first mode nor the last). `record(result)` gets each
    engine's pass once its last group has run, in `engines`' order."""
    results = [ModeResult(name) for name, _ in engines]
    turns = list(zip(results, engines))
    if reverse:
        turns.reverse()
    starts = range(0, len(prompts), concurrency)
    for start in starts:
        for result, (name, engine) in turns:
            result.extend(run_engine(engine, prompts[start : start + concurrency], params, name))
    for result in results:
        record(result)


def run_hf(model_dir: str, prompts: list[list[int]], max_tokens: int, eos_token_id: int) -> ModeResult:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = ModeResult("hf generate")
    t0 = time.perf_counter()
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos_token_id
            )
        result.num_tokens += out.shape[1] - len(ids)
        result.outputs.append(out[0, len(ids) :].tolist())
    result.seconds = time.perf_counter() - t0
    return result


SPECULATIVE_MODES = ("dflash", "ddtree", "auto", "auto-no-ngram", "auto-no-loop", "auto-open")


def parse_concurrencies(value) -> list[int]:
    """--concurrency: one count or several, comma-separated, distinct and in the order given."""
    if isinstance(value, int):
        return [value]
    try:
        counts = [int(c) for c in str(value).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be integers separated by commas, got {value!r}") from None
    if not counts:
        raise ValueError("--concurrency must name at least one count")
    return list(dict.fromkeys(counts))


def check_arguments(args) -> tuple[list[str], list[int]]:
    """The modes and the fixed budgets (distinct, in increasing order); every bad value is refused here, before a
    model loads, naming its flag."""
    concurrencies = parse_concurrencies(args.concurrency)
    for flag, value, least in (
        ("--passes", args.passes, 1),
        ("--max-tokens", args.max_tokens, 1),
        ("--concurrency", min(concurrencies), 1),
        ("--num-prompts", args.num_prompts, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if not 0 <= args.temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    try:
        budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--budgets must be integers separated by commas, got {args.budgets!r}") from None
    if "ddtree" in modes and (not budgets or budgets[0] < 1):
        raise ValueError(f"--budgets must be positive integers (mode ddtree), got {args.budgets!r}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; it must be a folder (results.json and the plot go there)")
    return modes, budgets


def sampling_params(args) -> SamplingParams:
    """T=0 (greedy), or seeded sampling: a request's samples are keyed by its seed and position, so every mode
    that decodes losslessly gives the same tokens."""
    if args.temperature <= 0:
        return SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)


def outputs_label(params: SamplingParams) -> str:
    return "T=0" if params.is_greedy else f"T={params.temperature:g} seeded"


def run(args) -> int:
    import torch

    from ddtree.loaders import build_workers, load_drafter_worker, resolve_drafter_path

    modes, budgets = check_arguments(args)
    messages = load_prompts(args)
    check_prompts_fill(parse_concurrencies(args.concurrency), len(messages))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, drafter, tokenizer = build_workers(
        args.model,
        args.drafter,
        device=args.device,
        dtype=args.dtype,
        need_drafter=any(m in SPECULATIVE_MODES for m in modes),
    )
    # Every mode, `off` included, runs on this one load of the target: two loads of the same weights differ in speed
    # by up to a few percent (where their memory lands; benchmarks/bench_target_instances.py), more than computing
    # and keeping the drafter's features costs `off`, so modes on different loads would compare placements.
    drafters = [("", drafter)]
    if args.compare_drafter:
        path = resolve_drafter_path(args.model, args.compare_drafter)
        # (a drafter reading other target layers than the first is refused here: the target computes one set)
        other = load_drafter_worker(path, target.model.head(), device=args.device, dtype=args.dtype)
        drafters.append((f" [{path.name}]", other))
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for _, m in messages
    ]
    params = sampling_params(args)
    concurrencies = parse_concurrencies(args.concurrency)
    max_concurrency = max(concurrencies)
    base = Engine(EngineConfig(speculation="off", max_num_seqs=max_concurrency), target, None, tokenizer)
    cost = base.budget.cost
    model = target.model
    is_mixed = model.uses_cpu_kernels and model.kernel_weight_dtype != model.dtype
    weights = f", {model.kernel_weight_dtype} weights" if is_mixed else ""
    print(
        f"{len(prompts)} prompts, max_tokens={args.max_tokens}, {outputs_label(params)}, "
        f"concurrency={','.join(map(str, concurrencies))}, "
        f"{torch.get_num_threads()} torch thread(s), {model.dtype}{weights}".replace("torch.", ""),
        flush=True,
    )
    if "hf" in modes and not params.is_greedy:
        print("  (hf generate runs greedy only: skipped at T > 0)", flush=True)

    configs: list[tuple[str, EngineConfig]] = []
    if "off" in modes:
        configs.append(("off", EngineConfig(speculation="off")))
    if "dflash" in modes:
        configs.append(("dflash", EngineConfig(speculation="dflash")))
    if "ddtree" in modes:
        configs += [(f"ddtree B={b}", EngineConfig(speculation="ddtree", budget=b)) for b in budgets]
    if "auto" in modes:
        configs.append(("ddtree auto", EngineConfig(speculation="ddtree", budget="auto")))
    if "auto-no-ngram" in modes:
        configs.append(("ddtree auto, no n-gram", EngineConfig(speculation="ddtree", budget="auto", ngram_tokens=0)))
    if "auto-no-loop" in modes:
        configs.append(("ddtree auto, no loop", EngineConfig(speculation="ddtree", budget="auto", max_explore_share=0)))
    if "auto-open" in modes:
        configs.append((OPEN_BATCH, EngineConfig(speculation="ddtree", budget="auto")))
    engines = []
    for name, config in configs:
        config.max_num_seqs = max_concurrency
        for suffix, worker in drafters if config.speculation != "off" else [("", None)]:
            engines.append(
                (
                    name + suffix,
                    Engine(
                        copy.deepcopy(config),
                        target,
                        worker,
                        tokenizer,
                        cost=copy.deepcopy(cost) if worker is None else None,
                    ),
                )
            )
    by_key: dict[tuple[int, str], ModeResult] = {}

    def record(concurrency: int, run: ModeResult) -> None:
        by_key.setdefault((concurrency, run.name), ModeResult(run.name)).absorb(run)

    def report() -> None:
        if len(concurrencies) == 1:
            results = list(by_key.values())
            print_table(results, outputs_label(params))
            save(results, args)
        else:
            print_concurrency_table(by_key, outputs_label(params))
            save_concurrency(by_key, args)

    p = 0
    try:
        for c in concurrencies:
            for p in range(args.passes):
                if "hf" in modes and c == 1 and params.is_greedy:
                    record(c, run_hf(target.model_dir, prompts, args.max_tokens, tokenizer.eos_token_id))
                run_pass(engines, prompts, params, c, lambda result: record(c, result), reverse=p % 2 == 1)
                print(f"  done: concurrency {c}, pass {p + 1} of {args.passes}", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the passes finished so far are reported and saved, then the command stops
        if by_key:
            print(
                f"\ninterrupted in pass {p + 1} of {args.passes}: the table and results.json hold the passes "
                f"finished so far",
                flush=True,
            )
            report()
        raise
    report()
    return 0
