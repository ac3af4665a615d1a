"""The worker proxies (deployments/proxies.py) against scripted workers on real channels, without Ray: what a free
costs the round, when its reply is read, and where the KV cache's usage comes from."""

from __future__ import annotations

import threading
import time

import pytest

from ddtree.sampling_params import SamplingParams
from deployments.channel import ChannelServer
from deployments.proxies import MAX_UNAWAITED_FREES, DrafterProxy, HopTimes, TargetProxy
from deployments.worker_ops import WIRE, Allocate, Free, FreeDraft, MeasureDraftCost, Reply

BYTES_PER_TOKEN = 100


class ScriptedTarget:
    """Allocates and frees KV as a token count; a Free of `blocked` waits for `release`, one of `failing` raises."""

    def __init__(self) -> None:
        self.ops: list[object] = []
        self.capacity: dict[str, int] = {}
        self.release = threading.Event()
        self.blocked: str | None = None
        self.failing: str | None = None

    def handle(self, op):
        t0 = time.perf_counter()
        self.ops.append(op)
        result = None
        if isinstance(op, Allocate):
            self.capacity.update(zip(op.request_ids, op.capacities))
            result = len(op.request_ids)
        elif isinstance(op, Free):
            if op.request_id == self.blocked:
                assert self.release.wait(10)
            if op.request_id == self.failing:
                raise KeyError(op.request_id)
            self.capacity.pop(op.request_id)
        used = sum(self.capacity.values()) * BYTES_PER_TOKEN
        return Reply(result, time.perf_counter() - t0, 0, t0, used)


def _target_proxy(server: ChannelServer, hops: HopTimes) -> TargetProxy:
    info = {
        "channel": server.address,
        "max_model_len": 1024,
        "max_request_tokens": 1024,
        "eos_token_ids": [0],
        "vocab_size": 50,
        "tokenizer": None,
        "keeps_features": True,
        "pid": 0,
    }
    return TargetProxy(None, info, hops, can_overlap=False)


@pytest.fixture
def target():
    script = ScriptedTarget()
    server = ChannelServer("node", "target", handle=script.handle, codec=WIRE)
    hops = HopTimes()
    proxy = _target_proxy(server, hops)
    yield script, proxy, hops
    proxy.channel.close()
    server.close()


def test_a_free_is_sent_at_once_and_its_reply_read_after_the_next_calls(target):
    script, proxy, hops = target
    params = SamplingParams(max_tokens=8)
    assert proxy.allocate("a", 10, params) and proxy.allocate("b", 20, params)
    assert proxy.kv_cache_stats() == {"bytes_used": 30 * BYTES_PER_TOKEN}  # from the reply: no call of its own

    script.blocked = "a"
    calls_before = hops.num_calls
    t0 = time.perf_counter()
    proxy.free("a")  # the target is stuck in this free: the engine does not wait for it
    assert time.perf_counter() - t0 < 1.0 and not script.release.is_set()
    assert hops.num_calls == calls_before + 1 and hops.by_op["Free"][0] == 1  # its send is booked as its hop
    done = threading.Timer(0.2, script.release.set)
    done.start()
    assert proxy.allocate("c", 5, params)  # the target reads the free first, so the allocation sees its room
    done.join()
    assert [type(op).__name__ for op in script.ops] == ["Allocate", "Allocate", "Free", "Allocate"]
    assert proxy.kv_cache_stats() == {"bytes_used": 25 * BYTES_PER_TOKEN}  # the later reply's, not the free's
    assert not proxy._unawaited.calls


def test_a_failed_free_is_raised_by_the_next_call(target):
    script, proxy, _ = target
    params = SamplingParams(max_tokens=8)
    assert proxy.allocate("a", 10, params)
    script.failing = "a"
    proxy.free("a")
    with pytest.raises(KeyError, match="a"):
        proxy.allocate("b", 5, params)


class ScriptedDrafter:
    def __init__(self) -> None:
        self.freed: list[str] = []

    def handle(self, op):
        t0 = time.perf_counter()
        if isinstance(op, FreeDraft):
            self.freed.append(op.request_id)
        result = [(1, 0.001)] if isinstance(op, MeasureDraftCost) else None
        return Reply(result, time.perf_counter() - t0, started_at=t0)


def test_a_drafters_frees_are_read_by_its_next_call_or_once_enough_have_gathered(target):
    _, target_proxy, hops = target
    script = ScriptedDrafter()
    server = ChannelServer("node", "drafter", handle=script.handle, codec=WIRE)
    info = {"channel": server.address, "block_len": 8, "pid": 0}
    drafter = DrafterProxy(None, info, target_proxy, hops, can_overlap=False)
    try:
        names = [f"r{i}" for i in range(MAX_UNAWAITED_FREES + 8)]
        target_proxy.take_features(names)  # they drafted: the drafter holds a context for each
        for name in names[:3]:
            drafter.free(name)
        assert len(drafter._unawaited.calls) == 3
        assert drafter.measure_draft_cost([1], 4) == [(1, 0.001)]  # a later call reads their replies first
        assert not drafter._unawaited.calls and script.freed == names[:3]
        for name in names[3:]:  # no draft follows: the replies are read once the cap has gathered
            drafter.free(name)
            assert len(drafter._unawaited.calls) <= MAX_UNAWAITED_FREES
        drafter.free("never-drafted")  # no call at all
        drafter.measure_draft_cost([1], 4)
        assert script.freed == names
    finally:
        drafter.channel.close()
        server.close()


class _SlowWire:
    """The worker codec, with a reply that takes `send_s` to encode (in the worker) and `read_s` to decode (in the
    caller)."""

    def __init__(self, send_s: float, read_s: float) -> None:
        self.send_s, self.read_s = send_s, read_s

    def encode(self, message):
        if isinstance(message, Reply):
            time.sleep(self.send_s)
        return WIRE.encode(message)

    def decode(self, data):
        message = WIRE.decode(data)
        if isinstance(message, Reply):
            time.sleep(self.read_s)
        return message


def test_a_calls_way_back_splits_into_waiting_for_the_reply_and_reading_it():
    codec = _SlowWire(send_s=0.06, read_s=0.03)
    server = ChannelServer("node", "target", handle=ScriptedTarget().handle, codec=codec)
    hops = HopTimes()
    proxy = _target_proxy(server, hops)
    proxy.channel.codec = codec
    try:
        assert proxy.allocate("a", 10, SamplingParams(max_tokens=8))
    finally:
        proxy.channel.close()
        server.close()
    calls, there, back, wait = hops.by_op["Allocate"]
    assert calls == 1 and there < 0.03
    assert 0.06 <= wait < 0.09  # the worker's encoding and sending, and the wake-up here
    assert 0.03 <= back - wait < 0.06  # reading and decoding here
    assert hops.seconds == pytest.approx(there + back)
