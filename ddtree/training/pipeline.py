"""The `ddtree train-drafter` steps: prompts -> generate -> eval-data -> train -> eval, each resumable.

  prompts    make the training prompts (disjoint from the evaluation sets) and the data manifest; with --add, add
             more (another --seed, --categories, --math-templates) to an existing data directory
  generate   the target's greedy responses + hidden states, appended to <data-dir> (resumes where it stopped)
  eval-data  the same for the held-out evaluation prompts, under <eval-dir>/<category>/ (resumes too)
  train      train the drafter from <out-dir>/checkpoint.pt if present; exports <out-dir>/drafter/
  vocab      the drafter's draft vocabulary: the most frequent response tokens of <data-dir> (draft_vocab.json)
  eval       offline tau (chain and DDTree budgets) of <out-dir>/drafter on <eval-dir>, table + tau.json
  ship       copy <out-dir>/drafter to <ship-dir> with MANIFEST.json (commands, data manifest, training, tau)

`--device cuda` runs generate, eval-data, train and eval on a GPU with the same commands (docs/drafter.md,
"Training on GPUs"); the device is checked before the first step runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ddtree.training.prompts import CATEGORIES

STEPS = ("prompts", "generate", "eval-data", "train", "vocab", "eval", "ship")
DEFAULT_SHIP_DIR = Path(__file__).resolve().parent.parent / "assets" / "drafter" / "smollm2-135m-dflash"
DEFAULT_NUM_EVAL_PROMPTS = 40


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _finite_float(strictly_positive: bool):
    """A parser of finite floats > 0 (`strictly_positive`) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        bound = "> 0" if strictly_positive else ">= 0"
        if not (value > 0 if strictly_positive else value >= 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


_positive_float, _non_negative_float = _finite_float(True), _finite_float(False)
positive_int, non_negative_int = _at_least(1), _at_least(0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("steps", nargs="+", choices=STEPS, help="which steps to run, in order")
    parser.add_argument(
        "--target",
        default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct', a .gguf file or a Hugging Face model directory",
    )
    parser.add_argument("--data-dir", type=Path, default=Path("work/drafter_data"))
    parser.add_argument(
        "--extra-data-dirs",
        type=Path,
        nargs="+",
        default=[],
        help="train, vocab and ship: data directories read along with --data-dir (each made by the prompts and "
        "generate steps for the same target), so data sets made apart train together",
    )
    parser.add_argument("--eval-dir", type=Path, default=Path("work/drafter_eval"))
    parser.add_argument("--out-dir", type=Path, default=Path("work/drafter_train"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=positive_int, default=1, help="torch threads (leave cores for others)")
    parser.add_argument(
        "--device", default="cpu", help="where generate, eval-data, train and eval run: cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="generate/eval-data/eval: the target's (and drafter's) weights; train: the autocast "
        "compute dtype and the frozen embedding/LM head (parameters and optimiser stay "
        "float32). Default: float32 on cpu, bfloat16 on cuda",
    )
    # prompts
    parser.add_argument("--num-prompts-per-category", type=positive_int, default=4000)
    parser.add_argument(
        "--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES, help="prompt categories to make"
    )
    parser.add_argument(
        "--math-templates",
        default="both",
        choices=("basic", "broad", "both"),
        help="math word-problem template sets (basic: the first drafters' data)",
    )
    parser.add_argument(
        "--self-written",
        nargs="+",
        default=[],
        choices=("chat", "code", "math"),
        help="categories whose prompts the target writes itself instead of the templates (sampled "
        "from its chat template up to the user's text; runs the target on --device)",
    )
    parser.add_argument(
        "--add",
        action="store_true",
        help="add prompts (made with --seed) to an existing data directory: texts already there are "
        "skipped, the new ones are interleaved with the pending ones",
    )
    # generate / eval-data
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--max-prompts", type=positive_int, default=None, help="stop after this many new responses")
    parser.add_argument(
        "--max-seconds", type=_positive_float, default=None, help="stop generating/training after this long"
    )
    parser.add_argument(
        "--num-eval-prompts",
        type=positive_int,
        default=None,
        help=f"per category (default {DEFAULT_NUM_EVAL_PROMPTS}; an existing --eval-dir keeps its own)",
    )
    parser.add_argument(
        "--stored-layer-ids",
        type=non_negative_int,
        nargs="+",
        default=None,
        help="target layers whose hidden states are cached (default: 1 4 8 14 20 24 27 28, for "
        "SmolLM2's 30 layers); --target-layer-ids must be among them",
    )
    parser.add_argument(
        "--engine",
        choices=("runner", "hf"),
        default="runner",
        help="runner: the project's target runner with continuous batching; hf: transformers generate",
    )
    parser.add_argument(
        "--soft-target-top-k",
        type=non_negative_int,
        default=None,
        help="generate: store the target's top-k log-probabilities at each response token, for train's "
        "--soft-target-weight (default 32 for new data; 0: none; fixed once a data directory holds responses)",
    )
    # train
    parser.add_argument("--num-draft-layers", type=positive_int, default=2)
    parser.add_argument("--block-size", type=_at_least(2), default=8)
    parser.add_argument("--target-layer-ids", type=non_negative_int, nargs="+", default=[1, 14, 27])
    parser.add_argument("--mask-token-id", type=non_negative_int, default=16)
    parser.add_argument("--max-anchors", type=positive_int, default=32)
    parser.add_argument("--train-batch-size", type=positive_int, default=4, help="sequences per optimiser step")
    parser.add_argument("--lr", type=_positive_float, default=6e-4)
    parser.add_argument("--max-steps", type=positive_int, default=4000)
    parser.add_argument(
        "--max-hours",
        type=_positive_float,
        default=None,
        help="time budget of the whole training (resumes included); the LR schedule anneals by then",
    )
    parser.add_argument("--checkpoint-every", type=positive_int, default=100)
    parser.add_argument("--full-softmax", action="store_true", help="train with the softmax over the whole vocab")
    parser.add_argument(
        "--gamma",
        type=_positive_float,
        default=None,
        help="the loss weight of block position k is exp(-(k - 1) / gamma) (default: 7 (L - 1) / 15 for blocks of "
        "L, DFlash's 7 at L = 16); smaller puts more of the loss on the first positions",
    )
    parser.add_argument(
        "--soft-target-weight",
        type=_non_negative_float,
        default=0.0,
        help="weight of an auxiliary loss term: cross-entropy against the target's own top-k distribution "
        "(stored by generate), beside the main cross-entropy on the greedy labels (0: off)",
    )
    parser.add_argument(
        "--num-negatives",
        type=positive_int,
        default=8192,
        help="sampled-softmax negatives per step (tokens outside the training data)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this DFlash drafter folder (the same shape, or fewer layers: the extra "
        "layers start as identities, so training starts from what it computes)",
    )
    # vocab
    parser.add_argument(
        "--draft-vocab-size",
        type=positive_int,
        default=16384,
        help="tokens in the draft vocabulary (the most frequent training labels)",
    )
    # eval
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="drafter folder of the vocab, eval and ship steps (default: <out-dir>/drafter)",
    )
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--max-eval-sequences", type=positive_int, default=None, help="per category (a quick check)")
    # ship
    parser.add_argument(
        "--ship-dir",
        type=Path,
        default=None,
        help="where ship copies the drafter (default: the package's embedded drafter folder, for the "
        "embedded target only)",
    )


def run(args: argparse.Namespace) -> int:
    from ddtree.training.target import resolve_device, resolve_dtype

    # before any step: a run meant for a GPU must not start writing data (or spend hours) on the CPU
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    for step in args.steps:
        if step == "prompts":
            _prompts(args, args.data_dir)
        elif step == "generate":
            _generate(args, args.data_dir)
        elif step == "eval-data":
            _eval_data(args)
        elif step == "train":
            _train(args)
        elif step == "vocab":
            _vocab(args)
        elif step == "eval":
            _eval(args)
        elif step == "ship":
            _ship(args)
    return 0


def _generate(args: argparse.Namespace, data_dir: Path) -> None:
    from ddtree.training.generate import (
        DEFAULT_STORED_LAYER_IDS,
        generate_responses,
        generate_responses_continuous,
    )

    if not (data_dir / "prompts.jsonl").is_file():
        raise ValueError(f"{data_dir} has no prompts.jsonl: run the prompts step first")
    _check_target(data_dir, args.target)
    stored = tuple(args.stored_layer_ids or DEFAULT_STORED_LAYER_IDS)
    # Every shard is read with the manifest's layer ids: once features exist, they are fixed.
    existing = _read_manifest(data_dir).get("stored_layer_ids")
    if existing is not None and any((data_dir / "features").glob("*.safetensors")):
        if args.stored_layer_ids is not None and list(stored) != existing:
            raise ValueError(
                f"{data_dir} holds features of the layers {existing}; --stored-layer-ids "
                f"{' '.join(map(str, stored))} would store others (use a new --data-dir)"
            )
        stored = tuple(existing)
    top_k = _soft_target_top_k(args, data_dir)
    settings = {
        "batch_size": args.batch_size,
        "greedy": True,
        "max_new_tokens": args.max_new_tokens,
        "engine": args.engine,
        "device": str(args.device),
        "dtype": _dtype_name(args.dtype),
    }
    _update_manifest(
        data_dir,
        {
            "stored_layer_ids": list(stored),
            "soft_target_top_k": top_k,
            "generation": settings,
            "target": _read_manifest(data_dir).get("target", _target_key(args.target)),
        },
    )
    generate = generate_responses_continuous if args.engine == "runner" else generate_responses
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    num_new = generate(
        data_dir,
        args.target,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_prompts=args.max_prompts,
        stored_layer_ids=stored,
        num_threads=args.num_threads,
        max_seconds=args.max_seconds,
        device=args.device,
        dtype=args.dtype,
        soft_target_top_k=top_k,
    )
    # every run's settings: a data directory may mix them (`generation` holds the last run's)
    runs = _read_manifest(data_dir).get("generate_runs", [])
    runs.append({"command": " ".join(sys.argv), **settings, "started": started, "num_responses": num_new})
    _update_manifest(data_dir, {"generate_runs": runs})


def _soft_target_top_k(args: argparse.Namespace, data_dir: Path) -> int:
    """Soft targets per response token: what the data directory's responses hold once it has some (data made
    before soft targets existed holds none), else --soft-target-top-k or the default."""
    from ddtree.training.generate import DEFAULT_SOFT_TARGET_TOP_K

    wanted = args.soft_target_top_k
    if not any((data_dir / "features").glob("*.safetensors")):
        return DEFAULT_SOFT_TARGET_TOP_K if wanted is None else wanted
    existing = _read_manifest(data_dir).get("soft_target_top_k", 0)
    if wanted is not None and wanted != existing:
        raise ValueError(
            f"{data_dir} holds responses with {existing} soft targets per token; --soft-target-top-k {wanted} "
            f"would store {wanted} for the new ones (use a new --data-dir)"
        )
    return existing


def _count_by_category_and_source(prompts: list) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for p in prompts:
        counts.setdefault(p.category, {}).setdefault(p.source, 0)
        counts[p.category][p.source] += 1
    return counts


def _prompts(args: argparse.Namespace, data_dir: Path) -> None:
    from ddtree.training.generate import write_prompts
    from ddtree.training.prompts import drop_overlapping, make_training_prompts

    exists = (data_dir / "prompts.jsonl").exists()
    if exists and not args.add:
        raise ValueError(
            f"{data_dir}/prompts.jsonl exists; generation resumes from it (--add adds prompts to it; a "
            f"new --data-dir starts over)"
        )
    if not args.add and (data_dir / "responses.jsonl").exists():
        raise ValueError(
            f"{data_dir} holds responses to earlier prompts (responses.jsonl): new prompts would reuse "
            f"their ids; use a new --data-dir"
        )
    if args.add and not exists:
        raise ValueError(f"--add: {data_dir}/prompts.jsonl does not exist (run the prompts step without --add)")
    from ddtree.training.self_prompts import make_self_prompts

    if args.add:
        _check_target(data_dir, args.target)  # before the target writes any prompt
    outside = [c for c in args.self_written if c not in args.categories]
    if outside:
        raise ValueError(f"--self-written {' '.join(outside)}: not among --categories {' '.join(args.categories)}")
    written = {}
    for category in args.self_written:
        written[category] = make_self_prompts(
            args.target,
            args.num_prompts_per_category,
            args.seed,
            category=category,
            device=args.device,
            dtype=args.dtype,
            num_threads=args.num_threads,
        )
    prompts = make_training_prompts(
        args.num_prompts_per_category,
        seed=args.seed,
        categories=tuple(args.categories),
        math_templates=args.math_templates,
        written=written,
    )
    kept, dropped = drop_overlapping(prompts)
    if args.add:
        _add_prompts(args, data_dir, kept, dropped)
        return
    write_prompts(data_dir, kept)
    counts = _count_by_category_and_source(kept)
    _update_manifest(
        data_dir,
        {
            "prompts_command": " ".join(sys.argv),
            "prompt_seed": args.seed,
            "num_prompts": len(kept),
            "prompt_counts_by_category_and_source": counts,
            "dropped_for_eval_overlap": {"ngram": 8, "prompt_ids": dropped},
            "sources": {
                "math": "templated word problems, ddtree/training/prompts.py:_math_train",
                "chat": "templated questions over topic lists, ddtree/training/prompts.py:_chat_train",
                "code": "signatures/docstrings of installed stdlib + site-packages functions, prompts.py:_code_prompts",
                **{c: "written by the target itself, ddtree/training/self_prompts.py" for c in args.self_written},
            },
            "target": _target_key(args.target),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    print(f"[prompts] {len(kept)} prompts ({len(dropped)} dropped for eval overlap) -> {data_dir}/prompts.jsonl")


def _add_prompts(args: argparse.Namespace, data_dir: Path, made: list, dropped: list[str]) -> None:
    from ddtree.training.generate import interleave_pending, read_jsonl, write_prompts
    from ddtree.training.prompts import Prompt

    existing = [Prompt(**r) for r in read_jsonl(data_dir / "prompts.jsonl")]
    texts = {p.text for p in existing}
    batch = f"s{args.seed}"

    def batch_id(prompt_id: str) -> str:  # "chat-000012" -> "chat-s7-000012": unique across added batches
        category, number = prompt_id.rsplit("-", 1)
        return f"{category}-{batch}-{number}"

    added = [dataclasses.replace(p, prompt_id=batch_id(p.prompt_id)) for p in made if p.text not in texts]
    dropped = [batch_id(prompt_id) for prompt_id in dropped]
    if not added:
        raise ValueError(
            f"--add: all {len(made)} prompts made with --seed {args.seed} are already in {data_dir} "
            f"(use another --seed)"
        )
    ids = {p.prompt_id for p in existing}
    clashing = [p.prompt_id for p in added if p.prompt_id in ids]
    if clashing:
        raise ValueError(
            f"--add: prompt ids {clashing[:3]} already exist; this seed was added before (use another --seed)"
        )
    done_ids = {r["prompt_id"] for r in read_jsonl(data_dir / "responses.jsonl")}
    write_prompts(data_dir, interleave_pending(existing, done_ids, added))
    batches = _read_manifest(data_dir).get("added_prompts", [])
    batches.append(
        {
            "command": " ".join(sys.argv),
            "seed": args.seed,
            "num_prompts": len(added),
            "skipped_existing_text": len(made) - len(added),
            "counts_by_category_and_source": _count_by_category_and_source(added),
            "dropped_for_eval_overlap": {"ngram": 8, "prompt_ids": dropped},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    _update_manifest(data_dir, {"num_prompts": len(existing) + len(added), "added_prompts": batches})
    print(
        f"[prompts] added {len(added)} prompts ({len(dropped)} dropped for eval overlap, "
        f"{len(made) - len(added)} already there), interleaved with {len(existing) - len(done_ids & ids)} pending "
        f"-> {data_dir}/prompts.jsonl"
    )


def eval_subset(records: list, num_prompts: int) -> list:
    """Evenly spaced prompts of an evaluation set (HumanEval has 164; the tau evaluation uses a subset)."""
    if num_prompts >= len(records):
        return records
    if num_prompts == 1:
        return records[:1]
    return [records[round(i * (len(records) - 1) / (num_prompts - 1))] for i in range(num_prompts)]


def _eval_data(args: argparse.Namespace) -> None:
    from ddtree.training.generate import read_jsonl, write_prompts
    from ddtree.training.prompts import CATEGORIES, load_eval_prompt_records

    for category in CATEGORIES:
        category_dir = args.eval_dir / category
        wanted = eval_subset(load_eval_prompt_records(category), args.num_eval_prompts or DEFAULT_NUM_EVAL_PROMPTS)
        if (category_dir / "prompts.jsonl").exists():
            have = len(read_jsonl(category_dir / "prompts.jsonl"))
            if args.num_eval_prompts is not None and have != len(wanted):
                raise ValueError(
                    f"{category_dir} holds {have} evaluation prompts; --num-eval-prompts "
                    f"{args.num_eval_prompts} would choose others (use a new --eval-dir)"
                )
        else:
            write_prompts(category_dir, wanted)
        _generate(args, category_dir)


def _train_config(args: argparse.Namespace):
    from ddtree.training.train import TrainConfig

    return TrainConfig(
        out_dir=str(args.out_dir),
        num_draft_layers=args.num_draft_layers,
        block_size=args.block_size,
        target_layer_ids=list(args.target_layer_ids),
        mask_token_id=args.mask_token_id,
        max_anchors=args.max_anchors,
        batch_size=args.train_batch_size,
        lr=args.lr,
        max_steps=args.max_steps,
        max_hours=args.max_hours,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        is_softmax_restricted=not args.full_softmax,
        num_negatives=args.num_negatives,
        init_from=None if args.init_from is None else str(args.init_from),
        gamma=args.gamma,
        soft_target_weight=args.soft_target_weight,
    )


def _training_data_dirs(args: argparse.Namespace) -> list[Path]:
    """--data-dir and --extra-data-dirs, each checked to hold data of --target, none twice."""
    data_dirs = [args.data_dir, *args.extra_data_dirs]
    resolved = [d.resolve() for d in data_dirs]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"a data directory is named twice in --data-dir / --extra-data-dirs: {data_dirs}")
    for data_dir in data_dirs:
        _check_target(data_dir, args.target)
    return data_dirs


def _train(args: argparse.Namespace) -> None:
    from ddtree.training.train import train

    data_dirs = _training_data_dirs(args)
    config = _train_config(args)
    path = train(
        data_dirs,
        args.target,
        config,
        num_threads=args.num_threads,
        max_seconds=args.max_seconds,
        device=args.device,
        dtype=args.dtype,
    )
    _update_manifest(
        args.out_dir,
        {
            "train_command": " ".join(sys.argv),
            "train_data_dirs": [str(d) for d in data_dirs],
            "train_config": asdict(config),
            "train_device": str(args.device),
            "train_dtype": _dtype_name(args.dtype),
        },
    )
    print(f"[train] drafter -> {path}")


def _vocab(args: argparse.Namespace) -> None:
    """Count the response tokens (the drafter's training labels) and keep the most frequent as its draft vocab."""
    from collections import Counter

    from ddtree.models.dflash import draft_vocab_from_counts, save_draft_vocab
    from ddtree.training.data import read_sequences
    from ddtree.training.target import load_target_tokenizer

    if args.draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size must be >= 1, got {args.draft_vocab_size}")
    drafter_dir = args.drafter or args.out_dir / "drafter"
    _require_drafter(drafter_dir)
    data_dirs = _training_data_dirs(args)
    sequences = [s for d in data_dirs for s in read_sequences(d)]
    if not sequences:
        raise ValueError(f"no responses in {', '.join(map(str, data_dirs))}: run the generate step first")
    counts = Counter(t for s in sequences for t in s.token_ids[s.prompt_length :])
    tokenizer = load_target_tokenizer(args.target)
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    token_ids = draft_vocab_from_counts(counts, args.draft_vocab_size, required=eos)
    num_labels = sum(counts.values())
    coverage = sum(counts[t] for t in token_ids) / num_labels
    path = save_draft_vocab(
        drafter_dir,
        token_ids,
        command=" ".join(sys.argv),
        data_dirs=[str(d) for d in data_dirs],
        num_responses=len(sequences),
        num_label_tokens=num_labels,
        num_distinct_label_tokens=len(counts),
        label_coverage=round(coverage, 5),
    )
    print(
        f"[vocab] {len(token_ids)} tokens ({len(counts)} distinct in {num_labels} labels, "
        f"coverage {coverage:.4f}) -> {path}"
    )


def _eval(args: argparse.Namespace) -> None:
    import torch

    from ddtree.training.evaluate import (
        evaluate_tau,
        format_table,
        load_evaluation_set,
        load_for_evaluation,
        write_results,
    )
    from ddtree.training.prompts import CATEGORIES

    torch.set_num_threads(args.num_threads)
    from ddtree.training.train import weights_sha256

    drafter_dir = args.drafter or args.out_dir / "drafter"
    _require_drafter(drafter_dir)
    for category in CATEGORIES:
        _check_target(args.eval_dir / category, args.target)
    evaluated_weights = weights_sha256(drafter_dir)  # before loading: a train step may save newer ones meanwhile
    # the drafter in the dtype it is served in (bfloat16 on a GPU), over the draft vocabulary serving drafts over
    drafter, embed, lm_head, draft_token_ids = load_for_evaluation(drafter_dir, args.target, args.device, args.dtype)
    budgets = tuple(args.budgets)
    results = []
    start = time.time()
    for category in CATEGORIES:
        sequences, reader = load_evaluation_set(args.eval_dir / category, drafter, args.max_eval_sequences)
        results.append(
            evaluate_tau(drafter, embed, lm_head, sequences, reader, category, budgets, draft_token_ids=draft_token_ids)
        )
        print(f"[eval] {results[-1].summary()}", flush=True)
    table = format_table(results, budgets)
    print(table)
    command = " ".join(sys.argv)
    write_results(
        drafter_dir / "tau.json",
        results,
        {
            "command": command,
            "eval_dir": str(args.eval_dir),
            "seconds": round(time.time() - start),
            "draft_vocab_size": None if draft_token_ids is None else len(draft_token_ids),
            "device": str(args.device),
            "dtype": _dtype_name(args.dtype),
            "weights_sha256": evaluated_weights,
        },
    )
    (drafter_dir / "tau.md").write_text(f"`{command}`\n\n{table}\n")


def _ship(args: argparse.Namespace) -> None:
    """Everything is checked, and the manifest made, before the first file is copied: a failed ship leaves the
    destination as it was."""
    import shutil

    from ddtree.models.dflash import DRAFT_VOCAB_NAME
    from ddtree.training.generate import read_jsonl
    from ddtree.training.target import DEFAULT_TARGET
    from ddtree.training.train import TRAINING_STATE_NAME, weights_sha256

    ship_dir = args.ship_dir
    if ship_dir is None:
        if args.target != DEFAULT_TARGET:
            raise ValueError(
                f"--ship-dir is needed for --target {args.target} (the default folder is the embedded "
                f"{DEFAULT_TARGET} drafter's)"
            )
        ship_dir = DEFAULT_SHIP_DIR
    drafter_dir = args.drafter or args.out_dir / "drafter"
    _require_drafter(drafter_dir)
    tau_path = drafter_dir / "tau.json"
    if not tau_path.exists():
        raise ValueError(f"{drafter_dir} has no tau.json: run the eval step before shipping")
    tau = json.loads(tau_path.read_text())
    vocab_path = drafter_dir / DRAFT_VOCAB_NAME
    # The shipped tau must describe what serving drafts over: the weights evaluated, and a vocabulary made (or
    # removed) after the eval step would ship with a tau measured over another one.
    if tau.get("weights_sha256") != weights_sha256(drafter_dir):
        raise ValueError(
            f"{tau_path} was measured on other weights than {drafter_dir}/model.safetensors (trained "
            f"on since, or an older eval): run the eval step again"
        )
    vocab = json.loads(vocab_path.read_text()) if vocab_path.exists() else None
    num_vocab = None if vocab is None else len(vocab["token_ids"])
    num_vocab_evaluated = tau.get("draft_vocab_size")
    if num_vocab != num_vocab_evaluated:
        raise ValueError(
            f"{tau_path} was measured over a draft vocabulary of {num_vocab_evaluated} tokens (None: the "
            f"full vocabulary) but {drafter_dir} has {num_vocab}: run the eval step again"
        )
    if not (drafter_dir / TRAINING_STATE_NAME).is_file():
        raise ValueError(
            f"{drafter_dir} has no {TRAINING_STATE_NAME} (which step its weights are from): ship ships "
            f"the drafter of a train step's --out-dir; for one trained before this file existed, run "
            f"the train step again on its --out-dir (a finished run saves at once), then eval"
        )
    data_dirs = [args.data_dir, *args.extra_data_dirs]
    for path, step in (
        (args.out_dir / "manifest.json", "train"),
        (args.out_dir / "log.jsonl", "train"),
        *((d / "manifest.json", "prompts") for d in data_dirs),
    ):
        if not path.is_file():
            raise ValueError(
                f"{path} does not exist: ship reads the {step} step's records from --out-dir and "
                f"--data-dir / --extra-data-dirs (the ones the drafter was trained with)"
            )
    train_manifest = json.loads((args.out_dir / "manifest.json").read_text())
    trained_on = train_manifest.get("train_data_dirs")
    if trained_on is not None and [Path(d).resolve() for d in trained_on] != [d.resolve() for d in data_dirs]:
        raise ValueError(
            f"{args.out_dir} was trained on {' '.join(trained_on)}: ship with those as --data-dir and "
            f"--extra-data-dirs, so that the manifest describes its data"
        )
    state = json.loads((drafter_dir / TRAINING_STATE_NAME).read_text())
    if state.get("weights_sha256") != tau["weights_sha256"]:
        raise ValueError(
            f"{drafter_dir}/{TRAINING_STATE_NAME} describes other weights than the drafter's: train "
            f"saved a newer drafter while this one was evaluated; run the eval step again"
        )
    log = [r for r in read_jsonl(args.out_dir / "log.jsonl") if r["step"] <= state["step"]]
    tail = log[-100:]
    data_manifests = [_data_manifest(d) for d in data_dirs]
    manifest = {
        "target": args.target,
        "train": train_manifest,
        "init_from": _init_record(train_manifest["train_config"].get("init_from")),
        "training_steps": state["step"],
        "training_hours": state["hours"],
        "final_100_steps_mean": {k: round(sum(r[k] for r in tail) / len(tail), 4) for k in ("loss", "acc", "acc_k1")}
        if tail
        else None,
        "data": data_manifests[0],
        **({"extra_data": data_manifests[1:]} if len(data_manifests) > 1 else {}),
        "tau": tau,
        # how the vocabulary was made (its command and data), which may predate this training run
        "draft_vocab": None if vocab is None else {k: v for k, v in vocab.items() if k != "token_ids"},
        "ship_command": " ".join(sys.argv),
    }
    ship_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tau.md"):
        shutil.copy(drafter_dir / name, ship_dir / name)
    if vocab_path.exists():
        shutil.copy(vocab_path, ship_dir / DRAFT_VOCAB_NAME)
    else:  # a stale vocabulary must not outlive the drafter it was made for
        (ship_dir / DRAFT_VOCAB_NAME).unlink(missing_ok=True)
    (ship_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"[ship] {drafter_dir} -> {ship_dir}")


def _init_record(init_from: str | None) -> dict | None:
    """The drafter a training run started from: its weights' hash and, for a shipped one, its own MANIFEST.json,
    so that a fine-tune's manifest carries its whole lineage (read before ship overwrites that folder)."""
    from ddtree.training.train import weights_sha256

    if init_from is None:
        return None
    folder = Path(init_from)
    if not (folder / "model.safetensors").is_file():
        return {"path": init_from, "weights_sha256": None, "manifest": None}  # a run's folder, since removed
    manifest = folder / "MANIFEST.json"
    return {
        "path": init_from,
        "weights_sha256": weights_sha256(folder),
        "manifest": json.loads(manifest.read_text()) if manifest.is_file() else None,
    }


def _data_manifest(data_dir: Path) -> dict:
    """A data directory's manifest with its response counts, as a shipped drafter records it."""
    from ddtree.training.data import read_sequences

    manifest = json.loads((data_dir / "manifest.json").read_text())
    sequences = read_sequences(data_dir)
    manifest["num_responses"] = len(sequences)
    manifest["num_response_tokens"] = sum(len(s.token_ids) - s.prompt_length for s in sequences)
    if not manifest.get("dropped_for_eval_overlap", {}).get("prompt_ids"):
        manifest.pop("dropped_for_eval_overlap", None)
    return manifest


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _target_key(target: str) -> str:
    """How a data manifest names its target: the embedded target's name, or the absolute path of a file/folder."""
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else target


def _require_drafter(drafter_dir: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        if not (drafter_dir / name).is_file():
            raise ValueError(
                f"{drafter_dir} has no {name}: run the train step first (or name a drafter with --drafter)"
            )


def _check_target(data_dir: Path, target: str) -> None:
    """A data (or evaluation) directory holds one target's tokens and hidden states: refuse another target's."""
    recorded = _read_manifest(data_dir).get("target")
    if recorded is None:
        return
    path = Path(recorded)
    if not path.is_absolute() and path.name != recorded and not path.exists():
        # an older manifest's relative path, written from another directory: only its name can be compared
        same = path.name == Path(target).name
    else:
        same = _target_key(recorded) == _target_key(target)
    if not same:
        raise ValueError(
            f"{data_dir} holds data of the target {recorded} (its manifest.json), not of --target "
            f"{target}: pass that --target, or use another --data-dir / --eval-dir for this one"
        )


def _read_manifest(data_dir: Path) -> dict:
    path = data_dir / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _update_manifest(data_dir: Path, fields: dict) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(data_dir)
    manifest.update(fields)
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
