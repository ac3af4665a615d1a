"""The target and drafter workers on their own Ray actors.

The engine replica reaches each worker actor through a channel (deployments/channel.py: a Unix socket, blocking
reads, no Ray task per call), and the target reaches the drafter through one more:

    engine replica ──TargetOp──> TargetActor     ──FeatureBatch (one-way)──> DrafterActor
                   <──Reply──                                                    │
                   ──DrafterOp──────────────────────────────────────────────> ───┘
                   <──Reply──

The operations and their wire formats are deployments/worker_ops.py; the proxies the Engine calls,
deployments/proxies.py. A round costs two calls (draft, verify), each a few process wake-ups, and frees are sent
without waiting; plain Ray actor calls remain for what is not on the round's path: loading, the health check's ping,
`info()`.

Target features go from the target to the drafter directly, never through the engine replica: after a verify (the
requests that drafted: they draft again next) the target pushes them as a numbered `FeatureBatch`, and its reply names
the number. The push precedes the reply: the engine's next call is the draft that needs the batch, and a push after the
reply made that draft wait for it (docs/serving.md). A request's prompt features, and those of the rounds it decodes
without a draft (fallback), wait in the target actor (the KV cache's budget counts them per token); when it drafts, one
`SendFeatures` call pushes them. A request that never drafts (most, under load) costs the drafter nothing, not even a
call when it finishes. Each `Draft` and `FreeDraft` names the last batch pushed before it; the drafter extends its
context caches with every batch up to that one first (a thread of its own receives the batches, so the target never
waits for the drafter). Two calls in flight overlap (`pipeline`): a draft on the drafter while the target verifies the
other group.

A new drafter actor (`WorkerActors.start_drafter`) is connected to the same target, whose feature batches keep
their numbering: the new drafter's inbox starts at the current number.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass

import ray
import torch

from deployments.channel import ChannelAddress, ChannelClient, ChannelClosedError, ChannelServer
from deployments.config import WORKER_MEMORY_ENV, WORKER_OPENMP_ENV, ActorPlace, WorkerSpec
from deployments.priority import set_thread_nice
from deployments.proxies import DrafterProxy, HopTimes, TargetProxy
from deployments.worker_ops import (
    WIRE,
    Allocate,
    DisconnectDrafter,
    Draft,
    DrafterOp,
    DraftTopK,
    FeatureBatch,
    Free,
    FreeDraft,
    MeasureBatchCost,
    MeasureDraftCost,
    MeasureVerifyCost,
    Prefill,
    Reply,
    SendFeatures,
    TargetOp,
    Verify,
    tensor_from_wire,
    tensor_to_wire,
    trees_from_wire,
)

_thread_state = threading.local()


def _set_torch_threads(spec: WorkerSpec) -> None:
    """The calling OS thread is the worker's channel thread, the one that computes: torch runs the spec's thread
    count on it, at most the cores this process may use (OpenMP keeps the count per thread; every other thread of
    the process keeps the environment's 1, `worker_env`)."""
    if getattr(_thread_state, "threads", None) is None:
        _thread_state.threads = min(spec.torch_threads, len(os.sched_getaffinity(0)))
        torch.set_num_threads(_thread_state.threads)


def worker_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """A worker actor's environment: OpenMP waits that spin briefly, then sleep (each variable the replica sets,
    so that the actor inherits none of the replica's waits), one OpenMP thread by default, and 2 MB pages for its
    weights and KV cache (`WORKER_MEMORY_ENV`); then the app's `worker_env` (`overrides`). The worker computes
    on its channel's thread alone, which takes the spec's count (`_set_torch_threads`); the actor's own thread
    loads the model and answers Ray calls on one thread, so it never starts an OpenMP team. libgomp counts the
    threads of every team in the process against its cores, and past them every wait between two parallel regions
    sleeps at once: with the model loaded on a team of its own, each region of a forward paid for a wake-up
    (docs/serving.md, "Threads")."""
    return {**WORKER_OPENMP_ENV, **WORKER_MEMORY_ENV, "OMP_NUM_THREADS": "1", **(overrides or {})}


# ---- the actors -------------------------------------------------------------------------------------------------


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class TargetActor:
    """Owns the target model and its KV cache."""

    def __init__(self, spec: WorkerSpec, need_drafter: bool) -> None:
        from ddtree.loaders import load_target_worker, resolve_drafter_path

        set_thread_nice(spec.nice)
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
        self.channel = ChannelServer(
            _node_id(), "target", handle=self.handle, poll_seconds=spec.channel_poll_seconds, codec=WIRE
        )

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
            result = w.allocate_many(list(zip(op.request_ids, op.capacities, op.params)))
        elif isinstance(op, Prefill):  # (its features wait here until the request drafts: `SendFeatures`)
            result = w.prefill(op.request_ids, op.prompts)
        elif isinstance(op, Verify):
            result = w.verify(op.request_ids, trees_from_wire(op.trees), op.roots, op.prompt_ids, op.prompts)
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
        elif isinstance(op, MeasureBatchCost):
            result = w.measure_batch_cost(op.request_counts)
        else:
            raise TypeError(f"not a target operation: {op!r}")
        if w.keep_features and feature_ids:
            with self._drafter_lock:
                if self._to_drafter is not None:
                    self._send_features(feature_ids)
        return Reply(result, time.perf_counter() - t0, self._num_batches, t0, w.num_kv_bytes_used)

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

        set_thread_nice(spec.nice)
        path = resolve_drafter_path(spec.model, spec.drafter)
        self.worker = load_drafter_worker(path, head, device=spec.device, dtype=spec.dtype)
        self._spec = spec
        self._inbox = _FeatureInbox()
        self.channel = ChannelServer(
            _node_id(), "drafter", handle=self.handle, poll_seconds=spec.channel_poll_seconds, codec=WIRE
        )
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
            result = DraftTopK(tensor_to_wire(logprobs), tensor_to_wire(token_ids))
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
        "runtime_env": {"env_vars": worker_env(spec.env)},
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
        return drafter, DrafterProxy(
            drafter, info, target_proxy, hops, spec.workers_overlap, poll_seconds=spec.channel_poll_seconds
        )
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
        target_proxy = TargetProxy(target, info, hops, spec.workers_overlap, poll_seconds=spec.channel_poll_seconds)
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
