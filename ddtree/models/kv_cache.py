"""The target's KV cache, owned by the engine: per-request regions of one preallocated pool.

Layout: one tensor `pool` [num_layers, 2 (k, v), num_kv_heads, num_slots, head_dim]. A request owns a contiguous
slot range [start, start + max_tokens) for its whole life, so its keys of layer l are the view
`pool[l, 0, :, start:start + n]` ([kv_heads, n, head_dim], what attention reads, no copy), and the writes of a whole
packed batch go into the pool in one indexed copy per layer.

A request's region holds `num_committed` entries (the accepted context), then scratch slots: a verify pass writes
its segment (root + tree nodes) right after the committed entries, and `commit(seq_id, keep_local_indices)` moves
the kept entries (root + accepted path) to be contiguous after the committed ones and drops the rest.

`allocate` returns None when the request does not fit (admission control: the scheduler queues it); every
request's full `max_tokens` is reserved up front, so an admitted request can always run to completion. When the
free slots would hold a request but only split into holes (requests of different sizes finishing out of order),
`allocate` first slides the live regions together (one copy of their entries), so free bytes are admissible bytes.
On CPU the pool is allocated with torch.empty, so untouched slots cost address space, not memory (`zero_fill`, for
FlexAttention's reads of whole key blocks, fills it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPACT_CHUNK_TOKENS = 256  # entries moved per copy when the pool compacts (bounds the temporary memory)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class KVHandle:
    """One request's reservation in the pool."""

    seq_id: int
    slot_start: int  # first slot of the region
    max_tokens: int  # region length: committed entries plus scratch for one verify segment
    num_bytes: int
    num_committed: int = 0  # accepted entries, slots [slot_start, slot_start + num_committed)
    num_scratch: int = 0  # entries written by the last forward after the committed ones, not yet committed


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_bytes: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_tokens_per_request: int | None = None,
        extra_bytes_per_token: int = 0,
        zero_fill: bool = False,
    ):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_tokens_per_request = max_tokens_per_request  # e.g. a sliding window served exactly
        self.kv_bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        # What each reserved token takes from `max_bytes`: its KV entries, plus memory the caller keeps per token
        # outside the pool (the target's features waiting for the drafter), so that `max_bytes` bounds both.
        self.bytes_per_token = self.kv_bytes_per_token + int(extra_bytes_per_token)
        self.num_slots = int(max_bytes) // self.bytes_per_token
        if self.num_slots < 1:
            raise ValueError(f"max_bytes={max_bytes} holds no token (one token takes {self.bytes_per_token} bytes)")
        # `zero_fill` for readers of whole key blocks (FlexAttention over the pool): a never-written slot next to a
        # request's entries must hold a finite value, as a masked key's zero weight times a NaN value is NaN.
        self.pool = (torch.zeros if zero_fill else torch.empty)(
            num_layers, 2, num_kv_heads, self.num_slots, head_dim, device=self.device, dtype=dtype
        )  # [L, 2, kv_heads, slots, head_dim]
        self._handles: dict[int, KVHandle] = {}
        self._free: list[tuple[int, int]] = [(0, self.num_slots)]  # sorted (start, length) ranges

    # ---- accounting -------------------------------------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @property
    def num_bytes_used(self) -> int:
        return sum(h.num_bytes for h in self._handles.values())

    @property
    def num_bytes_free(self) -> int:
        return self.max_bytes - self.num_bytes_used

    @property
    def max_request_tokens(self) -> int:
        """The largest reservation `allocate` can ever grant: the pool, or the sliding window when smaller."""
        if self.max_tokens_per_request is None:
            return self.num_slots
        return min(self.num_slots, self.max_tokens_per_request)

    def bytes_for(self, max_tokens: int) -> int:
        return max_tokens * self.bytes_per_token

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._handles

    def handle(self, seq_id: int) -> KVHandle:
        h = self._handles.get(seq_id)
        if h is None:
            raise ValueError(f"request {seq_id} has no KV allocation")
        return h

    def num_committed(self, seq_id: int) -> int:
        return self.handle(seq_id).num_committed

    # ---- allocation -------------------------------------------------------------------------------------------
    def allocate(self, seq_id: int, max_tokens: int) -> KVHandle | None:
        """Reserve `max_tokens` slots (committed tokens + one verify segment); None if it does not fit now."""
        if seq_id in self._handles:
            raise ValueError(f"request {seq_id} already has a KV allocation")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if self.max_tokens_per_request is not None and max_tokens > self.max_tokens_per_request:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds what this model serves exactly ({self.max_tokens_per_request})"
            )
        if not any(length >= max_tokens for _, length in self._free):
            if sum(length for _, length in self._free) < max_tokens:
                return None
            self._compact()  # enough free slots, but in holes too small: one free range at the end
        for i, (start, length) in enumerate(self._free):
            if length >= max_tokens:
                if length == max_tokens:
                    del self._free[i]
                else:
                    self._free[i] = (start + max_tokens, length - max_tokens)
                h = KVHandle(seq_id, start, max_tokens, self.bytes_for(max_tokens))
                self._handles[seq_id] = h
                return h
        raise AssertionError("unreachable: the compacted pool has one free range of every free slot")

    def _compact(self) -> None:
        """Slide every region to the start of the pool, in slot order, keeping its entries (committed and scratch),
        so that the free slots form one range at the end. Views from `keys_values` taken before are stale after
        it; the runner takes them anew in every forward."""
        next_start = 0
        for h in sorted(self._handles.values(), key=lambda handle: handle.slot_start):
            if h.slot_start != next_start:
                used = h.num_committed + h.num_scratch
                # Moving down, chunk by chunk in increasing order: a chunk's destination overlaps only itself
                # (cloned first) and chunks already moved, and the temporary copy stays small.
                for offset in range(0, used, COMPACT_CHUNK_TOKENS):
                    n = min(COMPACT_CHUNK_TOKENS, used - offset)
                    source = self.pool[:, :, :, h.slot_start + offset : h.slot_start + offset + n].clone()
                    self.pool[:, :, :, next_start + offset : next_start + offset + n] = source
                h.slot_start = next_start
            next_start += h.max_tokens
        self._free = [(next_start, self.num_slots - next_start)] if next_start < self.num_slots else []

    def free(self, seq_id: int) -> bool:
        """Release a request's region (finish or abort); False if it held none."""
        h = self._handles.pop(seq_id, None)
        if h is None:
            return False
        self._free.append((h.slot_start, h.max_tokens))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged
        return True

    # ---- views and writes used by the runner ------------------------------------------------------------------
    def reserve_scratch(self, seq_id: int, num_tokens: int) -> int:
        """Claim `num_tokens` scratch slots after the committed entries; returns the first slot (pool index)."""
        h = self.handle(seq_id)
        if h.num_committed + num_tokens > h.max_tokens:
            raise ValueError(
                f"request {seq_id}: {h.num_committed} committed + {num_tokens} new tokens exceed its "
                f"allocation of {h.max_tokens}"
            )
        h.num_scratch = num_tokens
        return h.slot_start + h.num_committed

    def keys_values(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [kv_heads, num_tokens, head_dim] of the first num_tokens entries of a request's region."""
        start = self.handle(seq_id).slot_start
        kv = self.pool[layer, :, :, start : start + num_tokens]  # [2, kv_heads, n, head_dim]
        return kv[0], kv[1]

    def commit(self, seq_id: int, keep_local_indices) -> None:
        """Keep the scratch entries at `keep_local_indices` (increasing, relative to the scratch start), moved to
        be contiguous after the committed entries; drop the other scratch entries."""
        self.commit_many([seq_id], [keep_local_indices])

    def commit_many(self, seq_ids: list[int], keep_local_indices: list) -> None:
        """`commit` for several requests: every request's moved entries in one copy (a verify pass commits all its
        requests; one indexed copy per request was a device round trip each on a GPU). All are checked first."""
        if len(seq_ids) != len(keep_local_indices):
            raise ValueError(f"{len(seq_ids)} requests but {len(keep_local_indices)} keep lists")
        plans = []
        for seq_id, keep in zip(seq_ids, keep_local_indices):
            h = self.handle(seq_id)
            keep_list = torch.as_tensor(keep, dtype=torch.int64).flatten().tolist()
            if keep_list and (
                keep_list[0] < 0
                or keep_list[-1] >= h.num_scratch
                or any(b <= a for a, b in zip(keep_list, keep_list[1:]))
            ):
                raise ValueError(f"keep_local_indices must be increasing in [0, {h.num_scratch}), got {keep_list}")
            plans.append((h, keep_list))
        if len({h.seq_id for h, _ in plans}) != len(plans):
            raise ValueError("a request appears twice in one commit")
        sources: list[int] = []
        targets: list[int] = []
        for h, keep_list in plans:
            base = h.slot_start + h.num_committed
            if keep_list != list(range(len(keep_list))):  # entries to move down (moves within disjoint regions)
                sources += [base + i for i in keep_list]
                targets += range(base, base + len(keep_list))
        if sources:
            src = torch.tensor(sources, dtype=torch.int64).to(self.device)
            dst = torch.tensor(targets, dtype=torch.int64).to(self.device)
            # Advanced indexing on the right copies first, so overlapping source and target are safe.
            self.pool[:, :, :, dst] = self.pool[:, :, :, src]
        for h, keep_list in plans:
            h.num_committed += len(keep_list)
            h.num_scratch = 0

    def commit_all(self, seq_id: int) -> None:
        """Keep every scratch entry (prefill and plain decode)."""
        h = self.handle(seq_id)
        h.num_committed += h.num_scratch
        h.num_scratch = 0
