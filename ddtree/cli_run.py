"""`ddtree generate` and `ddtree chat`: the offline engine from a terminal, streaming as tokens are accepted."""

from __future__ import annotations

import argparse
import sys

from ddtree.sampling_params import SamplingParams


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target: folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder (default: the shipped one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                        help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--speculation", default="ddtree", choices=["ddtree", "dflash", "off"])
    parser.add_argument("--budget", default="auto", help="'auto' or a fixed node count per round")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="print acceptance statistics after each answer")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="after each answer, print every token's log-probability and the k most likely")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (sent through the chat template unless --raw)")
    parser.add_argument("--raw", action="store_true", help="complete the prompt text as is, no chat template")
    add_model_arguments(parser)


def _build(args):
    from ddtree.llm import LLM

    budget = args.budget if args.budget == "auto" else _int(args.budget, "--budget")
    # the parameters first: a bad value is reported before the model loads
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, logprobs=args.logprobs)
    except ValueError as exc:  # name the flag, not the field ("SamplingParams.max_tokens must be ...")
        message = str(exc)
        for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs"):
            message = message.replace(f"SamplingParams.{field}", f"--{field.replace('_', '-')}")
        raise ValueError(message.replace("None or ", "")) from None
    llm = LLM(args.model, args.drafter, device=args.device, dtype=args.dtype, speculation=args.speculation,
              budget=budget)
    return llm, params


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be 'auto' or an integer, got {value!r}") from None


def _stream(llm, prompt, params, show_stats: bool) -> str:
    text, last = [], None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        text.append(out.new_text)
        last = out
    sys.stdout.write("\n")
    if last is not None and last.logprobs is not None:
        for lp in last.logprobs:
            top = "  ".join(f"{text!r} {value:.3f}" for _, text, value in lp.top)
            print(f"{lp.text!r:>16} {lp.logprob:8.3f}" + (f"   top: {top}" if top else ""), file=sys.stderr)
    if show_stats and last is not None:
        s = last.stats
        tau = s.mean_acceptance_length
        print(f"[{len(last.token_ids)} tokens, {s.num_speculative_rounds} speculative + "
              f"{s.num_autoregressive_rounds} autoregressive rounds, tau={tau if tau is None else round(tau, 2)}, "
              f"finish={last.finish_reason}]", file=sys.stderr)
    return "".join(text)


def run_generate(args) -> int:
    llm, params = _build(args)
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    _stream(llm, prompt, params, args.stats)
    return 0


def run_chat(args) -> int:
    llm, params = _build(args)
    messages: list[dict] = []
    print("Chat with the model (an empty line, /quit or Ctrl-D ends it; /reset starts over).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("", "/quit", "/exit"):
            break
        if line.strip() == "/reset":
            messages = []
            print("(conversation reset)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        answer = _stream(llm, llm.apply_chat_template(messages), params, args.stats)
        messages.append({"role": "assistant", "content": answer})
    return 0
