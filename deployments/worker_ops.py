"""What crosses between an engine replica and its worker actors: the typed operations and their wire formats.

Operations are typed (`Allocate`, `Prefill`, `Verify`, `Free`, `SendFeatures`, `DisconnectDrafter`, `MeasureVerifyCost`,
`MeasureBatchCost`; `Draft`, `FreeDraft`, `MeasureDraftCost`), each answered with a `Reply` that carries the seconds
spent inside the worker. Target features travel from the target to the drafter as numbered `FeatureBatch`es
(deployments/actors.py).

What crosses between processes is numpy arrays and lists, never torch tensors (`trees_to_wire`, `tensor_to_wire`):
numpy arrays pickle as single buffers, torch tensors through torch's own reducer (~0.3 ms apiece here).

`WireCodec` encodes the messages of a round (`Verify`, `Draft` and their replies) as msgpack lists, everything else
(the rare operations, failures) as pickles. Both ends decode right after a model pass, which has streamed the weights
through the CPU caches: a pickle's machinery (class lookups, object reconstruction) must then be read back from
memory, and decoding it costs several times what it does warm; a msgpack list touches far less
(docs/serving.md, "Worker calls").
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from ddtree.workers import PrefillResult, RawLogprobs, VerifyResult


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
    counts = [-1 if t is None else t.num_nodes for t in trees]
    present = [t for t in trees if t is not None and t.num_nodes]
    if not present:  # a plain round: no tensor work
        return counts, np.zeros((3, 0), dtype=np.int64), np.zeros(0, dtype=np.float32)
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
    """Reserve KV for each request in order, stopping at the first that does not fit: how many did."""

    request_ids: list[str]
    capacities: list[int]
    params: list[object]  # SamplingParams


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
    prompt_ids: list[str] = field(default_factory=list)  # newly admitted requests: the pass takes in their prompts
    prompts: list[list[int]] = field(default_factory=list)


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
class MeasureBatchCost:
    request_counts: list[int]


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


TargetOp = Allocate | Prefill | Verify | Free | SendFeatures | DisconnectDrafter | MeasureVerifyCost | MeasureBatchCost
DrafterOp = Draft | FreeDraft | MeasureDraftCost


@dataclass
class FeatureBatch:
    """Target features on their way to the drafter: rows of `request_ids[i]` are the next `counts[i]` rows."""

    number: int  # 1, 2, ... in the order the target sends them
    request_ids: list[str]
    counts: list[int]
    wire: tuple  # tensor_to_wire of [sum(counts), F]


@dataclass
class DraftTopK:
    """A draft's result: `tensor_to_wire` of the top-K log-probs [n, L, K] and of their token ids [n, L, K]."""

    logprobs: tuple[np.ndarray, str]
    token_ids: tuple[np.ndarray, str]


@dataclass
class Reply:
    result: object
    seconds: float  # inside the worker
    feature_batch: int = 0  # (target) the last FeatureBatch sent so far
    started_at: float = 0.0  # time.perf_counter() in the worker when the operation began (one clock per node)
    kv_bytes_used: int = 0  # (target) its KV cache's bytes in use after the operation


# ---- the wire ---------------------------------------------------------------------------------------------------

# The first byte of an encoded message: how the rest is encoded
_PICKLED, _VERIFY, _DRAFT, _VERIFY_REPLY, _DRAFT_REPLY = range(5)


def _array_out(a: np.ndarray) -> list:
    return [a.dtype.str, list(a.shape), a.tobytes()]


def _array_in(wire: list) -> np.ndarray:
    dtype, shape, data = wire
    return np.frombuffer(data, dtype=dtype).reshape(shape)  # (read-only: trees_from_wire / tensor_from_wire copy)


def _logprobs_out(logprobs: list) -> list:
    return [None if lp is None else [lp.chosen, lp.top_ids, lp.top_values] for lp in logprobs]


def _logprobs_in(wire: list) -> list:
    return [None if lp is None else RawLogprobs(*lp) for lp in wire]


class WireCodec:
    """The worker channels' codec (deployments/channel.py): `Verify`, `Draft` and the replies that carry their results
    as msgpack lists behind a one-byte tag, any other message as a pickle behind its own tag. The types are checked
    exactly (a subclass may carry more than the list holds)."""

    def encode(self, message: object) -> bytes:
        try:
            return self._encode_round(message)
        except TypeError:  # a value msgpack cannot carry (a numpy scalar in a list): correct, if slower, as a pickle
            return bytes([_PICKLED]) + pickle.dumps(message, protocol=5)

    def _encode_round(self, message: object) -> bytes:
        kind = type(message)
        if kind is Verify:
            counts, ints, values = message.trees
            body = [
                message.request_ids, counts, _array_out(ints), _array_out(values), message.roots,
                message.feature_request_ids, list(message.prompt_ids), list(message.prompts),
            ]  # fmt: skip
            return bytes([_VERIFY]) + msgpack.packb(body)
        if kind is Draft:
            body = [message.request_ids, message.roots, message.max_k, message.after_batch]
            return bytes([_DRAFT]) + msgpack.packb(body)
        if kind is Reply and type(message.result) is VerifyResult:
            r = message.result
            prefilled = None if r.prefilled is None else [r.prefilled.token_ids, _logprobs_out(r.prefilled.logprobs)]
            body = [
                r.accepted_token_ids, r.bonus_token_ids, r.num_tokens, r.forward_seconds, r.accept_seconds,
                _logprobs_out(r.logprobs), prefilled, message.seconds, message.feature_batch, message.started_at,
                message.kv_bytes_used,
            ]  # fmt: skip
            return bytes([_VERIFY_REPLY]) + msgpack.packb(body)
        if kind is Reply and type(message.result) is DraftTopK:
            (lp, lp_dtype), (ids, ids_dtype) = message.result.logprobs, message.result.token_ids
            body = [_array_out(lp), lp_dtype, _array_out(ids), ids_dtype, message.seconds, message.started_at]
            return bytes([_DRAFT_REPLY]) + msgpack.packb(body)
        return bytes([_PICKLED]) + pickle.dumps(message, protocol=5)

    def decode(self, data: bytearray) -> object:
        tag, body = data[0], memoryview(data)[1:]
        if tag == _PICKLED:
            return pickle.loads(body)
        if tag > _DRAFT_REPLY:
            raise ValueError(f"not a worker message (tag {tag})")
        fields = msgpack.unpackb(body)
        if tag == _VERIFY:
            request_ids, counts, ints, values, roots, feature_ids, prompt_ids, prompts = fields
            trees = (counts, _array_in(ints), _array_in(values))
            return Verify(request_ids, trees, roots, feature_ids, prompt_ids, prompts)
        if tag == _DRAFT:
            return Draft(*fields)
        if tag == _VERIFY_REPLY:
            *result, logprobs, prefilled, seconds, feature_batch, started_at, kv_bytes_used = fields
            if prefilled is not None:
                prefilled = PrefillResult(prefilled[0], _logprobs_in(prefilled[1]))
            result = VerifyResult(*result, _logprobs_in(logprobs), prefilled)
            return Reply(result, seconds, feature_batch, started_at, kv_bytes_used)
        lp, lp_dtype, ids, ids_dtype, seconds, started_at = fields  # _DRAFT_REPLY
        return Reply(DraftTopK((_array_in(lp), lp_dtype), (_array_in(ids), ids_dtype)), seconds, 0, started_at)


WIRE = WireCodec()
