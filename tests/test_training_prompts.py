"""Offline prompt sets: evaluation sets load, training prompts are diverse and disjoint from every evaluation set."""

import pytest

from ddtree.training.prompts import (
    CATEGORIES,
    Prompt,
    _word_ngrams,
    drop_overlapping,
    load_eval_prompt_records,
    load_eval_prompts,
    make_training_prompts,
)


@pytest.fixture(scope="module")
def training_prompts():
    return make_training_prompts(150, seed=0)


def test_eval_sets_load_for_every_category():
    sizes = {c: len(load_eval_prompts(c)) for c in CATEGORIES}
    assert sizes["code"] == 164  # HumanEval
    assert sizes["math"] >= 30 and sizes["chat"] >= 30
    assert all(isinstance(t, str) and t for c in CATEGORIES for t in load_eval_prompts(c))
    with pytest.raises(ValueError):
        load_eval_prompts("poetry")


def test_training_prompts_are_balanced_unique_and_deterministic(training_prompts):
    assert {p.category for p in training_prompts} == set(CATEGORIES)
    assert len({p.text for p in training_prompts}) == len(training_prompts)
    assert len({p.prompt_id for p in training_prompts}) == len(training_prompts)
    # the first prompts cycle through the categories, so any prefix of the list is balanced
    assert [p.category for p in training_prompts[:3]] == list(CATEGORIES)
    assert [p.text for p in make_training_prompts(150, seed=0)] == [p.text for p in training_prompts]


def test_training_prompts_share_no_template_or_8gram_with_eval_sets(training_prompts):
    eval_records = [r for c in CATEGORIES for r in load_eval_prompt_records(c)]
    eval_sources = {r.source for r in eval_records}
    assert not eval_sources & {p.source for p in training_prompts}
    kept, dropped = drop_overlapping(training_prompts)
    assert not dropped and len(kept) == len(training_prompts)
    eval_texts = {r.text for r in eval_records}
    assert not eval_texts & {p.text for p in training_prompts}


def test_drop_overlapping_catches_a_leaked_eval_prompt(training_prompts):
    leaked_math = Prompt("math-leak", "math", "Please help. " + load_eval_prompts("math")[3], "leak")
    humaneval = load_eval_prompts("code")[10]
    leaked_code = Prompt("code-leak", "code", "Write this:\n" + humaneval.split("```python\n")[1], "leak")
    kept, dropped = drop_overlapping(training_prompts[:20] + [leaked_math, leaked_code])
    assert sorted(dropped) == ["code-leak", "math-leak"]
    assert len(kept) == 20


def test_drop_overlapping_catches_an_eval_prompt_shorter_than_the_ngram(training_prompts):
    import re

    short = min(load_eval_prompts("chat"), key=lambda t: len(re.findall(r"\w+", t)))
    assert len(re.findall(r"\w+", short)) < 8  # no 8-gram to share: the whole prompt is its own n-gram
    leaked = Prompt("chat-leak", "chat", f"Quick one. {short.upper()} Thanks!", "leak")
    kept, dropped = drop_overlapping(training_prompts[:20] + [leaked])
    assert dropped == ["chat-leak"] and len(kept) == 20


def test_word_ngrams():
    assert _word_ngrams("A b, c d!", 2) == {("a", "b"), ("b", "c"), ("c", "d")}
    assert _word_ngrams("a b", 3) == set()


def test_prompt_subsets_and_template_sets_are_checked_and_reproducible():
    both = make_training_prompts(60, seed=0, categories=("math", "chat"))
    assert {p.category for p in both} == {"math", "chat"}
    # asking for fewer categories leaves the others' draws (and so the earlier data sets) unchanged
    full = make_training_prompts(60, seed=0, math_templates="basic")
    basic = make_training_prompts(60, seed=0, categories=("math", "chat"), math_templates="basic")
    assert [p.text for p in basic] == [p.text for p in full if p.category != "code"]
    broad_sources = {p.source for p in make_training_prompts(300, seed=1, categories=("math",), math_templates="broad")}
    basic_sources = {p.source for p in basic if p.category == "math"}
    assert len(broad_sources) >= 30 and not broad_sources & basic_sources
    assert {p.source for p in both if p.category == "math"} & basic_sources
    with pytest.raises(ValueError, match="categories"):
        make_training_prompts(5, categories=("poetry",))
    with pytest.raises(ValueError, match="categories"):
        make_training_prompts(5, categories=())
    with pytest.raises(ValueError, match="math_templates"):
        make_training_prompts(5, math_templates="fancy")


def test_broad_math_templates_stay_apart_from_the_eval_sets():
    broad = make_training_prompts(1500, seed=5, categories=("math",), math_templates="broad")
    assert len(broad) == 1500
    eval_sources = {r.source for c in CATEGORIES for r in load_eval_prompt_records(c)}
    assert not eval_sources & {p.source for p in broad}
    kept, dropped = drop_overlapping(broad)
    assert not dropped


def test_self_written_prompts_are_filtered():
    from ddtree.training.self_prompts import OPENINGS, keep_self_prompt

    ok = "Can you help me plan a birthday party for my friends?"
    assert keep_self_prompt(ok, "stop")
    assert not keep_self_prompt(ok, "length")  # cut by the token limit: not a whole message
    assert not keep_self_prompt("Help me.", "stop")  # too short
    assert not keep_self_prompt(ok + " <|im_start|>assistant", "stop")
    assert not keep_self_prompt("Can you tell me about the homenageth_menthу of Sklаstabo please?", "stop")
    assert not keep_self_prompt("Can you tell me how the Silk Road shaped trade?", "stop")  # a chat eval topic
    opening = "Write a Python function"
    assert not keep_self_prompt(opening, "stop", opening)  # the model ended its turn at once
    assert keep_self_prompt(opening + " that adds two numbers.", "stop", opening)
    math = OPENINGS["math"]
    assert keep_self_prompt(math + " Ann has 3 apples and buys 4 more. How many now?", "stop", math, "math")
    # a math prompt without a number is a riddle or chat (the opening's own words do not count)
    assert not keep_self_prompt(math + " Why is the sky blue, and what is love?", "stop", math, "math")
    assert keep_self_prompt("Why is the sky blue, and what is love?", "stop")  # fine as chat


def test_user_turn_prefix_is_the_template_up_to_the_user_text():
    from ddtree.training.self_prompts import user_turn_prefix
    from tests.tiny_tokenizer import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    prefix = user_turn_prefix(tokenizer)
    assert rendered.startswith(prefix + "hello") and prefix


def test_written_prompts_replace_their_category_only():
    pairs = [("self", f"Please help me with task number {i} today.") for i in range(5)]
    plain = make_training_prompts(5, seed=3)
    mixed = make_training_prompts(5, seed=3, written={"chat": pairs + pairs[:1]})
    assert [p for p in mixed if p.category != "chat"] == [p for p in plain if p.category != "chat"]
    assert [(p.source, p.text) for p in mixed if p.category == "chat"] == pairs  # repeats dropped


def test_eval_conversations_take_each_set_in_order_as_one_user_turn():
    from ddtree.training.prompts import load_eval_conversations

    conversations = load_eval_conversations(2)
    expected = [text for category in ("code", "math", "chat") for text in load_eval_prompts(category)[:2]]
    assert [c[0]["content"] for c in conversations] == expected
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
