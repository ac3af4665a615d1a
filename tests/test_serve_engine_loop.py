"""The engine loop of a replica, without Ray: a real Engine stepped in its own thread, requests from asyncio."""

from __future__ import annotations

import asyncio

import pytest

from ddtree import LLM, SamplingParams
from ddtree.cost import CostModel
from ddtree.engine import Engine, EngineConfig, PromptTooLongError
from ddtree.loaders import build_workers
from ddtree.scheduler import EngineFullError
from deployments.engine_loop import EngineDeadError, EngineLoop
from tests.factories import make_tiny_drafter, make_tiny_target

PROMPTS = ["hello world", "the cat sat on", "a", "12 + 7 ="]
FLAT_COST = CostModel([(1, 0.010), (64, 0.012), (1024, 0.05)], [(1, 0.002), (16, 0.003)])


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop_tiny")
    target = make_tiny_target(root / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(root / "drafter", target)
    return build_workers(str(target), str(drafter), dtype="float64")


def make_engine(workers, detokenize: bool = True, **config) -> Engine:
    target, drafter, tokenizer = workers
    config = EngineConfig(**{"max_num_seqs": 2, "budget": 8, **config})
    return Engine(config, target, drafter, tokenizer, cost=FLAT_COST, detokenize=detokenize)


def run_loop(engine: Engine, body, **loop_kw):
    """Run `body(loop)` in asyncio with the loop thread started around it."""
    loop = EngineLoop(engine, **loop_kw)
    loop.start()
    try:
        return asyncio.run(body(loop))
    finally:
        loop.stop()


def test_concurrent_requests_equal_offline_answers(workers):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = LLM.from_engine(make_engine(workers)).generate(PROMPTS, params)
    rounds = []

    async def body(loop):
        return await asyncio.gather(*(loop.generate(p, params) for p in PROMPTS))

    # 4 requests over 2 seats: two wait, join when the first ones leave.
    finals = run_loop(make_engine(workers), body, on_round=rounds.append)
    assert [f.token_ids for f in finals] == [e.token_ids for e in expected]
    assert [f.text for f in finals] == [e.text for e in expected]
    assert max(r.num_waiting for r in rounds) >= 1 and rounds[-1].num_running == 0


def test_stream_is_incremental_and_complete(workers):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def body(loop):
        return [out async for out in loop.stream("hello world", params)]

    outputs = run_loop(make_engine(workers), body)
    assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    assert "".join(o.new_text for o in outputs) == outputs[-1].text


def test_streams_decode_the_text_an_engine_leaves_undecoded(workers):
    """A served engine leaves texts without stop strings undecoded (`detokenize=False`): each stream decodes its own,
    merged rounds included, and gets the decoding engine's pieces and text. Without a detokenizer the stream fails
    rather than answer empty texts."""
    from ddtree.detokenizer import Detokenizer

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokenizer = workers[2]

    async def body(loop):
        every = [out async for out in loop.stream("hello world", params)]
        merged = [out async for out in loop.stream("the cat sat on", params, interval_s=10.0)]
        return every, merged

    decoded = run_loop(make_engine(workers), body)
    undecoded_engine = make_engine(workers, detokenize=False)
    undecoded = run_loop(undecoded_engine, body, detokenizer=Detokenizer(tokenizer))
    pieces = [[(o.new_text, o.new_token_ids, o.text if o.finished else None) for o in outs] for outs in decoded]
    assert pieces == [
        [(o.new_text, o.new_token_ids, o.text if o.finished else None) for o in outs] for outs in undecoded
    ]
    assert decoded[0][-1].text and not any(o.text_pending for outs in undecoded for o in outs)

    async def without_detokenizer(loop):
        return [out async for out in loop.stream("hello world", params)]

    with pytest.raises(RuntimeError, match="no detokenizer"):
        run_loop(undecoded_engine, without_detokenizer)


def test_a_stream_interval_merges_rounds_but_never_holds_the_first_or_last(workers):
    """interval_s: outputs come at most that often, the rounds in between merged into one (text, tokens and
    log-probabilities in order); the first comes at once, the last (finished) at once too."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)

    async def body(loop):
        every = [out async for out in loop.stream("hello world", params)]
        t0 = asyncio.get_running_loop().time()
        merged = []
        async for out in loop.stream("hello world", params, interval_s=10.0):
            merged.append((out, asyncio.get_running_loop().time() - t0))
        return every, merged

    every, merged = run_loop(make_engine(workers), body)
    final = every[-1]
    assert len(every) > 3 and len(merged) == 2  # the first round's output, then everything else with the last
    (first, _), (last, waited) = merged
    assert first.new_token_ids == every[0].new_token_ids and last.finished and waited < 10.0
    assert first.new_token_ids + last.new_token_ids == final.token_ids
    assert first.new_text + last.new_text == final.text
    assert [lp.token_id for lp in first.new_logprobs + last.new_logprobs] == final.token_ids


def test_a_bound_on_chunks_per_second_lengthens_every_streams_interval(workers):
    """max_chunks_per_s: the open streams together get at most about that many outputs per second, so each waits
    their number over it (never less than interval_s); merged as an interval merges them."""
    unbounded, loop = EngineLoop(make_engine(workers)), EngineLoop(make_engine(workers), max_chunks_per_s=40.0)
    for each in (unbounded, loop):
        each._streams.update({f"r{i}": None for i in range(16)})  # (the open streams are all the bound reads)
    assert unbounded.stream_interval(0.1) == 0.1
    assert loop.stream_interval(0.1) == pytest.approx(0.4)
    assert loop.stream_interval(0.5) == 0.5
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def body(loop):
        every = [out async for out in loop.stream("hello world", params)]
        loop.max_chunks_per_s = 0.1  # one stream: 10 s
        bounded = [out async for out in loop.stream("hello world", params)]
        return every, bounded

    every, bounded = run_loop(make_engine(workers), body)
    assert len(every) > 3 and len(bounded) == 2  # the first round's output, then the rest with the last
    assert bounded[0].new_token_ids + bounded[1].new_token_ids == every[-1].token_ids
    assert bounded[0].new_text + bounded[1].new_text == every[-1].text


def test_admission_errors_reach_the_caller(workers):
    engine = make_engine(workers, max_num_seqs=1, max_waiting=1)
    long_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def body(loop):
        with pytest.raises(PromptTooLongError):
            await loop.generate("a" * 600, long_params)
        with pytest.raises(ValueError):
            await loop.generate([10**6], long_params)
        running = loop.stream("the cat", long_params)
        await running.__anext__()  # admitted and decoding
        waiting = asyncio.ensure_future(loop.generate("hello", long_params))
        while engine.num_waiting == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineFullError):
            await loop.generate("one too many", long_params)
        await running.aclose()  # leaving early aborts: the waiting request gets the seat
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # both aborts reach the loop thread; then nothing is left in the engine
        return await loop.call(lambda e: (e.num_running, e.num_waiting, len(e.requests)))

    assert run_loop(engine, body) == (0, 0, 0)


def test_stopping_the_loop_fails_pending_requests(workers):
    engine = make_engine(workers)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def body(loop):
        stream = loop.stream("the cat", params)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        with pytest.raises(RuntimeError, match="stopped"):
            async for _ in stream:
                pass
        assert not loop.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            await loop.generate("hello", params)

    run_loop(engine, body)


def test_a_failed_round_is_an_engine_failure_for_every_request_not_a_client_error(workers):
    engine = make_engine(workers)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    real_step, calls = engine.step, []

    def failing_step():
        if engine.num_running == 2:  # both admitted (and their first tokens sent) in an earlier round
            calls.append(1)
        if len(calls) == 2:  # an internal ValueError in the middle of a round (packing, KV, a bad value)
            raise ValueError("an internal check failed")
        return real_step()

    engine.step = failing_step

    async def body(loop):
        streams = [loop.stream(p, params) for p in PROMPTS[:2]]
        for stream in streams:  # both admitted before the round fails
            await stream.__anext__()
        errors = []
        for stream in streams:
            with pytest.raises(EngineDeadError, match="internal check failed") as info:
                async for _ in stream:
                    pass
            errors.append(info.value)
        assert not loop.is_alive and isinstance(loop.error, ValueError)
        return errors

    errors = run_loop(engine, body)
    assert all(not isinstance(e, ValueError) and isinstance(e.__cause__, ValueError) for e in errors)


def test_metrics_forget_aborted_requests(workers):
    from deployments.metrics import EngineMetrics
    from deployments.proxies import HopTimes

    engine = make_engine(workers)
    metrics = EngineMetrics(engine, HopTimes())
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def body(loop):
        for _ in range(3):  # each request leaves early: its final (abort) output never reaches on_round
            stream = loop.stream("the cat", params)
            for _ in range(3):
                await stream.__anext__()
            await stream.aclose()
        await loop.generate("hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        return await loop.call(lambda e: len(e.requests))

    assert run_loop(engine, body, on_round=metrics.on_round) == 0
    assert metrics._rounds_seen == {}


def test_metrics_take_rounds_without_ray_calls_and_flush_their_totals(workers):
    from deployments.metrics import STAGES, EngineMetrics
    from deployments.proxies import HopTimes

    engine = make_engine(workers)
    timings0 = engine.timings.as_dict()
    metrics = EngineMetrics(engine, HopTimes(), flush_every_s=3600.0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def body(loop):
        return await asyncio.gather(*(loop.generate(p, params) for p in PROMPTS))

    finals = run_loop(engine, body, on_round=metrics.on_round)
    timings = engine.timings.as_dict()
    pending = metrics.pending
    # every round was taken, none recorded yet: the totals wait for the flush
    assert metrics.num_flushes == 0
    assert pending.num_rounds == len(pending.round_seconds) == timings["num_rounds"] - timings0["num_rounds"]
    assert pending.tokens == metrics.num_generated_tokens == sum(len(f.token_ids) for f in finals)
    assert len(pending.taus) == len(pending.budgets) == sum(len(f.stats.acceptance_lengths) for f in finals) > 0
    for stage in STAGES:
        assert pending.stage_seconds[stage] == pytest.approx(timings[stage] - timings0[stage])
    metrics.flush()
    assert metrics.num_flushes == 1 and metrics.pending.num_rounds == 0 and metrics.pending.tokens == 0
    assert metrics.num_generated_tokens == sum(len(f.token_ids) for f in finals)  # (a running total: not flushed)
    metrics.flush()  # (nothing pending: no Ray call)
    assert metrics.num_flushes == 1

    every_round = EngineMetrics(engine, HopTimes(), flush_every_s=0.0)
    run_loop(engine, body, on_round=every_round.on_round)
    assert every_round.num_flushes == engine.timings.num_rounds - timings["num_rounds"] > 0


@pytest.mark.parametrize("hang_in", ["step", "on_round"])
def test_a_hung_worker_call_is_timed_for_the_health_check(workers, hang_in):
    """A worker that hangs neither returns nor raises: the watchdog times the loop thread's whole pass, in the step
    or around it (a metrics callback's KV-stats call, an abort), and reads 0 again once the thread waits for work."""
    import threading

    engine = make_engine(workers)
    hanging, release = threading.Event(), threading.Event()

    def hang():
        hanging.set()
        release.wait(10)

    real_step = engine.step
    if hang_in == "step":
        engine.step = lambda: (hang(), real_step())[1]

    async def body(loop):
        assert loop.seconds_in_round == 0.0
        pending = asyncio.ensure_future(loop.generate("hi", SamplingParams(temperature=0.0, max_tokens=2)))
        await asyncio.get_running_loop().run_in_executor(None, hanging.wait, 10)
        await asyncio.sleep(0.3)
        hung_for = loop.seconds_in_round
        release.set()
        await pending
        for _ in range(200):  # back to waiting for work (the thread may still be finishing that pass)
            if loop.seconds_in_round == 0.0:
                break
            await asyncio.sleep(0.01)
        return hung_for, loop.seconds_in_round

    on_round = (lambda report: hang()) if hang_in == "on_round" else None
    hung_for, after = run_loop(engine, body, on_round=on_round)
    assert hung_for >= 0.3 and after == 0.0


def test_a_worker_call_that_fails_outside_a_round_fails_every_request(workers):
    """An abort's worker call (a client left; its worker died) that raises ends the loop like a failed round: the
    other requests in flight fail at once instead of waiting on a dead thread, and the loop reports the error."""
    engine = make_engine(workers)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def dead_worker(request_id):
        raise RuntimeError("the target actor died")

    async def body(loop):
        leaving, staying = loop.stream("the cat", params), loop.stream("hello", params)
        await leaving.__anext__()
        await staying.__anext__()
        engine.abort_request = dead_worker
        await leaving.aclose()  # its abort's worker call raises in the loop thread

        async def drain():
            async for _ in staying:
                pass

        with pytest.raises(EngineDeadError, match="actor died"):
            await asyncio.wait_for(drain(), 60)  # (it waited forever on the dead thread)
        return loop.is_alive, loop.error

    alive, error = run_loop(engine, body)
    assert not alive and isinstance(error, RuntimeError)


def test_a_late_abort_leaves_a_newer_request_with_the_same_id_alone(workers):
    """A caller cancelled after its request finished in the engine (its final output unread) sends an abort; a
    retry reusing the id, admitted meanwhile, must not be the one aborted (its caller would wait forever)."""
    engine = make_engine(workers)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def body(loop):
        first = loop.stream("the cat", short, "job-1")
        await first.__anext__()
        while await loop.call(lambda e: "job-1" in e.requests):  # finished in the engine, not yet read
            await asyncio.sleep(0.01)
        retry = loop.stream("hello", long, "job-1")
        outputs = [await retry.__anext__()]
        await first.aclose()  # the late abort

        async def drain():
            return [o async for o in retry]

        return outputs + await asyncio.wait_for(drain(), 60)  # (it waited forever once its request was aborted)

    outputs = run_loop(engine, body)
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 40


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(workers):
    """Outputs for a caller whose asyncio loop is gone (a replica shutting down) cannot be delivered: its request is
    aborted and the loop thread goes on serving the others (scheduling on a closed loop raises RuntimeError, which
    used to end the thread silently)."""
    from deployments.engine_loop import _Add

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = make_engine(workers)

    async def body(loop):
        gone = asyncio.new_event_loop()
        admitted = gone.create_future()
        gone.close()
        loop._put(_Add("hello world", params, "orphan", gone, admitted, asyncio.Queue()))
        final = await asyncio.wait_for(loop.generate("the cat sat on", params), 60)  # (hung when the thread died)
        return final, loop.is_alive

    final, alive = run_loop(engine, body)
    assert alive and final.finished and len(final.token_ids) == 8
    assert "orphan" not in engine.requests and not engine.has_unfinished_requests()


def test_abandoning_a_hung_round_fails_its_requests_at_once(workers):
    """The health check gives up on an engine whose worker hangs: the requests in flight and waiting fail now (a
    graceful stop of the replica would otherwise wait for them), new ones are refused, and when the round returns
    after all nothing is delivered and the thread ends."""
    import threading
    import time

    engine = make_engine(workers)
    real_step, in_step, release = engine.step, threading.Event(), threading.Event()

    def hanging_step():
        if engine.num_running:  # admitted and its first token sent: now the worker hangs
            in_step.set()
            release.wait(20)
        return real_step()

    engine.step = hanging_step
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def body(loop):
        stream = loop.stream("the cat", params)
        await stream.__anext__()
        waiting = asyncio.ensure_future(loop.generate("hello", params))  # in the inbox behind the hung round
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        started = time.monotonic()
        loop.abandon(EngineDeadError("a worker is hung"))
        with pytest.raises(EngineDeadError, match="hung"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="hung"):
            await waiting
        failed_within = time.monotonic() - started
        assert not loop.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            await loop.generate("again", params)
        release.set()
        await asyncio.get_running_loop().run_in_executor(None, loop._thread.join, 10)
        return failed_within, loop._thread.is_alive()

    failed_within, thread_alive = run_loop(engine, body)
    assert failed_within < 2.0 and not thread_alive


def test_an_idle_loop_calls_on_idle_and_the_metrics_go_to_zero(workers):
    import time

    from deployments.metrics import EngineMetrics
    from deployments.proxies import HopTimes

    engine = make_engine(workers)
    metrics = EngineMetrics(engine, HopTimes(), window_s=0.2)
    idle_calls = []

    def on_idle():
        idle_calls.append(1)
        metrics.on_idle()

    async def body(loop):
        await loop.generate("hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert metrics._tokens_per_second(time.monotonic(), 0) > 0  # the tokens just emitted
        await asyncio.sleep(0.5)

    run_loop(engine, body, on_round=metrics.on_round, on_idle=on_idle, idle_every_s=0.05)

    def hung_worker():
        raise AssertionError("on_idle must not call the worker (a hung one would block the idle loop)")

    EngineMetrics(engine, HopTimes(), kv_cache_stats=hung_worker).on_idle()
    assert len(idle_calls) >= 3
    assert metrics._tokens_per_second(time.monotonic(), 0) == 0.0  # the window has passed


def test_the_loop_thread_runs_at_the_nice_value_it_is_given(workers):
    """The loop thread takes the app's `round_nice` (the worker actors' compute threads take the same); the thread
    that started it keeps its own."""
    import os
    import threading

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base + 2 > 19:
        pytest.skip(f"this process already runs at nice {base}")

    def thread_nice(thread: threading.Thread) -> int:
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice

    async def body(loop):
        await loop.generate("hello world", SamplingParams(temperature=0.0, max_tokens=2))
        return thread_nice(loop._thread)

    assert run_loop(make_engine(workers), body, nice=base + 2) == base + 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
