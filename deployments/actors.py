"""The target and drafter workers on their own Ray actors, and the thin proxies the Engine calls.

The engine calls its workers only through a handful of methods (allocate, prefill, verify, take_features, free,
measure_verify_cost / draft, free, measure_draft_cost), so each proxy method is at most one plain actor call:
`ray.get(actor.method.remote(...))` (`take_features` usually none: it hands over references). Serve handles never appear in the per-round loop. The round's two big calls
also come as `verify_async` / `draft_async`, which submit and return a `PendingCall`: with `pipeline=True` the
engine keeps two request groups in flight and the drafter actor drafts one while the target actor verifies the
other (ddtree/engine.py `_pipelined_step`).

Target features go from the target actor to the drafter actor by object reference, with no call of their own in a
round: a prefill or verify call returns them as a second object (the features of the tokens it committed: a
prefill's for all its requests, a verify's for those drafting, which draft again next), which the engine never fetches. `TargetProxy` keeps, per
request, the references holding its features since it last drafted; `take_features` hands them over (a
`FeatureRefs`) and `DrafterProxy.draft` passes them as arguments of the drafter's call, so Ray resolves them on the
drafter's side (large objects move between the two actors' object stores; Ray inlines objects under ~100 KB into
the reply to the caller, so small feature sets do pass by the engine process, still without being deserialised
there), and the drafter copies only its requests' rows. A request decoding without a draft (fallback) leaves its
features in the target actor (where the KV cache's budget counts them per token), so that the rounds it rests add no
reference to whole batches' feature objects (it holds at most the one from its last drafting round, or its
prefill's); when it drafts again one `take_features` actor call fetches them (by reference too). A `take_features` actor call that
every draft waited for used to do this every round.

Each timed actor method returns (result, seconds spent inside the actor); the proxies keep the difference from the
wall time of the call: the cost of the actor hop itself (see `HopTimes`, reported as a metric and by
benchmarks/bench_actors.py).

What crosses between processes in the round is numpy arrays and lists, never torch tensors: Ray pickles a torch
tensor through torch's own reducer, ~0.3 ms apiece on this project's CPU, where a numpy array travels as one buffer
(~0.05 ms). A verify call carried four tensors per request's tree, so its hop grew with the batch (`trees_to_wire`,
`tensor_to_wire`).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from deployments.config import ActorPlace, WorkerSpec


# OpenMP threads spin after each parallel region by default (libgomp: ~0.3 s of busy-waiting). The target and the
# drafter take turns on the same cores, so a spinning pool in one actor would steal the cores from the other:
# every stage measured 5-10x slower on 2 cores. Passive waiting must be set before torch loads OpenMP, so it goes in
# the actor's environment.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def _set_torch_threads(spec: WorkerSpec) -> None:
    if spec.device.startswith("cpu"):
        import torch

        torch.set_num_threads(spec.torch_threads or len(os.sched_getaffinity(0)))


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


class TargetActor:
    """Owns the target model and its KV cache."""

    def __init__(self, spec: WorkerSpec, need_drafter: bool) -> None:
        from ddtree.workers import load_target_worker, resolve_drafter_path

        _set_torch_threads(spec)
        drafter_path = resolve_drafter_path(spec.model, spec.drafter) if need_drafter else None
        self.worker = load_target_worker(
            spec.model, drafter_path, device=spec.device, dtype=spec.dtype, kv_cache_bytes=spec.kv_cache_bytes,
            attention=spec.attention)
        self.tokenizer = self.worker.model.tokenizer

    def ping(self) -> bool:
        """Answers when the actor is alive (the engine replica's health check)."""
        return True

    def describe(self) -> dict:
        """What the engine reads from the worker once, and the tokenizer it detokenizes with."""
        w = self.worker
        return {"max_model_len": w.max_model_len, "max_request_tokens": w.max_request_tokens,
                "eos_token_ids": list(w.eos_token_ids), "keeps_features": w.keep_features,
                "vocab_size": w.vocab_size, "tokenizer": self.tokenizer}

    def head(self):
        """The target's embedding and LM head (ddtree.models.target.TargetHead) for the drafter actor, on the CPU:
        a CUDA tensor would be unpickled onto the receiver's GPU of the same index, whatever GPU Ray gave it (the
        drafter moves it to its own device)."""
        return self.worker.model.head().to("cpu")

    def allocate(self, request_id, capacity, params):
        return _timed(self.worker.allocate, request_id, capacity, params)

    def prefill(self, request_ids, prompts):
        """(result, seconds) and, where a drafter reads features, the prompts' features (a second return)."""
        return self._with_features(request_ids, _timed(self.worker.prefill, request_ids, prompts))

    def verify(self, request_ids, trees_wire, roots, feature_request_ids):
        """(result, seconds) and, where a drafter reads features, the features of `feature_request_ids` (those
        drafting: they draft again next) committed since they were last taken (a second return); the other
        requests' stay here until `take_features`."""
        timed = _timed(lambda: self.worker.verify(request_ids, trees_from_wire(trees_wire), roots))
        return self._with_features(feature_request_ids, timed)

    def take_features(self, request_ids):
        """The features waiting here for requests back from fallback (the rare path: no other call takes them)."""
        return self._features_wire(request_ids)

    def _with_features(self, request_ids, timed):
        if not self.worker.keep_features:
            return timed
        return timed, self._features_wire(request_ids)

    def _features_wire(self, request_ids):
        """(row counts per request, features wire); None when there are no requests. On the host, as numpy (module
        docstring): they leave this process serialised anyway, and a CUDA tensor would be unpickled onto the
        receiver's GPU of the same index, not the drafter's device."""
        if not request_ids:
            return None
        features = self.worker.take_features(request_ids)
        return [f.shape[0] for f in features], tensor_to_wire(torch.cat(features))

    def free(self, request_id):
        return _timed(self.worker.free, request_id)

    def measure_verify_cost(self, token_counts):
        return self.worker.measure_verify_cost(token_counts)

    def kv_cache_stats(self) -> dict:
        return {"bytes_used": self.worker.num_kv_bytes_used}


class DrafterActor:
    """Owns the DFlash drafter and its per-request context caches."""

    def __init__(self, spec: WorkerSpec, head) -> None:
        from ddtree.workers import load_drafter_worker, resolve_drafter_path

        _set_torch_threads(spec)
        path = resolve_drafter_path(spec.model, spec.drafter)
        self.worker = load_drafter_worker(path, head, device=spec.device, dtype=spec.dtype)

    def ping(self) -> bool:
        return True

    def block_len(self) -> int:
        return self.worker.block_len

    def draft(self, request_ids, roots, picks, max_k, *feature_objects):
        """The top-K draft log-probs and token ids, on the host as numpy: the engine replica that builds the trees
        from them holds no GPU (unpickling a CUDA tensor there would open a context on a GPU Ray never gave it).
        Request i's new features are its rows in the prefill / verify results `feature_objects` that `picks[i]`
        names (`FeatureRefs`), in order."""
        starts = [[0, *itertools.accumulate(lengths)] for lengths, _ in feature_objects]  # row offsets per object

        def rows(o: int, r: int) -> torch.Tensor:  # copies request r's rows of object o only (the object is
            array, dtype = feature_objects[o][1]  # a whole batch's, a read-only view of the object store)
            return tensor_from_wire((array[starts[o][r] : starts[o][r + 1]], dtype))

        def draft_to_host():
            features = [_joined([rows(o, r) for o, r in pick]) for pick in picks]
            logprobs, token_ids = self.worker.draft(request_ids, roots, features, max_k)
            return tensor_to_wire(logprobs), tensor_to_wire(token_ids)

        return _timed(draft_to_host)

    def free(self, request_id):
        return _timed(self.worker.free, request_id)

    def measure_draft_cost(self, batch_sizes, max_k):
        return self.worker.measure_draft_cost(batch_sizes, max_k)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


@dataclass
class HopTimes:
    """Seconds the proxies spent in actor calls beyond what the actors spent working (summed)."""

    seconds: float = 0.0
    num_calls: int = 0

    def add(self, wall_seconds: float, inside_seconds: float) -> None:
        self.seconds += max(0.0, wall_seconds - inside_seconds)
        self.num_calls += 1


class PendingCall:
    """An actor call in flight (the engine's draft and verify, submitted so that they can overlap); `.result()`
    waits for it. The hop time booked is the wall time from submission to result minus the time inside the actor,
    so it is an upper bound when the caller reads the result late."""

    def __init__(self, hops: HopTimes, method, *args, convert=None, with_features: bool = False) -> None:
        self.hops = hops
        self.convert = convert  # applied to the actor's result (e.g. numpy arrays back into tensors)
        self.start = time.perf_counter()
        # with_features: the method returns a second object, the features, left un-fetched in `features_ref`
        self.ref, self.features_ref = method.options(num_returns=2).remote(*args) if with_features else (
            method.remote(*args), None)
        self.seconds = 0.0  # inside the actor, known after result()
        self.wall_seconds = 0.0  # submission to result: the hops included, known after result()
        self._value = None
        self._is_done = False

    def result(self):
        if not self._is_done:
            self._value, self.seconds = ray.get(self.ref)
            if self.convert is not None:
                self._value = self.convert(self._value)
            self.wall_seconds = time.perf_counter() - self.start
            self.hops.add(self.wall_seconds, self.seconds)
            self._is_done = True
        return self._value


def _call(hops: HopTimes, method, *args):
    t0 = time.perf_counter()
    result, inside = ray.get(method.remote(*args))
    hops.add(time.perf_counter() - t0, inside)
    return result


@dataclass
class FeatureRefs:
    """Requests' new target features in transit: `picks[i]` lists (index into `refs`, row group) for request i; each
    referenced object is a prefill or verify call's (row counts per request, features wire)."""

    picks: list[list[tuple[int, int]]]
    refs: list


class TargetProxy:
    """Looks like a TargetWorker to the Engine; every method is one actor call."""

    is_remote = True  # its calls run on the actor, concurrently with the drafter actor's (pipeline="auto")

    def __init__(self, actor, hops: HopTimes) -> None:
        self.actor = actor
        self.hops = hops
        info = ray.get(actor.describe.remote())
        self.max_model_len = info["max_model_len"]
        self.max_request_tokens = info["max_request_tokens"]
        self.eos_token_ids = info["eos_token_ids"]
        self.vocab_size = info["vocab_size"]
        self.tokenizer = info["tokenizer"]
        self.keeps_features = info["keeps_features"]
        # per request: (features object of a prefill / verify call, the request's index in that call), oldest first
        self._feature_refs: dict[str, list[tuple[ray.ObjectRef, int]]] = {}
        # Requests that took their features to draft and have not been verified since: their next verify returns
        # their new features. The others' (requests in fallback) wait in the target actor, so that no reference
        # pins a whole batch's features object for the many rounds a request may rest in fallback.
        self._drafting: set[str] = set()
        self._waiting_in_actor: set[str] = set()

    def allocate(self, request_id, capacity, params):
        return _call(self.hops, self.actor.allocate, request_id, capacity, params)

    def prefill(self, request_ids, prompts):
        # (a new request drafts next, unless it starts in fallback: one prefill object, pinned until it probes)
        return self._submit(self.actor.prefill, request_ids, request_ids, prompts).result()

    def verify(self, request_ids, trees, roots):
        return self.verify_async(request_ids, trees, roots).result()

    def verify_async(self, request_ids, trees, roots) -> PendingCall:
        drafting = [r for r in request_ids if r in self._drafting]
        self._drafting.difference_update(request_ids)
        if self.keeps_features:
            self._waiting_in_actor.update(r for r in request_ids if r not in drafting)
        return self._submit(self.actor.verify, request_ids, drafting, trees_to_wire(trees), roots, drafting)

    def _submit(self, method, request_ids, feature_request_ids, *args) -> PendingCall:
        call = PendingCall(self.hops, method, request_ids, *args, with_features=self.keeps_features)
        if call.features_ref is not None:
            for i, rid in enumerate(feature_request_ids):
                self._feature_refs.setdefault(rid, []).append((call.features_ref, i))
        return call

    def take_features(self, request_ids) -> "FeatureRefs":
        """The features committed for each request since it last drafted, as references for the drafter's call
        (un-fetched on purpose: the drafter actor resolves them, see the module docstring): those its verifies
        returned, then, for a request back from fallback, those waiting in the target actor (one call for all)."""
        refs: list[ray.ObjectRef] = []
        position: dict[ray.ObjectRef, int] = {}
        picks = []
        for rid in request_ids:
            pick = []
            for ref, row in self._feature_refs.pop(rid, ()):
                if ref not in position:
                    position[ref] = len(refs)
                    refs.append(ref)
                pick.append((position[ref], row))
            picks.append(pick)
        back = [i for i, rid in enumerate(request_ids) if rid in self._waiting_in_actor]
        if back:
            refs.append(self.actor.take_features.remote([request_ids[i] for i in back]))
            for row, i in enumerate(back):
                picks[i].append((len(refs) - 1, row))
            self._waiting_in_actor.difference_update(request_ids)
        self._drafting.update(request_ids)
        return FeatureRefs(picks, refs)

    def free(self, request_id):
        self._feature_refs.pop(request_id, None)
        self._drafting.discard(request_id)
        self._waiting_in_actor.discard(request_id)
        return _call(self.hops, self.actor.free, request_id)

    def measure_verify_cost(self, token_counts):
        return ray.get(self.actor.measure_verify_cost.remote(token_counts))

    def kv_cache_stats(self) -> dict:
        return ray.get(self.actor.kv_cache_stats.remote())


class DrafterProxy:
    """Looks like a DrafterWorker to the Engine."""

    is_remote = True

    def __init__(self, actor, hops: HopTimes) -> None:
        self.actor = actor
        self.hops = hops
        self.block_len = ray.get(actor.block_len.remote())

    def draft(self, request_ids, roots, features: FeatureRefs, max_k):
        return self.draft_async(request_ids, roots, features, max_k).result()

    def draft_async(self, request_ids, roots, features: FeatureRefs, max_k) -> PendingCall:
        # the references as top-level arguments: Ray resolves those (and only those) before the call runs
        return PendingCall(self.hops, self.actor.draft, request_ids, roots, features.picks, max_k, *features.refs,
                           convert=_draft_from_wire)

    def free(self, request_id):
        return _call(self.hops, self.actor.free, request_id)

    def measure_draft_cost(self, batch_sizes, max_k):
        return ray.get(self.actor.measure_draft_cost.remote(batch_sizes, max_k))


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

    def kill(self) -> None:
        for actor in (self.target, self.drafter):
            if actor is not None:
                ray.kill(actor)

    async def find_dead(self, wait_s: float = 1.0) -> str | None:
        """Which worker actor has died ("target actor died: ..."), or None. A ping waits in the actor's queue behind
        the work it is doing, so an answer that does not come within `wait_s` is not a failure (a hung actor is the
        round-time check's to find); a dead actor's ping fails at once."""
        import asyncio

        named = [("target", self.target), ("drafter", self.drafter)]
        pings = [(name, actor.ping.remote()) for name, actor in named if actor is not None]
        for name, ref in pings:
            try:
                await asyncio.wait_for(asyncio.wrap_future(ref.future()), wait_s)
            except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):  # (unavailable: it may come back)
                continue
            except ray.exceptions.ActorDiedError as exc:
                return f"the {name} actor died: {exc}"
        return None


def start_worker_actors(spec: WorkerSpec, target_place: ActorPlace, drafter_place: ActorPlace | None,
                        placement_group=None) -> WorkerActors:
    """Create the target actor (and the drafter actor) in the given bundles of `placement_group` (None: the
    caller's own placement group if it runs in one, else anywhere), and wait until both have loaded."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group if placement_group is not None else get_current_placement_group()

    def options(place: ActorPlace) -> dict:
        opts = {"num_cpus": place.num_cpus, "num_gpus": place.num_gpus, "max_restarts": 0,
                "runtime_env": {"env_vars": dict(OPENMP_ENV)}}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=place.bundle_index)
        return opts

    target = ray.remote(TargetActor).options(**options(target_place)).remote(spec, drafter_place is not None)
    hops = HopTimes()
    target_proxy = TargetProxy(target, hops)  # waits for the target to load
    drafter = drafter_proxy = None
    if drafter_place is not None:
        head = target.head.remote()  # by reference: target actor -> drafter actor
        drafter = ray.remote(DrafterActor).options(**options(drafter_place)).remote(spec, head)
        drafter_proxy = DrafterProxy(drafter, hops)
    return WorkerActors(target, drafter, target_proxy, drafter_proxy, hops)
