"""`ddtree generate` and `ddtree chat`: the offline engine from a terminal, streaming as tokens are accepted."""

from __future__ import annotations

import argparse
import sys

from ddtree.sampling_params import SamplingParams


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target: folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder (default: the shipped one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16", "float64"],
        help="weights dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--speculation", default="ddtree", choices=["ddtree", "dflash", "off"])
    parser.add_argument("--budget", default="auto", help="'auto' or a fixed node count per round")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop string (repeat for several): the answer ends before it",
    )
    parser.add_argument("--stats", action="store_true", help="print acceptance statistics after each answer")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="after each answer, print every token's log-probability and the k most likely",
    )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt", help="the prompt (sent through the chat template unless --raw); - reads it from standard input"
    )
    parser.add_argument("--raw", action="store_true", help="complete the prompt text as is, no chat template")
    add_model_arguments(parser)


def _build(args):
    from ddtree.llm import LLM

    budget = args.budget if args.budget == "auto" else _int(args.budget, "--budget")
    # the parameters first: a bad value is reported before the model loads
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            logprobs=args.logprobs,
            stop=args.stop or [],
        )
    except ValueError as exc:  # name the flag, not the field ("SamplingParams.max_tokens must be ...")
        message = str(exc)
        for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs", "stop"):
            message = message.replace(f"SamplingParams.{field}", f"--{field.replace('_', '-')}")
        raise ValueError(message.replace("None or ", "")) from None
    llm = LLM(
        args.model, args.drafter, device=args.device, dtype=args.dtype, speculation=args.speculation, budget=budget
    )
    return llm, params


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be 'auto' or an integer, got {value!r}") from None


def _stream(llm, prompt, params, show_stats: bool) -> str:
    text, last = [], None
    stream = llm.stream(prompt, params)
    try:
        for out in stream:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            text.append(out.new_text)
            last = out
    finally:
        stream.close()  # (Ctrl-C mid-answer: the request leaves the engine now)
    sys.stdout.write("\n")
    if last is not None and last.logprobs is not None:
        for lp in last.logprobs:
            top = "  ".join(f"{text!r} {value:.3f}" for _, text, value in lp.top)
            print(f"{lp.text!r:>16} {lp.logprob:8.3f}" + (f"   top: {top}" if top else ""), file=sys.stderr)
    if show_stats and last is not None:
        s = last.stats
        tau = s.mean_acceptance_length
        print(
            f"[{len(last.token_ids)} tokens, {s.num_speculative_rounds} speculative + "
            f"{s.num_autoregressive_rounds} autoregressive rounds, tau={tau if tau is None else round(tau, 2)}, "
            f"finish={last.finish_reason}]",
            file=sys.stderr,
        )
    return "".join(text)


def run_generate(args) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise ValueError("the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
    llm, params = _build(args)
    prompt = text if args.raw else llm.apply_chat_template([{"role": "user", "content": text}])
    _stream(llm, prompt, params, args.stats)
    return 0


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message that starts the conversation")


def run_chat(args) -> int:
    llm, params = _build(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    if start:
        try:  # once, before the first turn: some chat templates refuse a system message
            llm.apply_chat_template([*start, {"role": "user", "content": "hi"}])
        except Exception as exc:
            raise ValueError(f"--system: this model's chat template does not take a system message ({exc})") from None
    messages = list(start)
    print("Chat with the model (/quit or Ctrl-D ends it; /reset starts over; Ctrl-C stops an answer).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            break
        if not line.strip():
            continue
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            print("(conversation reset)", file=sys.stderr)
            continue
        turn = [*messages, {"role": "user", "content": line}]
        # One turn's failure ends that turn only: the conversation so far stays as it was.
        try:
            answer = _stream(llm, llm.apply_chat_template(turn), params, args.stats)
        except ValueError as exc:  # e.g. the conversation outgrew the context window
            print(f"ddtree: error: {exc} (this message is dropped; /reset starts over)", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("\n(answer stopped; this exchange is dropped)", file=sys.stderr)
            continue
        messages = [*turn, {"role": "assistant", "content": answer}]
    return 0
