"""The engine on tiny random float64 models: lossless at T=0 against `off` and Hugging Face, continuous batching,
stops, budgets, fallback, sampling statistics, input validation."""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from ddtree.budget import CLOSED_BATCH_SLACK
from ddtree.cost import CostModel
from ddtree.engine import Engine, EngineConfig, PromptTooLongError
from ddtree.llm import LLM
from ddtree.loaders import build_workers
from ddtree.sampling_params import SamplingParams
from ddtree.scheduler import EngineFullError
from tests.factories import make_tiny_drafter, make_tiny_target
from tests.tiny_tokenizer import make_sentencepiece_tokenizer

PROMPTS = ["hello world", "the cat sat on", "a", "12 + 7 =", "why is the sky blue?"]
# A fixed cost model keeps the tests deterministic (the engine measures one at start-up otherwise).
FLAT_COST = CostModel([(1, 0.010), (64, 0.012), (1024, 0.05)], [(1, 0.002), (16, 0.003)])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(root / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(root / "drafter", target)
    return target, drafter


@pytest.fixture(scope="module")
def workers(checkpoints):
    target, drafter = checkpoints
    return build_workers(str(target), str(drafter), dtype="float64")


def make_llm(workers, **config) -> LLM:
    target, drafter, tokenizer = workers
    # The policy alone, on its scripted cost model: the closed loop measures this machine's real round times
    # (tests/test_guard.py tests it), which would make the policy's tests depend on the machine.
    config = EngineConfig(**{"max_explore_share": 0.0, **config})
    # Engines refresh their cost model from live timings: each gets its own copy.
    engine = Engine(
        config, target, drafter if config.speculation != "off" else None, tokenizer, cost=copy.deepcopy(FLAT_COST)
    )
    return LLM.from_engine(engine)


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_llm_says_what_it_loads_and_when_it_is_ready(checkpoints, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    target, drafter = checkpoints
    LLM(str(target), str(drafter), dtype="float64", speculation="off")
    messages = [r.getMessage() for r in caplog.records if r.name == "ddtree"]
    assert messages[0] == f"loading {target} on cpu" and messages[-1].startswith("ready in ")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_loading_messages_reach_stderr_where_nothing_configured_logging(setting):
    code = "from ddtree.llm import logger, show_progress; show_progress(); logger.info('loading x')"
    env = {**os.environ, "DDTREE_CONFIGURE_LOGGING": setting}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stderr == ("ddtree: loading x\n" if setting == "1" else "")


def test_in_process_workers_satisfy_the_engine_contract(workers):
    from ddtree.contracts import Drafter, Pending, Target
    from ddtree.workers import Completed

    target, drafter, _ = workers
    assert isinstance(target, Target) and isinstance(drafter, Drafter)
    assert not isinstance(drafter, Target) and not isinstance(target, Drafter)
    assert isinstance(Completed(int), Pending)


def test_off_matches_hugging_face_greedy(checkpoints, workers):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float64).eval()
    llm = make_llm(workers, speculation="off")
    tok = workers[2]
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy(16))):
        ids = tok.encode(prompt, add_special_tokens=False)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "config",
    [
        dict(speculation="ddtree", budget=1),
        dict(speculation="ddtree", budget=4),
        dict(speculation="ddtree", budget=16),
        dict(speculation="ddtree", budget=64),
        dict(speculation="ddtree", budget="auto"),
        dict(speculation="dflash"),
    ],
    ids=lambda c: f"{c['speculation']}-{c.get('budget', '')}",
)
def test_speculative_t0_equals_off_batched(workers, config):
    reference = make_llm(workers, speculation="off").generate(PROMPTS, greedy())
    outputs = make_llm(workers, max_num_seqs=3, **config).generate(PROMPTS, greedy())
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert [o.text for o in outputs] == [r.text for r in reference]
    rounds = [a for o in outputs for a in o.acceptance_lengths]
    assert rounds and all(a >= 1 for a in rounds)
    if config.get("budget") == 64:
        assert max(rounds) > 1  # with 64 nodes over a 46-token vocabulary some drafts must be accepted


def test_requests_join_and_leave_mid_flight(workers):
    reference = {
        p: o.token_ids
        for p, o in zip(
            PROMPTS,
            make_llm(workers, speculation="off").generate(PROMPTS, [greedy(8 + 4 * i) for i in range(len(PROMPTS))]),
        )
    }
    engine = make_llm(workers, speculation="ddtree", budget=8, max_num_seqs=2).engine
    ids, finals, pending = {}, {}, list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third round
            i, p = pending.pop(0)
            ids[engine.add_request(p, greedy(8 + 4 * i))] = p
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out.token_ids
        steps += 1
    assert finals == reference


def test_streaming_concatenates_to_the_final_text(workers):
    llm = make_llm(workers, speculation="ddtree", budget=16)
    final = llm.generate("the cat sat on", greedy(30))[0]
    chunks = list(llm.stream("the cat sat on", greedy(30)))
    assert "".join(c.new_text for c in chunks) == final.text
    assert sum(len(c.new_token_ids) for c in chunks) == len(final.token_ids)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def test_interleaved_streams_and_generate_share_one_llm(workers):
    """Two streams advanced in turn, and a generate() call while they are paused: every caller gets all of its
    request's outputs, whichever caller stepped the engine (outputs of other requests were dropped before, and a
    stream whose final output another caller consumed spun forever)."""
    llm = make_llm(workers, speculation="ddtree", budget=16)
    expected = {p: o.text for p, o in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], greedy(30)))}
    streams = {p: llm.stream(p, greedy(30)) for p in PROMPTS[:2]}
    texts = {p: "" for p in streams}
    for _ in range(2):  # a few chunks each, in turn
        for p, stream in streams.items():
            texts[p] += next(stream).new_text
    assert llm.generate(PROMPTS[2], greedy(30))[0].text == expected[PROMPTS[2]]  # steps both paused streams too
    for p, stream in streams.items():
        texts[p] += "".join(chunk.new_text for chunk in stream)
    assert texts == {p: expected[p] for p in streams}
    assert not llm.engine.has_unfinished_requests() and not llm._outbox
    # a request aborted behind the stream's back ends it with an error, not an endless wait
    stream = llm.stream(PROMPTS[0], greedy(30))
    first = next(stream)
    llm.engine.abort_request(first.request_id)
    with pytest.raises(RuntimeError, match="left the engine"):
        list(stream)  # (after the outputs its first step already filed)


def test_stops_apply_to_tokens_accepted_in_one_round(workers):
    off = make_llm(workers, speculation="off")
    spec = make_llm(workers, speculation="ddtree", budget=64)
    free_text = off.generate(PROMPTS[1], greedy(40))[0]
    stop = free_text.text[10:12]
    assert len(stop) == 2 and free_text.text.index(stop) > 0
    outputs = []
    for llm in (off, spec):
        out = llm.generate(PROMPTS[1], greedy(40, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.text == free_text.text[: free_text.text.index(stop)]
        outputs.append((llm, out))
    stop_id = free_text.token_ids[6]
    for llm in (off, spec):
        out = llm.generate(PROMPTS[1], greedy(40, stop_token_ids=[stop_id]))[0]
        first = free_text.token_ids.index(stop_id)
        assert out.finish_reason == "stop" and out.token_ids == free_text.token_ids[: first + 1]
        outputs.append((llm, out))
        out = llm.generate(PROMPTS[1], greedy(5))[0]
        assert out.finish_reason == "length" and out.token_ids == free_text.token_ids[:5]
        outputs.append((llm, out))
    for out in [out for llm, out in outputs if llm is spec]:  # the prefill's token, then what each round committed
        assert 1 + sum(out.acceptance_lengths) == len(out.token_ids)  # tokens past a stop are not counted


def test_eos_and_context_length(workers, checkpoints):
    target, drafter, tok = workers
    free = make_llm(workers, speculation="off").generate(PROMPTS[0], greedy(40))[0]
    eos_target = free.token_ids[3]
    target.eos_token_ids.append(eos_target)  # pretend that token is EOS for a moment
    try:
        engine = Engine(
            EngineConfig(speculation="ddtree", budget=16), target, drafter, tok, cost=copy.deepcopy(FLAT_COST)
        )
        out = LLM.from_engine(engine).generate(PROMPTS[0], SamplingParams(max_tokens=40))[0]
        first = free.token_ids.index(eos_target)
        assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    finally:
        target.eos_token_ids.remove(eos_target)
    short = Engine(
        EngineConfig(speculation="ddtree", budget=16, max_model_len=20),
        target,
        drafter,
        tok,
        cost=copy.deepcopy(FLAT_COST),
    )
    out = LLM.from_engine(short).generate(PROMPTS[0], greedy(100))[0]
    prompt_len = len(tok.encode(PROMPTS[0], add_special_tokens=False))
    assert out.finish_reason == "length" and len(out.token_ids) == 20 - prompt_len
    assert out.token_ids == free.token_ids[: 20 - prompt_len]
    with pytest.raises(PromptTooLongError):
        short.add_request("x" * 20, greedy())


def test_invalid_requests_leave_nothing_behind(workers):
    llm = make_llm(workers, speculation="ddtree", budget=4, max_num_seqs=2, max_waiting=2)
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", greedy())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 10_000], greedy())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("hi", {"temperature": 0})
    for prompt in (123, None, b"hi", [True, 2]):
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request(prompt, greedy())
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(None, greedy())
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], greedy())
    assert not engine.has_unfinished_requests()
    # A burst at an idle engine: the free seats, then max_waiting more (all queued before a round admits them).
    for prompt in "abcd":
        engine.add_request(prompt, greedy(20))
    with pytest.raises(EngineFullError):
        engine.add_request("e", greedy(2))
    engine.step()  # two admitted, two still waiting: still full
    assert (engine.num_running, engine.num_waiting) == (2, 2)
    with pytest.raises(EngineFullError):
        engine.add_request("e", greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="speculation"):
        EngineConfig(speculation="medusa")
    with pytest.raises(ValueError, match="budget"):
        EngineConfig(budget=0)


def test_abort_frees_the_request(workers):
    engine = make_llm(workers, speculation="ddtree", budget=8).engine
    kv_before = engine.target.num_kv_bytes_used
    rid = engine.add_request("hello world", greedy(50))
    engine.step()
    engine.step()
    out = engine.abort_request(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.target.num_kv_bytes_used == kv_before and not engine.has_unfinished_requests()


def test_a_drafter_that_outputs_nan_costs_acceptance_not_the_engine(checkpoints, workers):
    """A drafter whose forward overflows (NaN) drafts zero-probability trees: every request still decodes exactly,
    where the tree builder used to raise and stop the engine for all of them."""
    target_dir, drafter_dir = checkpoints
    target, drafter, tok = build_workers(str(target_dir), str(drafter_dir), dtype="float64")
    drafter.drafter.model.norm.weight.fill_(float("nan"))
    engine = Engine(EngineConfig(speculation="ddtree", budget=8), target, drafter, tok, cost=copy.deepcopy(FLAT_COST))
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:3], greedy(20))
    outputs = LLM.from_engine(engine).generate(PROMPTS[:3], greedy(20))
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert engine.timings.num_draft_calls > 0  # it did draft, every round (fixed budget)


def test_a_request_with_one_token_left_does_not_draft(workers):
    """Its last token comes from the verify's root alone: a draft could add nothing to it."""
    llm = make_llm(workers, speculation="ddtree", budget=8)
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:2], greedy(2))
    outputs = llm.generate(PROMPTS[:2], greedy(2))  # one token from the prefill, one left
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert llm.engine.timings.num_draft_calls == 0 and all(o.acceptance_lengths == [] for o in outputs)
    longer = llm.generate(PROMPTS[:1], greedy(12))[0]
    assert longer.acceptance_lengths and sum(longer.acceptance_lengths) <= 11  # drafted, except maybe the last


def test_a_closed_batch_drafts_only_for_the_requests_that_set_its_end(workers, monkeypatch):
    """`LLM.generate`'s requests are a closed batch: nothing more arrives before its last request finishes, so tokens
    committed ahead of the others shorten nothing. With 8 and 30 new tokens asked, the short request never drafts
    (it stays more than CLOSED_BATCH_SLACK tokens ahead of the long one) and the long one does; stepped without the
    promise (a server's loop, or a stream that another call may join), both draft. Outputs equal off's either way.
    (Without fallback the policy plans every request it is given: what is left out, the rule left out.)"""
    params = [greedy(8), greedy(30)]
    reference = [o.token_ids for o in make_llm(workers, speculation="off").generate(PROMPTS[:2], params)]
    llm = make_llm(workers, speculation="ddtree", budget="auto", allow_fallback=False)
    engine = llm.engine
    plan = engine.budget.plan
    planned = []  # per round: the requests the policy planned, and every running request's tokens left

    def recording_plan(request_ids):
        planned.append((list(request_ids), {r: engine.requests[r].tokens_left for r in engine.scheduler.running}))
        return plan(request_ids)

    monkeypatch.setattr(engine.budget, "plan", recording_plan)
    outputs = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outputs] == reference
    assert planned and all(left[r] >= max(left.values()) - CLOSED_BATCH_SLACK for ids, left in planned for r in ids)
    assert outputs[0].stats.num_speculative_rounds == 0 and outputs[1].stats.num_speculative_rounds > 0

    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[i].token_ids for i in ids] == reference
    assert all(finals[i].stats.num_speculative_rounds > 0 for i in ids)


@pytest.mark.parametrize(
    "config",
    [
        dict(speculation="ddtree", budget=64),
        dict(speculation="dflash"),
        dict(speculation="ddtree", budget="auto", ngram_tokens=8),
    ],
    ids=["ddtree-64", "dflash", "auto-ngram"],
)
def test_trees_hold_no_node_deeper_than_the_tokens_left(workers, config, monkeypatch):
    """A round commits at most accepted nodes + 1 tokens: a request with n tokens left verifies no node deeper
    than n - 1, and its output stays the target's own."""
    llm = make_llm(workers, max_num_seqs=3, **config)
    engine, depth_excess = llm.engine, []
    submit = engine.target.verify_async

    def checked_verify(request_ids, trees, roots, *prompts):
        for rid, tree in zip(request_ids, trees):
            if tree is not None and tree.num_nodes:
                output = engine.requests[rid].output
                depth_excess.append(int(tree.depths.max()) - (output.max_new_tokens - len(output.token_ids) - 1))
        return submit(request_ids, trees, roots, *prompts)

    monkeypatch.setattr(engine.target, "verify_async", checked_verify)  # (the workers are the module's)
    params = [greedy(n) for n in (3, 4, 5, 7, 9)]
    reference = make_llm(workers, speculation="off").generate(PROMPTS, params)
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert depth_excess and max(depth_excess) == 0  # capped, and some at their cap


@pytest.mark.parametrize("temperatures", [[0.0], [1.0], [0.0, 1.0]], ids=["greedy", "sampled", "mixed"])
def test_the_lm_head_on_the_walked_rows_only_changes_nothing(workers, monkeypatch, temperatures):
    """A verify that runs the LM head only on the rows its walk reaches (from LM_HEAD_ON_DEMAND_MIN_TOKENS packed
    tokens) gives the tokens and log-probabilities of one over every row, greedy and sampled (seeded), and in a batch
    mixing both (a pass of the walk may then ask for greedy requests' rows only: it crashed the engine once)."""
    target = workers[0]
    params = [
        SamplingParams(
            temperature=temperatures[s % len(temperatures)], max_tokens=20, ignore_eos=True, seed=s, logprobs=2
        )
        for s in range(len(PROMPTS))
    ]
    runs = {}
    for name, min_tokens in (("all rows", 10**9), ("walked rows", 1)):
        monkeypatch.setattr(target, "lm_head_on_demand_min_tokens", min_tokens)
        outputs = make_llm(workers, speculation="ddtree", budget=16, max_num_seqs=3).generate(PROMPTS, params)
        runs[name] = outputs
        assert any(a > 1 for o in outputs for a in o.acceptance_lengths)  # trees were walked past their roots
    for walked, full in zip(runs["walked rows"], runs["all rows"]):
        assert walked.token_ids == full.token_ids
        # (an LM head over fewer rows may block its float64 sums differently: the last bits)
        assert [[t for t, _, _ in lp.top] for lp in walked.logprobs] == [
            [t for t, _, _ in lp.top] for lp in full.logprobs
        ]
        assert [lp.logprob for lp in walked.logprobs] == pytest.approx([lp.logprob for lp in full.logprobs], abs=1e-9)


def _sentencepiece_tokenizer(vocab_size: int):
    """A SentencePiece-style tokenizer over the tiny target's vocabulary: words, letters, byte-fallback tokens."""
    pieces = ["<unk>", "\u2581", "\u2581h", "\u2581w", "\u2581he", "\u2581\u2581", "\u2581\u2581h", *"abcdefghijkl"]
    return make_sentencepiece_tokenizer(pieces + [f"<0x{b:02X}>" for b in range(0x41, 0x41 + vocab_size - len(pieces))])


def test_logprob_bytes_and_offsets_follow_the_text_with_a_sentencepiece_tokenizer(workers):
    """The output's text drops its first word's space (the decode strips it at the start): the bytes of its tokens
    join into the text all the same, and completion offsets are where each token's text starts in it."""
    from deployments.responses import completion_logprobs

    target, drafter, _ = workers
    tokenizer = _sentencepiece_tokenizer(target.vocab_size)
    engine = Engine(
        EngineConfig(speculation="ddtree", budget=4), target, drafter, tokenizer, cost=copy.deepcopy(FLAT_COST)
    )
    outputs = LLM.from_engine(engine).generate([[5, 12], [41, 27], [3, 3, 3]], greedy(24, logprobs=1))
    num_spaced_starts = 0
    for out in outputs:
        assert b"".join(lp.token_bytes for lp in out.logprobs).decode() == out.text
        first_piece = tokenizer.convert_ids_to_tokens(out.token_ids[0])
        num_spaced_starts += first_piece.startswith("\u2581")
        offsets = completion_logprobs(out.logprobs)["text_offset"]
        assert offsets == [
            len(tokenizer.decode(out.token_ids[:i], skip_special_tokens=True)) for i in range(len(out.token_ids))
        ]
    assert num_spaced_starts  # outputs whose first token's space the text dropped


@pytest.mark.parametrize("first", [["\u2581\u2581h"], ["\u2581\u2581", "\u2581h"], ["<unk>", "\u2581h"], ["\u2581"]])
def test_logprob_bytes_drop_only_the_spaces_the_text_drops(workers, first):
    """Where the output's text starts (its first token that decodes to anything, after special ones), its bytes
    drop the space a decode strips at a text's start, one, not more: a first token "\u2581\u2581h" is " h"."""
    from ddtree.workers import RawLogprobs

    target, drafter, _ = workers
    tokenizer = _sentencepiece_tokenizer(target.vocab_size)
    engine = Engine(EngineConfig(speculation="off"), target, None, tokenizer, cost=copy.deepcopy(FLAT_COST))
    ids = tokenizer.convert_tokens_to_ids(first + ["a", "\u2581w"])
    raw = RawLogprobs([-1.0] * len(ids), [[t] for t in ids], [[-1.0] for _ in ids])
    for split in range(len(ids) + 1):  # the tokens over two rounds, cut anywhere
        done = engine.writer.token_logprobs(ids[:split], raw, True)
        rest = RawLogprobs(raw.chosen[split:], raw.top_ids[split:], raw.top_values[split:])
        done += engine.writer.token_logprobs(ids[split:], rest, not any(lp.token_bytes for lp in done))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert b"".join(lp.token_bytes for lp in done).decode() == text
        assert [lp.top_bytes[0] for lp in done] == [lp.token_bytes for lp in done]


def test_automatic_ids_skip_ids_callers_chose(workers):
    engine = make_llm(workers, speculation="off").engine
    mine = engine.add_request("hello", greedy(2), request_id="req-0")
    auto = engine.add_request("hello", greedy(2))
    assert mine == "req-0" and auto != "req-0" and auto.startswith("req-")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hello", greedy(2), request_id=auto)
    for rid in (mine, auto):
        engine.abort_request(rid)


class _HopDelayed:
    """An actor call's pending result: its wall time exceeds the time inside the worker by the hops."""

    def __init__(self, inner, hop_seconds: float) -> None:
        self.inner, self.seconds, self.wall_seconds = inner, inner.seconds, inner.seconds + hop_seconds

    def result(self):
        return self.inner.result()


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_cost_model_sees_what_a_call_costs_the_round(workers, monkeypatch, pipeline):
    """Sequential rounds wait for each call: the cost model observes wall times, hops included (on actors a draft
    costs its hops too, and ignoring them made drafting look cheaper than it is under Serve). With two groups in
    flight the calls overlap, so it observes the time inside the workers."""
    llm = make_llm(workers, speculation="ddtree", budget=4, pipeline=pipeline, max_num_seqs=4)
    engine, (target, drafter, _) = llm.engine, workers
    for worker, name in ((drafter, "draft_async"), (target, "verify_async")):
        call = getattr(worker, name)
        monkeypatch.setattr(worker, name, lambda *a, call=call: _HopDelayed(call(*a), 1.0))
    observed = {"draft": [], "verify": []}
    for kind in observed:
        method = getattr(engine.budget.cost, f"observe_{kind}")
        monkeypatch.setattr(
            engine.budget.cost,
            f"observe_{kind}",
            lambda n, seconds, *r, method=method, kind=kind: (observed[kind].append(seconds), method(n, seconds, *r)),
        )
    llm.generate(PROMPTS[:2], greedy(12))
    for seconds in observed.values():
        assert seconds and (all(s >= 1.0 for s in seconds) if not pipeline else all(s < 1.0 for s in seconds))


def test_the_start_up_profile_times_one_request_and_batches_of_requests(workers):
    """The cost model's start-up profile: one request's verify pass by tokens, and passes over batches of one-token
    requests up to max_num_seqs (what each request adds beyond its tokens); none for a batch of one."""
    target, drafter, tok = workers
    for max_num_seqs, counts in ((6, [1, 2, 4, 6]), (1, [1])):
        engine = Engine(
            EngineConfig(speculation="ddtree", budget="auto", max_num_seqs=max_num_seqs), target, drafter, tok
        )
        cost = engine.budget.cost
        assert [r for r, _ in cost.request_points] == counts and [r for r, _ in cost.load_points] == counts
        assert all(s >= 0 for _, s in cost.request_points) and cost.verify_seconds(6, 6) >= cost.verify_seconds(6)
        assert target.model.kv.num_bytes_used == 0  # the profile's requests are freed


def test_fallback_skips_the_drafter_and_recovers(workers):
    # A drafter forward that costs five one-token verify passes never pays: requests decode autoregressively with
    # no drafter call at all, and within 3% of their time (BudgetConfig.max_probe_overhead) not even a probe fits.
    expensive = CostModel([(1, 0.010), (2, 0.030), (64, 1.0)], [(1, 0.050), (16, 0.060)])
    target, drafter, tok = workers
    # (the policy alone: the closed loop would measure this machine's real costs, not the scripted ones)
    engine = Engine(
        EngineConfig(speculation="ddtree", budget="auto", max_explore_share=0.0), target, drafter, tok, cost=expensive
    )
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:2], greedy(60))
    ids = [engine.add_request(p, greedy(60)) for p in PROMPTS[:2]]
    finals = {}
    for _ in range(10):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.timings.num_speculative_request_rounds == 0 and engine.timings.num_draft_calls == 0
    # The drafter becomes cheap (say, it moved to its own GPU): probes come and the requests speculate again.
    engine.budget.cost = CostModel([(1, 0.010), (1024, 0.011)], [(1, 0.0001)])
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[i].token_ids for i in ids] == [r.token_ids for r in reference]
    assert all(finals[i].stats.num_speculative_rounds >= 2 for i in ids)


# The drafter never pays, a verify of a few tokens costs what one does: only n-gram chains speculate.
NGRAM_ONLY_COST = CostModel([(1, 0.010), (8, 0.0102), (64, 0.05)], [(1, 0.050), (16, 0.060)])


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_ngram_chains_of_requests_in_fallback_are_exact_and_accepted(workers, pipeline):
    prompts = ["the cat the cat the cat the", "ab ab ab ab ab", "12 + 7 = 12 + 7 ="]
    reference = make_llm(workers, speculation="off").generate(prompts, greedy(40))
    target, drafter, tok = workers
    for ngram_tokens in (3, 1):
        engine = Engine(
            EngineConfig(max_num_seqs=2, ngram_tokens=ngram_tokens, pipeline=pipeline, max_explore_share=0.0),
            target,
            drafter,
            tok,
            cost=copy.deepcopy(NGRAM_ONLY_COST),
        )
        outputs = LLM.from_engine(engine).generate(prompts, greedy(40))
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
        assert engine.timings.num_draft_calls == 0
        assert sum(o.stats.num_ngram_tokens for o in outputs) > 0
        assert engine.budget.ngram_acceptance != [0.5, 0.35, 0.25]  # learned from the chains
    # fixed budgets and the DFlash baseline stay pure: no n-gram nodes
    for config in (dict(budget=4), dict(speculation="dflash")):
        engine = make_llm(workers, **config).engine
        assert engine.ngram_tokens == 0 and engine.max_verified_nodes == engine.max_budget


def test_pipelined_chains_are_priced_after_the_group_in_flight(workers):
    """Pipelined: a request decoding without a draft verifies its chain in the pass that also verifies the group
    drafted the phase before; the chain's allocation counts that group's tokens and expected tokens. (The plan is
    forced: one request drafts per phase, the others decode with their chains.)"""
    from ddtree.budget import RoundPlan

    target, drafter, tok = workers
    engine = Engine(
        EngineConfig(max_num_seqs=4, pipeline=True, max_explore_share=0.0),
        target,
        drafter,
        tok,
        cost=copy.deepcopy(FLAT_COST),
    )
    real_plan = engine.budget.plan

    def one_drafts(request_ids):
        plan = real_plan(request_ids)
        ids = plan.speculative_ids + plan.autoregressive_ids
        return RoundPlan(ids[:1], ids[1:], [engine.budget.draft_node_cap] * len(ids[:1]))

    engine.budget.plan = one_drafts
    calls, in_flight = [], [None]
    real_allocate_round = engine.budget.allocate_round

    def spy(plan, drafted, chains, packed=(0, 0.0)):
        if not plan.speculative_ids:  # the chains of requests decoding without a draft
            calls.append((packed, in_flight[0]))
        return real_allocate_round(plan, drafted, chains, packed)

    engine.budget.allocate_round = spy
    for prompt in ["the cat the cat the cat the", "ab ab ab ab ab", "12 + 7 = 12 + 7 =", "a b a b a b"]:
        engine.add_request(prompt, greedy(60))
    while engine.has_unfinished_requests():
        group = engine.pipeline.in_flight  # verified in the coming phase
        entries = group.entries if group is not None else []
        in_flight[0] = (
            len(entries) + sum(e.tree.num_nodes for e in entries),
            len(entries) + sum(e.predicted for e in entries),
        )
        engine.step()
    assert any(expected[0] > 0 for _, expected in calls)  # some chains joined a pass holding a drafted group
    for packed, expected in calls:
        assert packed[0] == expected[0] and packed[1] == pytest.approx(expected[1])


def test_ngram_values_learn_from_chains_that_were_not_verified(workers):
    # A second verify token costs three first ones: no chain pays, none is verified, yet every round compares the
    # proposal with the target's own tokens, so the values keep following the workload.
    target, drafter, tok = workers
    expensive = CostModel([(1, 0.010), (2, 0.030), (64, 1.0)], [(1, 0.050), (16, 0.060)])
    engine = Engine(EngineConfig(max_num_seqs=2, max_explore_share=0.0), target, drafter, tok, cost=expensive)
    outputs = LLM.from_engine(engine).generate(["the cat the cat the cat the", "ab ab ab ab ab"], greedy(40))
    assert sum(o.stats.num_ngram_tokens for o in outputs) == 0 and engine.timings.num_draft_calls == 0
    assert engine.budget.ngram_acceptance != [0.5, 0.35, 0.25]


def test_ngram_chains_merge_into_drafted_trees_exactly(workers):
    prompts = ["the cat the cat the cat the", "ab ab ab ab ab"]
    reference = make_llm(workers, speculation="off").generate(prompts, greedy(40))
    llm = make_llm(workers, max_num_seqs=2, allow_fallback=False)
    outputs = llm.generate(prompts, greedy(40))
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    budgets = [b for o in outputs for b in o.stats.budgets]
    assert max(budgets) > 0 and llm.engine.budget.ngram_acceptance != [0.5, 0.35, 0.25]


def test_ngram_config_is_validated():
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="ngram_tokens"):
            EngineConfig(ngram_tokens=bad)


def _chi_square_p_value(observed: Counter, expected_probs: dict, n: int) -> float:
    """Pearson chi-square with categories of expected count < 5 pooled; Wilson-Hilferty approximation."""
    stat, pooled_obs, pooled_exp, dof = 0.0, 0, 0.0, -1
    for key, p in expected_probs.items():
        e = p * n
        if e < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        dof += 1
    unexpected = sum(c for k, c in observed.items() if k not in expected_probs)
    pooled_obs += unexpected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    elif unexpected:
        return 0.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("proposals", ["tree", "ngram"])
def test_sampling_matches_the_target_distribution(checkpoints, workers, proposals):
    """Three sampled tokens after a fixed prompt (two of them through a verify round with a 16-node tree, or with
    n-gram chains from the prompt's repeats) are distributed as the target's own top-k=3, T=1 distribution,
    computed exactly with Hugging Face."""
    from transformers import AutoModelForCausalLM

    tok = workers[2]
    # n-gram variant: every character of the tiny vocabulary occurs in the prompt with one after it, so the first
    # sampled token always has a 1-token chain to verify in the round that samples the second (with two tokens
    # left, a round verifies no deeper).
    ngram_prompt = "abcdefghijklmnopqrstuvwxyz .,!?0123456789 the cat the cat the"
    prompt = tok.encode("the cat" if proposals == "tree" else ngram_prompt, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float64).eval()

    def dist(ids):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        top = logits.topk(3)
        probs = top.values.softmax(-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    expected = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                expected[(a, b, c)] = pa * pb * pc
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    if proposals == "tree":
        llm = make_llm(workers, speculation="ddtree", budget=16, max_num_seqs=8)
    else:
        target, drafter, _ = workers
        llm = LLM.from_engine(
            Engine(
                EngineConfig(max_num_seqs=4, max_explore_share=0.0),
                target,
                drafter,
                tok,
                cost=copy.deepcopy(NGRAM_ONLY_COST),
            )
        )
    n = 1500
    torch.manual_seed(1234)
    outs = llm.generate([prompt] * n, params)
    observed = Counter(tuple(o.token_ids) for o in outs)
    if proposals == "tree":
        assert sum(a for o in outs for a in o.acceptance_lengths if a > 1) > 0  # drafts were accepted sometimes
    else:
        assert llm.engine.timings.num_draft_calls == 0 and sum(o.stats.num_ngram_tokens for o in outs) > 0
    assert _chi_square_p_value(observed, expected, n) > 1e-4
    # The same test rejects a wrong distribution (the draft-free argmax chain is far from it).
    wrong = Counter({max(expected, key=expected.get): n})
    assert _chi_square_p_value(wrong, expected, n) < 1e-6


def test_seeded_sampling_depends_on_the_seed_only(workers):
    """Noise keyed by (seed, position): the same text with any tree, budget, batch, or no speculation at all."""
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:3], p)
    for config in (dict(budget=8), dict(budget=64, max_num_seqs=1), dict(budget="auto"), dict(speculation="dflash")):
        outputs = make_llm(workers, **{"speculation": "ddtree", **config}).generate(PROMPTS[:3], p)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference], config
    other_seed = make_llm(workers, speculation="off").generate(
        PROMPTS[:3], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=8, ignore_eos=True)
    )
    assert [o.token_ids for o in other_seed] != [r.token_ids for r in reference]


# ---- two request groups in flight (pipeline=True) ------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [dict(budget=8), dict(budget="auto"), dict(speculation="dflash")], ids=["fixed", "auto", "dflash"]
)
def test_pipelined_t0_equals_off_with_requests_joining(workers, config):
    """Two groups alternate drafting and verifying; requests join every other phase and finish at different
    lengths: every output is still exactly `off`'s."""
    lengths = [8 + 5 * i for i in range(len(PROMPTS))]
    reference = {
        p: o.token_ids
        for p, o in zip(PROMPTS, make_llm(workers, speculation="off").generate(PROMPTS, [greedy(n) for n in lengths]))
    }
    config = {"speculation": "ddtree", **config}
    engine = make_llm(workers, pipeline=True, max_num_seqs=4, **config).engine
    ids, finals, pending, steps = {}, {}, list(zip(PROMPTS, lengths)), 0
    max_in_flight = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            p, n = pending.pop(0)
            ids[engine.add_request(p, greedy(n))] = p
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out.token_ids
        group = engine.pipeline.in_flight
        max_in_flight = max(max_in_flight, len(group.entries) if group else 0)
        steps += 1
    assert finals == reference
    assert max_in_flight >= 1 and engine.pipeline.in_flight is None
    assert engine.timings.num_speculative_request_rounds > 0


def test_pipelined_groups_stay_balanced(workers):
    """With four speculating requests, each phase drafts two while the other two are verified."""
    engine = make_llm(workers, pipeline=True, speculation="ddtree", budget=4, max_num_seqs=4).engine
    for p in PROMPTS[:4]:
        engine.add_request(p, greedy(40))
    engine.step()  # admits all four: two draft, two decode one token autoregressively
    assert len(engine.pipeline.in_flight.request_ids) == 2
    for _ in range(6):
        before = set(engine.pipeline.in_flight.request_ids)
        engine.step()
        after = set(engine.pipeline.in_flight.request_ids)
        assert len(after) == 2 and not before & after  # the groups alternate
    assert engine.timings.num_pipelined_phases == 7
    for rid in list(engine.requests):  # aborting mid-pipeline frees everything (and leaves the shared workers clean)
        engine.abort_request(rid)
    assert not engine.requests and engine.target.num_kv_bytes_used == 0


def test_pipelined_abort_of_a_request_in_flight(workers):
    engine = make_llm(workers, pipeline=True, speculation="ddtree", budget=8, max_num_seqs=4).engine
    kv_before = engine.target.num_kv_bytes_used
    keep = engine.add_request("hello world", greedy(20))
    gone = engine.add_request("the cat sat on", greedy(50))
    engine.step()
    engine.step()
    in_flight = engine.pipeline.in_flight.request_ids
    victim = in_flight[0]
    engine.abort_request(victim)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    survivor = keep if victim == gone else gone
    assert list(finals) == [survivor] and finals[survivor].finish_reason == "length"
    assert engine.target.num_kv_bytes_used == kv_before
    expected = make_llm(workers, speculation="off").generate(
        "hello world" if survivor == keep else "the cat sat on", greedy(20 if survivor == keep else 50)
    )[0]
    assert finals[survivor].token_ids == expected.token_ids


def test_pipeline_and_probe_config_are_validated():
    with pytest.raises(ValueError, match="pipeline"):
        EngineConfig(pipeline="yes")
    for bad in (0, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="max_probe_overhead"):
            EngineConfig(max_probe_overhead=bad)


def test_pipeline_auto_follows_the_cost_model_and_needs_concurrent_workers(workers):
    """pipeline="auto": never in one process (the calls could not overlap); with workers that run concurrently (the
    actor proxies say can_overlap where they have cores or devices of their own) it pipelines while the cost model
    predicts a gain, and goes back to one group (verifying the group in flight first) when it does not. Outputs stay
    exactly `off`'s throughout."""
    target, drafter, tok = workers
    compute_bound = CostModel([(1, 0.01), (1000, 1.0)], [(1, 0.05), (16, 0.8)])
    bandwidth_bound = CostModel([(1, 0.04), (1000, 0.05)], [(1, 0.002), (16, 0.004)])
    config = EngineConfig(speculation="ddtree", budget=8, max_num_seqs=4, pipeline="auto")
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:4], greedy(30))

    local = Engine(config, target, drafter, tok, cost=copy.deepcopy(compute_bound))
    assert [o.token_ids for o in LLM.from_engine(local).generate(PROMPTS[:4], greedy(30))] == [
        r.token_ids for r in reference
    ]
    assert local.pipeline.in_flight is None and local.timings.num_pipelined_phases == 0

    class RemoteTarget(type(target)):  # the same worker, declared concurrent as the actor proxies are
        can_overlap = True

    class RemoteDrafter(type(drafter)):
        can_overlap = True

    target.__class__, drafter.__class__ = RemoteTarget, RemoteDrafter
    try:
        engine = Engine(config, target, drafter, tok, cost=copy.deepcopy(compute_bound))
        ids = [engine.add_request(p, greedy(30)) for p in PROMPTS[:4]]
        finals, was_pipelined = {}, False
        for _ in range(4):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            was_pipelined |= engine.pipeline.in_flight is not None
        assert was_pipelined
        engine.budget.cost = copy.deepcopy(bandwidth_bound)  # now one group is faster: it drains and stays out
        engine.step()
        assert engine.pipeline.in_flight is None
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            assert engine.pipeline.in_flight is None
        assert [finals[i].token_ids for i in ids] == [r.token_ids for r in reference]
    finally:
        target.__class__, drafter.__class__ = RemoteTarget.__base__, RemoteDrafter.__base__


def test_pipelined_abort_then_reuse_of_the_request_id(workers):
    """A request aborted while its tree is in flight, then a new request with the same id: the stale tree must not
    be verified for the newcomer (it may still be waiting, with no KV cache and no root token)."""
    engine = make_llm(workers, pipeline=True, speculation="ddtree", budget=8, max_num_seqs=2).engine
    engine.add_request("hello world", greedy(20), request_id="x")
    engine.add_request("the cat sat on", greedy(20), request_id="y")
    engine.step()  # both admitted: x drafts, y decodes one token
    assert engine.pipeline.in_flight.request_ids == ["x"]
    engine.abort_request("x")
    engine.add_request("12 + 7 =", greedy(20), request_id="z")  # takes the free seat first
    engine.add_request("a", greedy(20), request_id="x")  # waits
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    expected = make_llm(workers, speculation="off").generate(["the cat sat on", "12 + 7 =", "a"], greedy(20))
    assert [finals[r].token_ids for r in ("y", "z", "x")] == [e.token_ids for e in expected]


def test_params_changed_after_construction_are_checked_again(workers):
    engine = make_llm(workers, speculation="ddtree", budget=4).engine
    params = SamplingParams(temperature=1.0)
    params.top_p = 0  # set after construction: never validated by __post_init__
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("hi", params)
    params = greedy(4)
    params.stop = "ab"  # a string, not a list: one stop string, not two characters
    params.stop_token_ids = None
    rid = engine.add_request("hi", params)
    assert engine.requests[rid].output.params.stop == ["ab"]
    params.stop = 5
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("hi", params)
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()


def test_the_context_window_is_capped_by_what_one_request_can_reserve(checkpoints, workers):
    # A request reserves prompt + max_tokens + one verify pass up front: one that could never fit the KV cache
    # would wait at the head of the queue forever. The engine caps its window to what fits, and says so.
    target_dir, drafter_dir = checkpoints
    bytes_per_token = workers[0].model.kv.bytes_per_token
    target, drafter, tok = build_workers(
        str(target_dir), str(drafter_dir), dtype="float64", kv_cache_bytes=40 * bytes_per_token
    )
    assert target.max_request_tokens == 40 < target.max_model_len
    engine = Engine(EngineConfig(speculation="ddtree", budget=4), target, drafter, tok, cost=copy.deepcopy(FLAT_COST))
    assert engine.max_model_len == 40 - 1 - 4
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(5, 5 + 35)), greedy())
    out = LLM.from_engine(engine).generate(PROMPTS[1], greedy(1000))[0]
    prompt_len = len(tok.encode(PROMPTS[1], add_special_tokens=False))
    assert out.finish_reason == "length" and len(out.token_ids) == 35 - prompt_len
    assert target.num_kv_bytes_used == 0
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(EngineConfig(speculation="ddtree", budget=64), target, drafter, tok, cost=copy.deepcopy(FLAT_COST))


def test_text_prompts_get_the_tokenizers_special_tokens(workers):
    # As Hugging Face and vLLM encode a text prompt: Llama/Mistral tokenizers put BOS in front.
    from tokenizers import processors

    from tests.tiny_tokenizer import make_char_tokenizer

    target, drafter, _ = workers
    bos_tok = make_char_tokenizer()
    bos_id = bos_tok.convert_tokens_to_ids("<unk>")  # the char tokenizer has no BOS: any special token shows it
    bos_tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<unk> $A", special_tokens=[("<unk>", bos_id)]
    )
    engine = Engine(EngineConfig(speculation="off"), target, None, bos_tok, cost=copy.deepcopy(FLAT_COST))
    ids, _ = engine.validate("ab", greedy())
    assert ids == [bos_id] + bos_tok.encode("ab", add_special_tokens=False)
    assert engine.validate([5, 6], greedy())[0] == [5, 6]  # token ids are taken as given


def test_an_interrupted_generate_leaves_nothing_queued(workers):
    llm = make_llm(workers, speculation="ddtree", budget=4, max_num_seqs=2)
    engine, real_step, calls = llm.engine, llm.engine.step, []

    def interrupted_step(closed_batch=False):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(closed_batch)

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(20))
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.target.num_kv_bytes_used == 0
    engine.step = real_step
    assert len(llm.generate(PROMPTS[:2], greedy(4))) == 2


def test_logprobs_are_the_targets_own_in_every_mode(checkpoints, workers):
    """Each committed token's log-probability (and the top 3) is the target's log-softmax at that position, whether
    the token came from prefill, a decode step, an accepted tree node or a bonus token (Hugging Face as oracle)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float64).eval()
    tok = workers[2]
    params = greedy(12, logprobs=3)
    for config in (dict(speculation="off"), dict(speculation="ddtree", budget=16), dict(speculation="ddtree")):
        for prompt, out in zip(PROMPTS[:3], make_llm(workers, **config).generate(PROMPTS[:3], params)):
            ids = tok.encode(prompt, add_special_tokens=False)
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0], dim=-1)
            assert len(out.logprobs) == len(out.token_ids)
            for k, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
                row = logp[len(ids) + k - 1]
                assert lp.token_id == token and lp.logprob == pytest.approx(row[token].item(), abs=1e-6)
                top = row.topk(3)
                assert [t for t, _, _ in lp.top] == top.indices.tolist()
                assert [v for _, _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
                assert lp.top[0][0] == token and lp.text == tok.decode([token])  # greedy: the most likely
    assert make_llm(workers, speculation="off").generate(PROMPTS[0], greedy(4))[0].logprobs is None


def test_logprobs_in_a_batch_are_each_requests_own(workers):
    """Requests asking for different numbers of top log-probabilities (or none) share one verify: each gets what it
    asked for, the same as when it runs alone."""
    llm = make_llm(workers, speculation="ddtree", budget=16)
    asks = [None, 0, 3, 1]
    batch = llm.generate(PROMPTS[:4], [greedy(10, logprobs=k) for k in asks])
    for prompt, k, out in zip(PROMPTS[:4], asks, batch):
        alone = llm.generate(prompt, greedy(10, logprobs=k))[0]
        assert out.token_ids == alone.token_ids
        if k is None:
            assert out.logprobs is None
            continue
        assert [len(lp.top) for lp in out.logprobs] == [k] * len(out.token_ids)
        for got, want in zip(out.logprobs, alone.logprobs):
            assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-9)
            assert [t for t, _, _ in got.top] == [t for t, _, _ in want.top]


@pytest.mark.parametrize("chunk", [2, 512])
def test_raw_logprobs_of_a_batch_equal_each_requests_own(monkeypatch, chunk):
    import ddtree.workers as workers_module

    monkeypatch.setattr(workers_module, "LOGPROB_ROWS_PER_CHUNK", chunk)
    logits = torch.randn(9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([3, 1, 4, 1, 5, 2, 6, 5, 3])
    rows, ks = [[0, 1], [2], [3, 4, 5], [6, 8], [7]], [2, None, 0, 9, 1]
    out = workers_module.raw_logprobs(logits, tokens, rows, ks)
    assert out[1] is None
    logp = torch.log_softmax(logits, dim=-1)
    for r in (0, 2, 3, 4):
        k = min(ks[r], 7)
        assert out[r].chosen == pytest.approx([logp[i, tokens[i]].item() for i in rows[r]])
        assert out[r].top_ids == [logp[i].topk(k).indices.tolist() for i in rows[r]]
        for got, i in zip(out[r].top_values, rows[r]):
            assert got == pytest.approx(logp[i].topk(k).values.tolist())
    assert workers_module.raw_logprobs(logits, tokens, rows, [None] * 5) == [None] * 5


def test_logprobs_follow_stops_and_streams(workers):
    llm = make_llm(workers, speculation="ddtree", budget=64)
    free = llm.generate(PROMPTS[1], greedy(40))[0]
    stop = free.text[10:12]
    out = llm.generate(PROMPTS[1], greedy(40, stop=[stop], logprobs=0))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < len(free.token_ids)
    assert all(lp.top == [] for lp in out.logprobs)
    chunks = list(llm.stream(PROMPTS[1], greedy(30, logprobs=2)))
    final = llm.generate(PROMPTS[1], greedy(30, logprobs=2))[0]
    assert [lp for c in chunks for lp in c.new_logprobs] == final.logprobs
    assert all(len(c.new_logprobs) == len(c.new_token_ids) for c in chunks)


def test_features_kept_for_the_drafter_hold_only_their_own_rows(workers):
    """A verify's kept features are gathered for all requests at once; each request keeps a copy of its rows, not a
    view of the round's gather (a request resting in fallback keeps them for many rounds, and the KV budget counts
    each token's features once)."""
    from ddtree.tree import DraftTree

    target, _, _ = workers
    ids = ["pin-a", "pin-b", "pin-c"]
    for rid in ids:
        assert target.allocate(rid, 64, greedy())
    try:
        first = target.prefill(ids, [[5, 6, 7], [8, 9], [10, 11, 12, 13]]).token_ids
        target.take_features(ids)
        chain = DraftTree(torch.tensor([3, 4]), torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.zeros(2))
        for _ in range(3):
            result = target.verify(ids, [chain, None, chain], first)
            first = result.bonus_token_ids
        for rid in ids:
            for rows in target._pending_features[rid]:
                assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()
    finally:
        for rid in ids:
            target.free(rid)


@pytest.mark.parametrize("value", [0, -1.0, True, "60"])
def test_max_queue_seconds_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="max_queue_seconds"):
        EngineConfig(max_queue_seconds=value)


def test_a_request_waiting_past_max_queue_seconds_leaves_unserved(workers):
    """With one seat, the second and third requests wait; once they have waited max_queue_seconds they leave with
    finish_reason "queue_timeout" and no token (oldest first), without a call to a worker, while the running request
    goes on to off's answer."""
    import time

    target, _, tok = workers
    reference = make_llm(workers, speculation="off").generate(PROMPTS[:1], greedy(20))[0]
    calls: list[str] = []
    original = target.free

    def counting_free(request_id):
        calls.append(request_id)
        return original(request_id)

    engine = Engine(
        EngineConfig(speculation="off", max_num_seqs=1, max_queue_seconds=0.2),
        target,
        None,
        tok,
        cost=copy.deepcopy(FLAT_COST),
    )
    target.free = counting_free
    try:
        running = engine.add_request(PROMPTS[0], greedy(20))
        engine.step()  # admitted: it holds the one seat
        waiting = [engine.add_request(p, greedy(20)) for p in PROMPTS[1:3]]
        finals = {o.request_id: o for o in engine.step() if o.finished}
        assert not finals  # (not waited long enough yet)
        time.sleep(0.25)
        finals = {o.request_id: o for o in engine.step() if o.finished}
        assert [finals[r].finish_reason for r in waiting] == ["queue_timeout", "queue_timeout"]
        assert all(finals[r].token_ids == [] for r in waiting) and not set(waiting) & set(calls)
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals[running].token_ids == reference.token_ids and calls == [running]
    finally:
        del target.free


class _DyingWorker:
    """An in-process worker until its `lives`-th call: from then on every call raises WorkerLostError, as the proxy
    of a worker actor that died does."""

    inner, lives, name = None, 0, "worker"

    def _call(self, method, *args):
        from ddtree.workers import WorkerLostError

        self.lives -= 1
        if self.lives < 0:
            raise WorkerLostError(f"the {self.name} worker died")
        return getattr(self.inner, method)(*args)


class _DyingTarget(_DyingWorker):
    """The in-process target, until its `lives`-th call: from then on every call raises WorkerLostError, as the
    proxy of a target actor that died does."""

    def __init__(self, target, lives: int) -> None:
        self.inner, self.lives, self.name = target, lives, "target"
        for name in ("vocab_size", "eos_token_ids", "max_request_tokens", "max_model_len", "can_overlap"):
            setattr(self, name, getattr(target, name))

    def allocate(self, *args):
        return self._call("allocate", *args)

    def allocate_many(self, *args):
        return self._call("allocate_many", *args)

    def prefill(self, *args):
        return self._call("prefill", *args)

    def verify_async(self, *args):
        return self._call("verify_async", *args)

    def take_features(self, *args):
        return self._call("take_features", *args)

    def free(self, *args):
        return self._call("free", *args)


@pytest.fixture(scope="module")
def spare_workers(checkpoints):
    """A second pair of workers on the same checkpoints: what a restarted worker actor loads."""
    target, drafter = checkpoints
    return build_workers(str(target), str(drafter), dtype="float64")


@pytest.mark.parametrize("new_drafter", [False, True], ids=["same-drafter", "new-drafter"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("lives", [1, 8, 19])
def test_a_lost_target_costs_no_request_and_no_token(workers, spare_workers, pipeline, lives, new_drafter):
    """The target's worker dies (its calls raise WorkerLostError) while requests run, wait, and one is aborted:
    no round runs until a new target is attached, then every request is prefilled again from its prompt and
    committed tokens and finishes with off's tokens, greedy and seeded-sampled alike. Each request's stream of
    increments holds every final token once, in order."""
    target, drafter, tok = workers
    new_target, spare_drafter, _ = spare_workers
    params = [
        greedy(30),
        SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True),
        greedy(30),
        SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True),
        greedy(30),
    ]
    reference = make_llm(workers, speculation="off").generate(PROMPTS, params)
    dying = _DyingTarget(target, lives)
    engine = Engine(
        EngineConfig(speculation="ddtree", budget=4, max_num_seqs=3, pipeline=pipeline),
        dying,
        drafter,
        tok,
        cost=copy.deepcopy(FLAT_COST),
    )
    ids: list[str] = []
    try:
        ids += [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params[:4])]
        streamed: dict[str, list[int]] = {}
        finals = {}

        def take(outputs) -> None:
            for o in outputs:
                streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    finals[o.request_id] = o

        while engine.target_lost is None:
            take(engine.step())
        assert engine.num_target_losses == 1 and engine.has_unfinished_requests()
        assert engine.step() == [] and engine.step() == []  # nothing runs without a target
        ids.append(engine.add_request(PROMPTS[4], params[4]))  # (queued while there is none)
        aborted = engine.add_request("aborted while the target is lost", greedy(30))
        take([engine.abort_request(aborted)])
        engine.attach_target(new_target, spare_drafter if new_drafter else None)
        while engine.has_unfinished_requests():
            take(engine.step())
        assert [finals[i].token_ids for i in ids] == [r.token_ids for r in reference]
        assert all(streamed[i] == finals[i].token_ids for i in ids)
        assert finals[aborted].finish_reason == "abort"
        assert engine.target_lost is None and new_target.num_kv_bytes_used == 0
        assert engine.timings.num_speculative_request_rounds > 0
    finally:
        for rid in list(target._seq_ids):  # what the "dead" worker held
            target.free(rid)
        for worker in (drafter, spare_drafter):  # (a replaced drafter keeps the contexts it had)
            for rid in ids:
                worker.free(rid)


class _DyingDrafter(_DyingWorker):
    """The in-process drafter, until its `lives`-th call (`_DyingWorker`)."""

    def __init__(self, drafter, lives: int) -> None:
        self.inner, self.lives, self.name = drafter, lives, "drafter"
        self.block_len, self.can_overlap = drafter.block_len, drafter.can_overlap

    def draft_async(self, *args):
        return self._call("draft_async", *args)

    def free(self, request_id):
        return self._call("free", request_id)

    def measure_draft_cost(self, *args):
        return self.inner.measure_draft_cost(*args)


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("lives", [0, 3, 7])
def test_a_lost_drafter_costs_no_request_and_a_new_one_resumes_speculation(workers, pipeline, lives):
    """The drafter's worker dies (its calls raise WorkerLostError) while requests run: every request finishes with
    off's tokens, decoding on without drafts; once a new drafter is attached, requests admitted since then draft
    again, while those that ran at the loss (their context went with the drafter) never ask it for a draft."""
    target, drafter, tok = workers
    reference = make_llm(workers, speculation="off").generate(PROMPTS, greedy(30))
    dying = _DyingDrafter(drafter, lives)
    engine = Engine(
        EngineConfig(speculation="ddtree", budget=4, max_num_seqs=3, pipeline=pipeline),
        target,
        dying,
        tok,
        cost=copy.deepcopy(FLAT_COST),
    )
    ids = [engine.add_request(p, greedy(30)) for p in PROMPTS[:3]]
    finals = {}
    while engine.drafter_lost is None:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.num_drafter_losses == 1 and len(finals) < 3
    lost_with_it = set(engine.scheduler.running)
    ids += [engine.add_request(p, greedy(30)) for p in PROMPTS[3:]]  # (queued or prefilled while there is none)
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.attach_drafter(drafter)
    drafted: list[str] = []
    original = drafter.draft_async

    def recording(request_ids, *args):
        drafted.extend(request_ids)
        return original(request_ids, *args)

    drafter.draft_async = recording
    try:
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        del drafter.draft_async
    assert [finals[i].token_ids for i in ids] == [r.token_ids for r in reference]
    assert drafted and not lost_with_it & set(drafted)
    assert all(finals[i].stats.num_speculative_rounds > 0 for i in ids[3:] if i not in lost_with_it)
    assert engine.drafter_lost is None and not engine._without_draft_context


def test_requests_admitted_together_share_one_prefill_pass(workers):
    """Admission while nothing runs prefills every admitted request in one target pass; one joining later goes into
    the round's verify pass, or (max_folded_prompt_tokens=0) costs a prefill pass of its own (what
    benchmarks/bench_arrivals.py counts)."""
    for max_folded, num_prefills in ((512, 1), (0, 2)):
        engine = make_llm(workers, speculation="off", max_folded_prompt_tokens=max_folded).engine
        for prompt in PROMPTS[:3]:
            engine.add_request(prompt, greedy(6))
        engine.step()
        assert engine.timings.num_prefill_calls == 1
        engine.add_request(PROMPTS[3], greedy(6))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.timings.num_prefill_calls == num_prefills
        assert engine.timings.num_prompts_in_verify == 2 - num_prefills


def test_an_engine_that_leaves_the_text_to_its_consumer_gives_the_same_outputs(workers):
    """`detokenize=False`: outputs that need no text in the engine (no stop strings, no log-probabilities) come
    undecoded, and a `TextDecoder` per request gives the same texts, piece by piece, as the decoding engine;
    the others are decoded by the engine as before."""
    from ddtree.detokenizer import Detokenizer, TextDecoder

    target, drafter, tok = workers
    params = [
        greedy(20),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
        greedy(20, stop=["e"]),
        greedy(12, logprobs=2),
        greedy(3),
    ]

    def run(detokenize: bool):
        engine = Engine(EngineConfig(speculation="ddtree", budget=4), target, drafter, tok, detokenize=detokenize)
        index = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(zip(PROMPTS, params))}
        decoders = {rid: TextDecoder(Detokenizer(tok), params[i]) for rid, i in index.items() if not params[i].stop}
        pieces, finals, pending = [[] for _ in PROMPTS], [None] * len(PROMPTS), set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = index[out.request_id]
                if out.text_pending:
                    pending.add(i)
                    out = decoders[out.request_id].fill(out)
                assert not out.text_pending
                pieces[i].append((out.new_text, out.new_token_ids))
                if out.finished:
                    finals[i] = (out.text, out.token_ids, out.finish_reason, out.logprobs)
        return pieces, finals, pending

    decoded, undecoded = run(True), run(False)
    assert decoded[:2] == undecoded[:2] and all(final[0] for final in decoded[1])  # (texts to compare)
    assert decoded[2] == set() and undecoded[2] == {0, 1, 4}  # stop strings and log-probabilities: the engine's


def test_admission_takes_the_head_of_the_queue_up_to_the_free_seats_and_waits_where_kv_runs_out():
    from ddtree.scheduler import Scheduler

    scheduler = Scheduler(max_num_seqs=3, max_waiting=8)
    for rid in "abcde":
        scheduler.add(rid)
    asked = []
    assert scheduler.admit(lambda ids: asked.append(ids) or 2) == ["a", "b"]  # c did not fit: it and all after wait
    assert scheduler.admit(lambda ids: asked.append(ids) or 1) == ["c"]
    assert scheduler.admit(lambda ids: pytest.fail("no free seat: nothing to allocate")) == []
    assert asked == [["a", "b", "c"], ["c"]] and list(scheduler.waiting) == ["d", "e"]
    scheduler.remove("a")
    with pytest.raises(ValueError, match="answered 2 for 1"):
        scheduler.admit(lambda ids: 2)


def test_a_rounds_admissions_reserve_their_kv_in_one_target_call(workers, monkeypatch):
    """Requests admitted together cost one allocation call (a worker actor's round trip each, before), and those
    admitted into a running batch one more, in arrival order."""
    engine = make_llm(workers, speculation="off").engine
    calls = []
    allocate_many = engine.target.allocate_many
    monkeypatch.setattr(
        engine.target,
        "allocate_many",
        lambda requests: calls.append([r for r, _, _ in requests]) or allocate_many(requests),
    )
    first = [engine.add_request(p, greedy(6)) for p in PROMPTS[:3]]
    engine.step()
    later = [engine.add_request(p, greedy(6)) for p in PROMPTS[3:5]]
    while engine.has_unfinished_requests():
        engine.step()
    assert calls == [first, later]


def _staggered(engine, params: list[SamplingParams]) -> tuple[list[list[int]], list]:
    """Each of PROMPTS submitted two rounds after the one before; the outputs' token ids and log-probs, in order."""
    ids, finals, pending, steps = {}, {}, list(enumerate(PROMPTS)), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            i, p = pending.pop(0)
            ids[engine.add_request(p, params[i])] = i
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out
        steps += 1
    return [finals[i].token_ids for i in range(len(PROMPTS))], [finals[i].logprobs for i in range(len(PROMPTS))]


@pytest.mark.parametrize(
    "config",
    [{"speculation": "off"}, {"speculation": "ddtree", "budget": 8}, {"speculation": "ddtree", "ngram_tokens": 3}],
    ids=["off", "ddtree-8", "auto"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompts_taken_in_by_the_verify_pass_change_no_token(workers, config, temperature):
    """Requests joining while others run have their prompts verified with the round's trees: the same tokens and
    log-probs as a prefill pass of their own (greedy, and sampled with seeds), and no prefill pass but the first."""
    params = [
        SamplingParams(temperature=temperature, max_tokens=6 + 3 * i, ignore_eos=True, seed=i, logprobs=2)
        for i in range(len(PROMPTS))
    ]
    folded = make_llm(workers, max_num_seqs=3, **config).engine
    separate = make_llm(workers, max_num_seqs=3, max_folded_prompt_tokens=0, **config).engine
    tokens, logprobs = _staggered(folded, params)
    reference_tokens, reference_logprobs = _staggered(separate, params)
    assert tokens == reference_tokens
    for lps, ref in zip(logprobs, reference_logprobs):
        for lp, r in zip(lps, ref):
            assert (lp.token_id, [t for t, _, _ in lp.top]) == (r.token_id, [t for t, _, _ in r.top])
            assert math.isclose(lp.logprob, r.logprob, abs_tol=1e-9)
    assert folded.timings.num_prompts_in_verify >= 2 and separate.timings.num_prompts_in_verify == 0
    assert folded.timings.num_prefill_calls + folded.timings.num_prompts_in_verify == len(PROMPTS)
    assert separate.timings.num_prefill_calls == len(PROMPTS)


def test_prompts_past_the_fold_limit_get_a_prefill_pass_of_their_own(workers):
    """Admitted prompts longer in all than max_folded_prompt_tokens are prefilled in a pass of their own (the
    model's prefill chunks long prompts), and join the round's verify right after."""
    short, long = "a", "why is the sky blue?"
    engine = make_llm(workers, speculation="off", max_folded_prompt_tokens=len(engine_tokens(workers, short))).engine
    reference = make_llm(workers, speculation="off").generate([short, long], [greedy(6), greedy(6)])
    engine.add_request("hello world", greedy(20))
    engine.step()
    ids = [engine.add_request(short, greedy(6))]
    engine.step()
    assert (engine.timings.num_prefill_calls, engine.timings.num_prompts_in_verify) == (1, 1)
    ids.append(engine.add_request(long, greedy(6)))
    engine.step()
    assert (engine.timings.num_prefill_calls, engine.timings.num_prompts_in_verify) == (2, 1)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [finals[i] for i in ids] == [r.token_ids for r in reference]


def test_a_request_whose_first_token_finishes_it_leaves_from_the_verify_pass(workers):
    """A prompt taken in by a verify pass whose first token is its last (max_tokens=1) finishes in that step and
    frees its KV, as after a prefill pass of its own."""
    engine = make_llm(workers, speculation="ddtree", budget=4).engine
    reference = make_llm(workers, speculation="off").generate(["12 + 7 ="], greedy(1))[0]
    engine.add_request("hello world", greedy(12))
    engine.step()
    used = engine.target.num_kv_bytes_used
    rid = engine.add_request("12 + 7 =", greedy(1))
    finished = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in finished] == [(rid, reference.token_ids, "length")]
    assert engine.timings.num_prompts_in_verify == 1 and engine.target.num_kv_bytes_used == used
    while engine.has_unfinished_requests():
        engine.step()


def engine_tokens(workers, prompt: str) -> list[int]:
    return make_llm(workers, speculation="off").engine.validate(prompt, greedy(1))[0]


def test_a_verify_pass_with_prompts_equals_a_prefill_then_a_verify(workers):
    """The target worker's verify with prompts: the trees' answer, and each prompt's first token, log-probs, KV
    entries and features, as a prefill pass of their own gives them (float64)."""
    from ddtree.tree import DraftTree

    target, _, _ = workers
    running, prompt = [3, 7, 11, 5], [9, 4, 4, 12, 30, 2]
    tree = DraftTree(torch.tensor([8, 9, 8]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]), torch.zeros(3))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    results = {}
    for folded in (True, False):
        rid, new = f"running-{folded}", f"new-{folded}"
        for r in (rid, new):
            assert target.allocate(r, 64, params)
        target.prefill([rid], [running[:-1]])
        target.take_features([rid])
        if folded:
            result = target.verify([rid], [tree], [running[-1]], [new], [prompt])
            first = result.prefilled
        else:
            first = target.prefill([new], [prompt])
            result = target.verify([rid], [tree], [running[-1]])
        features = target.take_features([rid, new])
        kv = [target.model.kv.num_committed(target.seq_id(r)) for r in (rid, new)]
        results[folded] = (result, first, features, kv)
        for r in (rid, new):
            target.free(r)
    (result, first, features, kv), (ref, ref_first, ref_features, ref_kv) = results[True], results[False]
    assert result.prefilled is not None and ref.prefilled is None
    assert (result.accepted_token_ids, result.bonus_token_ids) == (ref.accepted_token_ids, ref.bonus_token_ids)
    assert result.num_tokens == ref.num_tokens + len(prompt)
    assert first.token_ids == ref_first.token_ids
    assert first.logprobs[0].top_ids == ref_first.logprobs[0].top_ids
    torch.testing.assert_close(torch.tensor(first.logprobs[0].chosen), torch.tensor(ref_first.logprobs[0].chosen))
    assert kv == ref_kv == [len(running) + len(result.accepted_token_ids[0]), len(prompt)]
    for f, r in zip(features, ref_features):
        torch.testing.assert_close(f, r)


def test_a_verify_pass_refuses_prompts_without_requests_or_ids(workers):
    target, _, _ = workers
    with pytest.raises(ValueError, match="one non-empty prompt per prompt id"):
        target.verify(["x"], [None], [1], ["y"], [])
    with pytest.raises(ValueError, match="one non-empty prompt per prompt id"):
        target.verify(["x"], [None], [1], ["y"], [[]])
    with pytest.raises(ValueError, match="at least one request to verify"):
        target.verify([], [], [], ["y"], [[1, 2]])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "512"])
def test_max_folded_prompt_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="max_folded_prompt_tokens"):
        EngineConfig(max_folded_prompt_tokens=bad)
