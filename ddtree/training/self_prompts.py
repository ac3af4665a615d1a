"""User prompts written by the target itself (Magpie, Xu et al. 2024, "Alignment Data Synthesis from Scratch").

An instruction-tuned model given its chat template up to the point where a user's text begins writes a user's
message: the kind of request it was tuned on. Sampled (T = 1, top-p 0.95), these are far more varied than the
templated chat prompts (whose topic pairs a few thousand prompts exhaust), and they are requests the target itself
finds likely, which is the traffic a drafter for it should expect. The target then answers them greedily as for
any other prompt (`generate`).

Kept: messages that ended by themselves (an end-of-turn, not the token limit), of 4 to 120 words beyond the
opening, mostly ASCII
(a sampled 135M model sometimes drifts into byte soup), without chat-template markers, mentioning no topic of the
chat evaluation set, not repeated (case-insensitive), and for math, holding a number (an opening that asks for a
word problem still lets the model drift into riddles and chat). The caller also drops any sharing a word 8-gram
with an evaluation prompt, as for every training prompt.
"""

from __future__ import annotations

from ddtree.training.prompts import _TOPICS_EVAL

SOURCE = "self"
# What a self-written prompt of each category starts with: the target continues the user's message from there.
# (Math: of the openings tried on SmolLM2-135M, this one gave word problems most often; "Solve:" and "Math
# question:" gave bare equations, "A math word problem:" mostly chat.)
OPENINGS = {"chat": "", "code": "Write a Python function", "math": "Help me solve this word problem:"}
_MARKER = "\x00USER_TEXT\x00"
_EVAL_TOPICS = tuple(t.lower() for t in _TOPICS_EVAL)


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user's message begins (system prompt and all, if the template adds
    one by default)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARKER}], tokenize=False, add_generation_prompt=False
    )
    if _MARKER not in rendered:
        raise ValueError("the chat template does not render the user's text verbatim; self-written prompts need it")
    return rendered[: rendered.index(_MARKER)]


def keep_self_prompt(text: str, finish_reason: str, opening: str = "", category: str = "chat") -> bool:
    if finish_reason != "stop":
        return False
    num_written = len(text.split()) - len(opening.split())  # the words the model wrote itself
    if not 4 <= num_written <= 120 or "<|" in text or "|>" in text:
        return False
    if category == "math" and not any(c.isdigit() for c in text[len(opening) :]):
        return False
    if sum(c.isascii() for c in text) < 0.97 * len(text):
        return False
    lowered = text.lower()
    return not any(topic in lowered for topic in _EVAL_TOPICS)


def make_self_prompts(
    target: str | None,
    num_prompts: int,
    seed: int,
    *,
    category: str = "chat",
    device: str = "cpu",
    dtype=None,
    num_threads: int = 1,
    batch_size: int = 64,
    max_tokens: int = 128,
    max_attempts_factor: int = 4,
) -> list[tuple[str, str]]:
    """`num_prompts` distinct (source, text) pairs of `category` (its user messages start with OPENINGS[category])
    sampled from `target` (None: the embedded default), seeded per attempt (seed * 10**6 + attempt), so a rerun
    with the same arguments writes the same prompts."""
    import torch

    from ddtree.llm import LLM
    from ddtree.sampling_params import SamplingParams

    if num_prompts <= 0:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}")
    if category not in OPENINGS:
        raise ValueError(f"the target writes prompts of categories {sorted(OPENINGS)}, not {category!r}")
    opening = OPENINGS[category]
    torch.set_num_threads(num_threads)
    llm = LLM(
        model=_model_arg(target),
        speculation="off",
        device=str(device),
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        max_num_seqs=batch_size,
    )
    # token ids: a template that writes its BOS into the text would get a second one from encoding with specials
    prefix_ids = list(llm.tokenizer.encode(user_turn_prefix(llm.tokenizer) + opening, add_special_tokens=False))
    batch_size = min(batch_size, 2 * num_prompts)  # each sample has its own seed: the batch does not change it
    kept: list[tuple[str, str]] = []
    seen: set[str] = set()
    attempt = 0
    while len(kept) < num_prompts and attempt < max_attempts_factor * num_prompts:
        seeds = range(seed * 10**6 + attempt, seed * 10**6 + attempt + batch_size)
        attempt += batch_size
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=s) for s in seeds]
        for out in llm.generate([prefix_ids] * len(params), params):
            text = (opening + out.text).strip()
            if keep_self_prompt(text, out.finish_reason, opening, category) and text.lower() not in seen:
                seen.add(text.lower())
                kept.append((SOURCE, text))
        print(f"[prompts] self-written {category}: {len(kept)} kept of {attempt} sampled", flush=True)
    if not kept:
        raise ValueError(
            f"the target wrote no usable user prompt in {attempt} samples (is it an instruction-tuned "
            f"chat model?); leave the category out of --self-written"
        )
    return kept[:num_prompts]


def _model_arg(target: str | None) -> str | None:
    from ddtree.training.target import DEFAULT_TARGET

    return None if target in (None, DEFAULT_TARGET) else target
