"""The target and drafter workers on their own Ray actors, and the thin proxies the Engine calls.

The engine replica reaches each worker actor through a channel (deployments/channel.py: a Unix socket, blocking
reads, no Ray task per call), and the target reaches the drafter through one more:

    engine replica ──TargetOp──> TargetActor     ──FeatureBatch (one-way)──> DrafterActor
                   <──Reply──                                                    │
                   ──DrafterOp──────────────────────────────────────────────> ───┘
                   <──Reply──

Operations are typed (`Allocate`, `Prefill`, `Verify`, `Free`, `SendFeatures`, `DisconnectDrafter`, `MeasureVerifyCost`;
`Draft`, `FreeDraft`, `MeasureDraftCost`). A round costs two calls (draft, verify), each a few process wake-ups; plain
Ray actor calls remain for what is not on the round's path: loading, the health check's ping, the KV usage metric.

Target features go from the target to the drafter directly, never through the engine replica: after a prefill
(every prefilled request's) and a verify (the requests that drafted: they draft again next) the target pushes them
as a numbered `FeatureBatch`, and its reply names the number. A request decoding without a draft (fallback) leaves
its features in the target actor (the KV cache's budget counts them per token); when it drafts again, one
`SendFeatures` call pushes them. Each `Draft` and `FreeDraft` names the last batch pushed before it; the drafter
extends its context caches with every batch up to that one first (a thread of its own receives the batches, so
the target never waits for the drafter). Two calls in flight overlap (`pipeline`): a draft on the drafter while
the target verifies the other group.

Each operation reports the seconds spent inside the worker; the proxies keep the difference from the call's wall
time: the cost of the hops themselves (`HopTimes`, reported as a metric and by benchmarks/bench_serving.py).

What crosses between processes is numpy arrays and lists, never torch tensors (`trees_to_wire`, `tensor_to_wire`):
numpy arrays pickle as single buffers, torch tensors through torch's own reducer (~0.3 ms apiece here).

A drafter actor that dies closes its channels: the drafter proxy's call raises ChannelClosedError (a
WorkerLostError, which the engine survives), after telling the target to keep every feature from then on
(`DisconnectDrafter`). A new drafter actor (`WorkerActors.start_drafter`) is connected to the same target, whose
feature batches keep their numbering: the new drafter's inbox starts at the current number.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from deployments.channel import ChannelAddress, ChannelClient, ChannelClosedError, ChannelServer
from deployments.config import ActorPlace, WorkerSpec

# OpenMP threads spin after each parallel region by default (libgomp). The target and the drafter take turns on the
# same cores, so a spinning pool in one actor would steal the cores from the other (docs/serving.md gives the
# cost). Passive waiting must be set before torch loads OpenMP, so it goes in
# the actor's environment.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


_thread_state = threading.local()


def _set_torch_threads(spec: WorkerSpec) -> None:
    """torch's CPU threads for the calling OS thread (OpenMP keeps the count per thread, and the compiled graph
    runs the steps on a thread of its own): the spec's count, at most the cores this process may use."""
    if spec.device.startswith("cpu") and getattr(_thread_state, "threads", None) is None:
        _thread_state.threads = min(spec.torch_threads, len(os.sched_getaffinity(0)))
        torch.set_num_threads(_thread_state.threads)


def worker_env(spec: WorkerSpec) -> dict[str, str]:
    """A worker actor's environment: passive OpenMP waits, and OpenMP's thread count set to the spec's (Ray would
    set it to the actor's whole CPUs, 1 for a fraction), so that every library starts with the same count."""
    return {**OPENMP_ENV, "OMP_NUM_THREADS": str(spec.torch_threads)}


def tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A tensor as (numpy array on the host, dtype name); bfloat16, which numpy lacks, travels as its bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def tensor_from_wire(wire: tuple[np.ndarray, str]) -> torch.Tensor:
    array, dtype = wire
    t = torch.from_numpy(np.array(array))  # a writable copy: Ray hands out read-only views of its object store
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def trees_to_wire(trees: list) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A verify call's trees (DraftTree, or None for a root-only segment) as node counts (-1: None) and two arrays:
    [3, N] int64 token ids, parents, depths and [N] float32 path log-probs of all nodes, request after request."""
    from ddtree.tree import DraftTree

    counts = [-1 if t is None else t.num_nodes for t in trees]
    present = [t for t in trees if t is not None and t.num_nodes] or [DraftTree.empty()]
    ints = torch.stack([torch.cat([getattr(t, f).cpu() for t in present]) for f in ("token_ids", "parents", "depths")])
    values = torch.cat([t.path_logprobs.cpu().float() for t in present])
    return counts, ints.numpy(), values.numpy()


def trees_from_wire(wire: tuple[list[int], np.ndarray, np.ndarray]) -> list:
    from ddtree.tree import DraftTree

    counts, ints, values = wire
    ints, values = torch.from_numpy(np.array(ints)), torch.from_numpy(np.array(values))
    trees, start = [], 0
    for n in counts:
        if n < 0:
            trees.append(None)
            continue
        rows = slice(start, start + n)
        trees.append(DraftTree(ints[0, rows], ints[1, rows], ints[2, rows], values[rows]))
        start += n
    return trees


# ---- the operations ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allocate:
    request_id: str
    capacity: int
    params: object  # SamplingParams


@dataclass(frozen=True)
class Prefill:
    request_ids: list[str]
    prompts: list[list[int]]


@dataclass(frozen=True)
class Verify:
    request_ids: list[str]
    trees: tuple  # trees_to_wire
    roots: list[int]
    feature_request_ids: list[str]  # those that drafted: their new features go on to the drafter


@dataclass(frozen=True)
class Free:
    request_id: str


@dataclass(frozen=True)
class SendFeatures:
    """Push the features waiting in the target for these requests (back from fallback) to the drafter."""

    request_ids: list[str]


@dataclass(frozen=True)
class DisconnectDrafter:
    """The drafter is gone: keep every request's features here from now on (until a new drafter connects), since
    none that is sent could be taken in. Ordered on the channel before the calls after it (a prefill's features)."""


@dataclass(frozen=True)
class MeasureVerifyCost:
    token_counts: list[int]


@dataclass(frozen=True)
class Draft:
    request_ids: list[str]
    roots: list[int]
    max_k: int
    after_batch: int  # the drafter first takes in every FeatureBatch up to this number


@dataclass(frozen=True)
class FreeDraft:
    request_id: str
    after_batch: int


@dataclass(frozen=True)
class MeasureDraftCost:
    batch_sizes: list[int]
    max_k: int


TargetOp = Allocate | Prefill | Verify | Free | SendFeatures | DisconnectDrafter | MeasureVerifyCost
DrafterOp = Draft | FreeDraft | MeasureDraftCost


@dataclass
class FeatureBatch:
    """Target features on their way to the drafter: rows of `request_ids[i]` are the next `counts[i]` rows."""

    number: int  # 1, 2, ... in the order the target sends them
    request_ids: list[str]
    counts: list[int]
    wire: tuple  # tensor_to_wire of [sum(counts), F]


@dataclass
class Reply:
    result: object
    seconds: float  # inside the worker
    feature_batch: int = 0  # (target) the last FeatureBatch sent so far
    started_at: float = 0.0  # time.perf_counter() in the worker when the operation began (one clock per node)


# ---- the actors -------------------------------------------------------------------------------------------------


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class TargetActor:
    """Owns the target model and its KV cache."""

    def __init__(self, spec: WorkerSpec, need_drafter: bool) -> None:
        from ddtree.loaders import load_target_worker, resolve_drafter_path

        _set_torch_threads(spec)
        drafter_path = resolve_drafter_path(spec.model, spec.drafter) if need_drafter else None
        self.worker = load_target_worker(
            spec.model,
            drafter_path,
            device=spec.device,
            dtype=spec.dtype,
            kv_cache_bytes=spec.kv_cache_bytes,
            attention=spec.attention,
        )
        self.tokenizer = self.worker.model.tokenizer
        self._spec = spec
        self._to_drafter = None  # ChannelClient to the drafter's feature channel (None: no drafter connected)
        self._drafter_lock = threading.Lock()  # (connect_drafter runs on the actor's thread, `handle` on the channel's)
        self._num_batches = 0
        self.channel = ChannelServer(_node_id(), "target", handle=self.handle)

    def ping(self) -> bool:
        """Answers when the actor is alive (the engine replica's health check)."""
        return True

    def describe(self) -> dict:
        """What the engine reads from the worker once, the tokenizer it detokenizes with, and the channel."""
        w = self.worker
        return {
            "max_model_len": w.max_model_len,
            "max_request_tokens": w.max_request_tokens,
            "eos_token_ids": list(w.eos_token_ids),
            "keeps_features": w.keep_features,
            "vocab_size": w.vocab_size,
            "tokenizer": self.tokenizer,
            "channel": self.channel.address,
            "pid": os.getpid(),
        }

    def head(self):
        """The target's embedding and LM head (ddtree.models.target.TargetHead) for the drafter actor, on the CPU:
        a CUDA tensor would be unpickled onto the receiver's GPU of the same index, whatever GPU Ray gave it (the
        drafter moves it to its own device)."""
        return self.worker.model.head().to("cpu")

    def connect_drafter(self, address: ChannelAddress) -> None:
        """Send features to this drafter from now on (a first one, or one restarted after a loss). Its inbox first
        gets an empty batch carrying the current number: the Drafts it will be sent name the batches numbered since
        this actor began."""
        client = ChannelClient(address, "drafter worker (features)")
        with self._drafter_lock:
            client.send(FeatureBatch(self._num_batches, [], [], tensor_to_wire(torch.zeros(0))))
            self._disconnect_drafter()
            self._to_drafter = client

    def _disconnect_drafter(self) -> None:
        if self._to_drafter is not None:
            self._to_drafter.close()
            self._to_drafter = None

    def handle(self, op: TargetOp) -> Reply:
        """One operation from the engine replica (on the channel's thread)."""
        _set_torch_threads(self._spec)
        w = self.worker
        t0 = time.perf_counter()
        result, feature_ids = None, []
        if isinstance(op, Allocate):
            result = w.allocate(op.request_id, op.capacity, op.params)
        elif isinstance(op, Prefill):
            result, feature_ids = w.prefill(op.request_ids, op.prompts), op.request_ids
        elif isinstance(op, Verify):
            result = w.verify(op.request_ids, trees_from_wire(op.trees), op.roots)
            feature_ids = op.feature_request_ids
        elif isinstance(op, Free):
            w.free(op.request_id)
        elif isinstance(op, SendFeatures):
            feature_ids = [r for r in op.request_ids if w.num_new_features(r)]
        elif isinstance(op, DisconnectDrafter):
            with self._drafter_lock:
                self._disconnect_drafter()
        elif isinstance(op, MeasureVerifyCost):
            result = w.measure_verify_cost(op.token_counts)
        else:
            raise TypeError(f"not a target operation: {op!r}")
        if w.keep_features and feature_ids:
            with self._drafter_lock:
                if self._to_drafter is not None:
                    self._send_features(feature_ids)
        return Reply(result, time.perf_counter() - t0, self._num_batches, t0)

    def _send_features(self, request_ids: list[str]) -> None:
        taken = self.worker.take_features(request_ids)
        self._num_batches += 1
        batch = FeatureBatch(
            self._num_batches, list(request_ids), [f.shape[0] for f in taken], tensor_to_wire(torch.cat(taken))
        )
        try:
            self._to_drafter.send(batch)
        except ChannelClosedError:  # the drafter died: the engine finds out on its next call, or the health check
            self._disconnect_drafter()

    def kv_cache_stats(self) -> dict:
        return {"bytes_used": self.worker.num_kv_bytes_used}

    def num_new_features(self, request_id: str) -> int:
        """Feature rows waiting here for `request_id` (not sent to the drafter yet)."""
        return self.worker.num_new_features(request_id)


class _FeatureInbox:
    """Feature batches received from the target, in order, until the drafter takes them in."""

    def __init__(self) -> None:
        self._batches: collections.deque[FeatureBatch] = collections.deque()
        self._num_received = 0
        self._is_closed = False
        self._cond = threading.Condition()

    def put(self, batch: FeatureBatch) -> None:
        with self._cond:
            self._batches.append(batch)
            self._num_received = batch.number
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    def take_until(self, number: int) -> list[FeatureBatch]:
        """Every batch up to `number`, waiting for the ones still on their way."""
        with self._cond:
            while self._num_received < number:
                if self._is_closed:
                    raise ChannelClosedError(f"the target's feature channel closed before batch {number} came")
                self._cond.wait()
            taken = []
            while self._batches and self._batches[0].number <= number:
                taken.append(self._batches.popleft())
            return taken


class DrafterActor:
    """Owns the DFlash drafter and its per-request context caches."""

    def __init__(self, spec: WorkerSpec, head) -> None:
        from ddtree.loaders import load_drafter_worker, resolve_drafter_path

        _set_torch_threads(spec)
        path = resolve_drafter_path(spec.model, spec.drafter)
        self.worker = load_drafter_worker(path, head, device=spec.device, dtype=spec.dtype)
        self._spec = spec
        self._inbox = _FeatureInbox()
        self.channel = ChannelServer(_node_id(), "drafter", handle=self.handle)
        self.features = ChannelServer(_node_id(), "features", on_message=self._inbox.put, on_close=self._inbox.close)

    def ping(self) -> bool:
        return True

    def describe(self) -> dict:
        return {
            "block_len": self.worker.block_len,
            "channel": self.channel.address,
            "features": self.features.address,
            "pid": os.getpid(),
        }

    def handle(self, op: DrafterOp) -> Reply:
        """One operation from the engine replica. The draft leaves as numpy on the host: the engine replica that
        builds the trees holds no GPU (unpickling a CUDA tensor there would open a context on a GPU Ray never gave
        it)."""
        _set_torch_threads(self._spec)
        w = self.worker
        t0 = time.perf_counter()
        result = None
        if isinstance(op, (Draft, FreeDraft)):
            for batch in self._inbox.take_until(op.after_batch):
                if batch.request_ids:  # (connect_drafter's first batch is empty)
                    rows = tensor_from_wire(batch.wire)
                    w.add_contexts(batch.request_ids, list(rows.split(batch.counts)))
        if isinstance(op, Draft):
            logprobs, token_ids = w.draft(op.request_ids, op.roots, None, op.max_k)
            result = tensor_to_wire(logprobs), tensor_to_wire(token_ids)
        elif isinstance(op, FreeDraft):
            w.free(op.request_id)
        elif isinstance(op, MeasureDraftCost):
            result = w.measure_draft_cost(op.batch_sizes, op.max_k)
        else:
            raise TypeError(f"not a drafter operation: {op!r}")
        return Reply(result, time.perf_counter() - t0, started_at=t0)

    def num_contexts(self) -> int:
        """Requests with a context cache in the drafter (0 once every request has left)."""
        return self.worker.drafter.num_contexts

    def context_len(self, request_id: str) -> int:
        """Tokens in the drafter's context cache for `request_id` (0: none)."""
        return self.worker.drafter.context_len(request_id)


# ---- the proxies --------------------------------------------------------------------------------------------------


@dataclass
class HopTimes:
    """Seconds the proxies spent in worker calls beyond what the workers spent working (summed), split into the
    way there (submission until the worker began) and back (the worker's end until the result was read)."""

    seconds: float = 0.0
    num_calls: int = 0
    there_seconds: float = 0.0
    # per operation (Verify, Draft, ...): [calls, seconds there, seconds back] (fixed size: one entry per op type)
    by_op: dict[str, list] = field(default_factory=dict)

    def add(self, wall_seconds: float, inside_seconds: float, there_seconds: float = 0.0, op: str = "") -> None:
        hop, there = max(0.0, wall_seconds - inside_seconds), max(0.0, there_seconds)
        self.seconds += hop
        self.there_seconds += there
        self.num_calls += 1
        entry = self.by_op.setdefault(op, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += there
        entry[2] += max(0.0, hop - there)


class PendingCall:
    """A worker call in flight (the engine's draft and verify are submitted so that they can overlap); `.result()`
    waits for it. The hop time booked is the wall time from submission to result minus the time inside the
    worker, so it is an upper bound when the caller reads the result late."""

    def __init__(self, channel: ChannelClient, hops: HopTimes, op, convert=None, on_reply=None) -> None:
        self.hops = hops
        self.convert = convert  # applied to the worker's result (e.g. numpy arrays back into tensors)
        self.on_reply = on_reply  # called with the Reply (the target proxy reads its feature batch number)
        self.op_name = type(op).__name__
        self.start = time.perf_counter()
        self.channel = channel
        self.ticket = channel.send(op)
        self.seconds = 0.0  # inside the worker, known after result()
        self.wall_seconds = 0.0  # submission to result: the hops included, known after result()
        self._value = None
        self._is_done = False

    def result(self):
        if not self._is_done:
            reply = self.channel.receive(self.ticket)
            self.wall_seconds = time.perf_counter() - self.start
            self.seconds = reply.seconds
            self.hops.add(self.wall_seconds, reply.seconds, reply.started_at - self.start, self.op_name)
            if self.on_reply is not None:
                self.on_reply(reply)
            self._value = reply.result if self.convert is None else self.convert(reply.result)
            self._is_done = True
        return self._value


class TargetProxy:
    """Looks like a TargetWorker to the Engine; every method is one call on the target's channel."""

    def __init__(self, actor, info: dict, hops: HopTimes, can_overlap: bool) -> None:
        self.actor = actor
        self.channel = ChannelClient(info["channel"], "target worker")
        self.hops = hops
        self.can_overlap = can_overlap  # its calls run on other cores or devices than the drafter's
        self.max_model_len = info["max_model_len"]
        self.max_request_tokens = info["max_request_tokens"]
        self.eos_token_ids = info["eos_token_ids"]
        self.vocab_size = info["vocab_size"]
        self.tokenizer = info["tokenizer"]
        self.keeps_features = info["keeps_features"]
        self.pid = info["pid"]  # the actor's process
        self.num_feature_batches = 0  # the last FeatureBatch the target has sent the drafter
        # Requests that drafted and have not been verified since: their verify sends their new features on to the
        # drafter. Those in `_waiting_in_actor` (fallback rounds) left theirs in the target actor.
        self._drafting: set[str] = set()
        self._waiting_in_actor: set[str] = set()
        self.drafter_connected = self.keeps_features  # (False between a loss of the drafter and its restart)

    def _on_reply(self, reply: Reply) -> None:
        self.num_feature_batches = max(self.num_feature_batches, reply.feature_batch)

    def _submit(self, op: TargetOp) -> PendingCall:
        return PendingCall(self.channel, self.hops, op, on_reply=self._on_reply)

    def allocate(self, request_id, capacity, params):
        return self._submit(Allocate(request_id, capacity, params)).result()

    def prefill(self, request_ids, prompts):
        # (every prefilled request's features go to the drafter: a new request drafts next, unless it starts in
        # fallback; with no drafter connected they wait in the target actor, complete, for one)
        if self.keeps_features and not self.drafter_connected:
            self._waiting_in_actor.update(request_ids)
        return self._submit(Prefill(list(request_ids), [list(p) for p in prompts])).result()

    def verify(self, request_ids, trees, roots):
        return self.verify_async(request_ids, trees, roots).result()

    def verify_async(self, request_ids, trees, roots) -> PendingCall:
        drafting = [r for r in request_ids if r in self._drafting]
        self._drafting.difference_update(request_ids)
        if self.keeps_features:
            self._waiting_in_actor.update(r for r in request_ids if r not in drafting)
        return self._submit(Verify(list(request_ids), trees_to_wire(trees), list(roots), drafting))

    def take_features(self, request_ids) -> None:
        """The target sends the drafter what it needs itself (module docstring): here only requests back from
        fallback cost a call, which pushes the features they left in the target actor. They count as drafting
        until their next verify."""
        back = [r for r in request_ids if r in self._waiting_in_actor]
        if back:
            self._submit(SendFeatures(back)).result()
            self._waiting_in_actor.difference_update(back)
        self._drafting.update(request_ids)
        return None

    def free(self, request_id):
        self._drafting.discard(request_id)
        self._waiting_in_actor.discard(request_id)
        return self._submit(Free(request_id)).result()

    def measure_verify_cost(self, token_counts):
        return self._submit(MeasureVerifyCost(list(token_counts))).result()

    def drafter_lost(self) -> None:
        """The drafter actor died: the target keeps every feature from now on (the requests that were drafting lost
        their context with it, and the engine never drafts them again)."""
        if self.drafter_connected:
            self.drafter_connected = False
            self._drafting.clear()
            with contextlib.suppress(ChannelClosedError):  # (a dead target: its own next call says so)
                self._submit(DisconnectDrafter()).result()

    def drafter_attached(self) -> None:
        """A new drafter actor is connected to the target (`TargetActor.connect_drafter`)."""
        self.drafter_connected = True

    def kv_cache_stats(self) -> dict:
        return ray.get(self.actor.kv_cache_stats.remote())


class DrafterProxy:
    """Looks like a DrafterWorker to the Engine."""

    def __init__(self, actor, info: dict, target: TargetProxy, hops: HopTimes, can_overlap: bool) -> None:
        self.actor = actor
        self.channel = ChannelClient(info["channel"], "drafter worker")
        self.target = target  # (the number of the last feature batch it sent the drafter)
        self.hops = hops
        self.block_len = info["block_len"]
        self.pid = info["pid"]  # the actor's process
        self.can_overlap = can_overlap

    def draft(self, request_ids, roots, features, max_k):
        return self.draft_async(request_ids, roots, features, max_k).result()

    def draft_async(self, request_ids, roots, features, max_k) -> PendingCall:
        # (features: None, from TargetProxy.take_features: the target sends them to the drafter itself)
        op = Draft(list(request_ids), list(roots), max_k, self.target.num_feature_batches)
        return self._submit(op, convert=_draft_from_wire)

    def free(self, request_id):
        return self._submit(FreeDraft(request_id, self.target.num_feature_batches)).result()

    def measure_draft_cost(self, batch_sizes, max_k):
        return self._submit(MeasureDraftCost(list(batch_sizes), max_k)).result()

    def _submit(self, op: DrafterOp, convert=None) -> PendingCall:
        """A call whose ChannelClosedError (the drafter actor died: the engine then decodes on without it) first
        tells the target to keep the features it would have sent."""
        try:
            return _DrafterCall(self.channel, self.hops, op, convert=convert, on_lost=self.target.drafter_lost)
        except ChannelClosedError:
            self.target.drafter_lost()
            raise


class _DrafterCall(PendingCall):
    def __init__(self, *args, on_lost, **kwargs) -> None:
        self.on_lost = on_lost
        super().__init__(*args, **kwargs)

    def result(self):
        try:
            return super().result()
        except ChannelClosedError:
            self.on_lost()
            raise


def _draft_from_wire(wire) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs, token_ids = wire
    return tensor_from_wire(logprobs), tensor_from_wire(token_ids)


@dataclass
class WorkerActors:
    target: object  # ActorHandle
    drafter: object | None
    target_proxy: TargetProxy
    drafter_proxy: DrafterProxy | None
    hops: HopTimes
    # what restarted workers need: their spec, their bundles and the placement group (None: none)
    spec: WorkerSpec | None = None
    target_place: ActorPlace | None = None
    drafter_place: ActorPlace | None = None
    placement_group: object = None
    num_drafter_restarts: int = 0
    num_target_restarts: int = 0

    def kill(self) -> None:
        for proxy in (self.target_proxy, self.drafter_proxy):
            if proxy is not None:
                proxy.channel.close()
        for actor in (self.target, self.drafter):
            if actor is not None:
                ray.kill(actor)

    async def find_dead(self, wait_s: float = 1.0, names: tuple[str, ...] = ("target", "drafter")) -> str | None:
        """Which of the named worker actors has died ("the target actor died: ..."), or None. A ping waits in the
        actor's queue behind the work it is doing, so an answer that does not come within `wait_s` is not a failure
        (a hung actor is the round-time check's to find); a dead actor's ping fails at once."""
        import asyncio

        named = [(name, getattr(self, name)) for name in names]
        pings = [(name, actor.ping.remote()) for name, actor in named if actor is not None]
        for name, ref in pings:
            try:
                await asyncio.wait_for(asyncio.wrap_future(ref.future()), wait_s)
            except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):  # (unavailable: it may come back)
                continue
            except ray.exceptions.ActorDiedError as exc:
                return f"the {name} actor died: {exc}"
        return None

    def start_drafter(self) -> tuple[object, DrafterProxy]:
        """A new drafter actor in the old one's bundle (which its death freed), connected to the target, and its
        proxy (blocking: it loads the drafter). The caller installs them where the engine's thread sees them
        (`install_drafter`)."""
        if self.drafter is not None:
            ray.kill(self.drafter)  # (dead already, or beyond saving: its requests decode on without it)
        return _start_drafter(
            self.spec, self.drafter_place, self.placement_group, self.target, self.target_proxy, self.hops
        )

    def start_workers(self, timeout_s: float | None = None) -> WorkerActors:
        """A new target actor (and drafter actor) in the old ones' bundles, after the target died (blocking: they
        load; GetTimeoutError past `timeout_s`, e.g. when the bundles never free). The old drafter goes too: its
        features came from the dead target, and the new drafter rebuilds each request's context from the target's
        re-prefill. The caller installs them (`install_workers`)."""
        for actor in (self.target, self.drafter):
            if actor is not None:
                with contextlib.suppress(Exception):  # (dead already)
                    ray.kill(actor)
        return start_worker_actors(
            self.spec, self.target_place, self.drafter_place, self.placement_group, hops=self.hops, timeout_s=timeout_s
        )

    def install_workers(self, fresh: WorkerActors) -> None:
        """On the engine's thread: the workers of `start_workers` are the ones to call."""
        for proxy in (self.target_proxy, self.drafter_proxy):
            if proxy is not None:
                proxy.channel.close()
        self.target, self.target_proxy = fresh.target, fresh.target_proxy
        self.drafter, self.drafter_proxy = fresh.drafter, fresh.drafter_proxy
        self.num_target_restarts += 1

    def install_drafter(self, actor, proxy: DrafterProxy) -> None:
        """On the engine's thread (the target proxy's one user): the new drafter is the one to call."""
        if self.drafter_proxy is not None:
            self.drafter_proxy.channel.close()
        self.drafter, self.drafter_proxy = actor, proxy
        self.target_proxy.drafter_attached()
        self.num_drafter_restarts += 1


def _actor_options(spec: WorkerSpec, place: ActorPlace, pg) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts = {
        "num_cpus": place.num_cpus,
        "num_gpus": place.num_gpus,
        "max_restarts": 0,
        "runtime_env": {"env_vars": worker_env(spec)},
    }
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=place.bundle_index
        )
    return opts


def _start_drafter(
    spec: WorkerSpec,
    place: ActorPlace,
    pg,
    target,
    target_proxy: TargetProxy,
    hops: HopTimes,
    timeout_s: float | None = None,
) -> tuple[object, DrafterProxy]:
    head = target.head.remote()  # by reference: target actor -> drafter actor
    drafter = ray.remote(DrafterActor).options(**_actor_options(spec, place, pg)).remote(spec, head)
    try:
        info = ray.get(drafter.describe.remote(), timeout=timeout_s)
        _check_same_node(info["channel"], "drafter")
        ray.get(target.connect_drafter.remote(info["features"]), timeout=timeout_s)
        return drafter, DrafterProxy(drafter, info, target_proxy, hops, spec.workers_overlap)
    except BaseException:
        ray.kill(drafter)
        raise


def start_worker_actors(
    spec: WorkerSpec,
    target_place: ActorPlace,
    drafter_place: ActorPlace | None,
    placement_group=None,
    hops: HopTimes | None = None,
    timeout_s: float | None = None,
) -> WorkerActors:
    """Create the target actor (and the drafter actor) in the given bundles of `placement_group` (None: the
    caller's own placement group if it runs in one, else anywhere), and wait until both have loaded (each for at
    most `timeout_s`: None waits as long as it takes). `hops`: where the proxies add up their calls' overhead (a
    new record when None)."""
    from ray.util import get_current_placement_group

    pg = placement_group if placement_group is not None else get_current_placement_group()
    target = (
        ray.remote(TargetActor)
        .options(**_actor_options(spec, target_place, pg))
        .remote(spec, drafter_place is not None)
    )
    try:
        info = ray.get(target.describe.remote(), timeout=timeout_s)  # waits for the target to load
        _check_same_node(info["channel"], "target")
        hops = hops if hops is not None else HopTimes()
        target_proxy = TargetProxy(target, info, hops, spec.workers_overlap)
        drafter = drafter_proxy = None
        if drafter_place is not None:
            drafter, drafter_proxy = _start_drafter(spec, drafter_place, pg, target, target_proxy, hops, timeout_s)
    except BaseException:
        ray.kill(target)
        raise
    return WorkerActors(target, drafter, target_proxy, drafter_proxy, hops, spec, target_place, drafter_place, pg)


def _check_same_node(address: ChannelAddress, name: str) -> None:
    if address.node_id != _node_id():
        raise RuntimeError(
            f"the {name} actor runs on another node ({address.node_id}) than its engine replica "
            f"({_node_id()}): a replica and its workers share one node (its placement group is "
            f"STRICT_PACK; give start_worker_actors that placement group)"
        )
