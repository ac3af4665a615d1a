"""Packing many requests' draft trees into one verify batch.

Request r contributes a segment of 1 + n_r packed tokens: its root (the last committed token, not yet in the KV
cache) then its tree nodes in pop order. A token sits at position num_cached[r] + depth (root depth 0) and may
attend to the request's first num_cached[r] cached entries, to its ancestors in the tree and to itself; never to
other branches or other requests.

Two mask forms: dense boolean masks per request (PyTorch SDPA, the reference), and ancestor bitmasks with a
mask function and a block list over one key/value tensor holding each request's keys at an offset (FlexAttention):
the compact layout (requests one after another), or the runner's KV pool read in place (regions in any order,
free slots between them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass

import torch

from ddtree.tree import DraftTree

BITS_PER_WORD = 64
FLEX_BLOCK_SIZE = 128  # FlexAttention's default tile: queries and keys in blocks of 128


@functools.cache
def _from_kv_blocks_parameters() -> frozenset[str]:
    """What this torch's `BlockMask.from_kv_blocks` takes (older versions lack `seq_lengths` and
    `compute_q_blocks`; pyproject allows torch 2.5)."""
    from torch.nn.attention.flex_attention import BlockMask

    return frozenset(inspect.signature(BlockMask.from_kv_blocks).parameters)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [N] int64: per request, root token then its nodes
    position_ids: torch.Tensor  # [N] int64: num_cached[r] + depth
    seq_index: torch.Tensor  # [N] int64: which request (0..R-1) a packed token belongs to
    node_index: torch.Tensor  # [N] int64: node index within its request's tree, -1 for the root
    local_parents: torch.Tensor  # [N] int64: parent's offset inside the segment; -1 for the root
    depths: torch.Tensor  # [N] int64: 0 for the root
    ancestor_bits: torch.Tensor  # [N, W] int64: bit j set iff segment token j is an ancestor of (or is) this token
    query_starts: list[int]  # [R + 1]: request r owns packed tokens query_starts[r]:query_starts[r + 1]
    num_cached: list[int]  # [R]: committed entries already in each request's KV cache

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on `device` in two copies (its six per-token rows stacked, and the ancestor bits): a batch
        packed on the host, where its sizes are known without a device read, then uploaded once."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        names = ("input_ids", "position_ids", "seq_index", "node_index", "local_parents", "depths")
        rows = torch.stack([getattr(self, name) for name in names]).to(device)
        return dataclasses.replace(
            self, **dict(zip(names, rows.unbind(0))), ancestor_bits=self.ancestor_bits.to(device)
        )

    @property
    def num_requests(self) -> int:
        return len(self.num_cached)

    def head(self, num_requests: int) -> PackedBatch:
        """The batch of its first `num_requests` segments (views, no copy; the ancestor bits keep their width)."""
        end = self.query_starts[num_requests]
        names = ("input_ids", "position_ids", "seq_index", "node_index", "local_parents", "depths", "ancestor_bits")
        return dataclasses.replace(
            self,
            **{name: getattr(self, name)[:end] for name in names},
            query_starts=self.query_starts[: num_requests + 1],
            num_cached=self.num_cached[:num_requests],
        )

    def segment(self, r: int) -> slice:
        return slice(self.query_starts[r], self.query_starts[r + 1])

    def segment_len(self, r: int) -> int:
        return self.query_starts[r + 1] - self.query_starts[r]

    def tree_mask(self, r: int) -> torch.Tensor:
        """[n_r, n_r] bool: token i of request r may see segment token j (ancestor or itself)."""
        n = self.segment_len(r)
        words = self.ancestor_bits[self.segment(r)]  # [n, W]
        shifts = torch.arange(BITS_PER_WORD, device=words.device)
        bits = (words.unsqueeze(-1) >> shifts) & 1  # [n, W, 64]
        return bits.reshape(n, -1)[:, :n].bool()

    def dense_mask(self, r: int) -> torch.Tensor:
        """[n_r, num_cached[r] + n_r] bool: SDPA mask over (cached entries, then this segment's tokens)."""
        tree = self.tree_mask(r)
        cached = torch.ones(tree.shape[0], self.num_cached[r], dtype=torch.bool, device=tree.device)
        return torch.cat([cached, tree], dim=1)

    def num_keys(self, r: int) -> int:
        """Keys request r's tokens may see: its cached entries, then its segment's tokens."""
        return self.num_cached[r] + self.segment_len(r)

    def kv_starts(self) -> list[int]:
        """[R + 1] offsets of the compact flat key/value layout: request r's cached entries then its segment tokens."""
        starts = [0]
        for r in range(self.num_requests):
            starts.append(starts[-1] + self.num_keys(r))
        return starts

    def key_layout(self, kv_offsets: list[int] | None = None, num_keys: int | None = None) -> tuple[list[int], int]:
        """(where each request's keys start, total keys) of a key/value tensor holding request r's cached entries
        then its segment tokens at kv_offsets[r]: by default the compact layout of `kv_starts()`; the runner's KV
        pool (each request's region, in any order, with free slots between) is another."""
        if kv_offsets is None:
            starts = self.kv_starts()
            return starts[:-1], starts[-1] if num_keys is None else num_keys
        if len(kv_offsets) != self.num_requests:
            raise ValueError(f"{len(kv_offsets)} kv_offsets for a batch of {self.num_requests} requests")
        ranges = sorted((o, o + self.num_keys(r)) for r, o in enumerate(kv_offsets))
        if num_keys is None:
            num_keys = ranges[-1][1]
        if ranges[0][0] < 0 or ranges[-1][1] > num_keys or any(b[0] < a[1] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"requests' key ranges must be disjoint and within [0, {num_keys}), got {ranges}")
        return list(kv_offsets), num_keys

    def flex_mask_mod(self, kv_offsets: list[int] | None = None, num_keys: int | None = None):
        """A FlexAttention mask_mod over queries = packed tokens and keys = the layout of `key_layout`."""
        device = self.input_ids.device
        offsets, num_keys = self.key_layout(kv_offsets, num_keys)
        kv_start = torch.tensor(offsets, device=device)  # [R]
        num_cached = torch.tensor(self.num_cached, device=device)  # [R]
        kv_end = torch.tensor([o + self.num_keys(r) for r, o in enumerate(offsets)], device=device)  # [R], exclusive
        seq_index, bits = self.seq_index, self.ancestor_bits
        num_words = bits.shape[1]

        last_query = self.num_tokens - 1

        def mask_mod(b, h, q_idx, kv_idx):
            # queries past the batch (torch 2.5's create_block_mask pads the grid to whole blocks) see nothing
            q = q_idx.clamp(max=last_query)
            r = seq_index[q]  # the query's request: only its own keys may be seen
            local = kv_idx - kv_start[r] - num_cached[r]  # segment offset of the key; < 0: a cached entry
            is_own = (kv_idx >= kv_start[r]) & (kv_idx < kv_end[r]) & (q_idx <= last_query)
            j = local.clamp(min=0)
            word = bits[q, (j // BITS_PER_WORD).clamp(max=num_words - 1)]
            is_ancestor = ((word >> (j % BITS_PER_WORD)) & 1) == 1
            return is_own & ((local < 0) | is_ancestor)

        return mask_mod

    def flex_block_mask(
        self, block_size: int = FLEX_BLOCK_SIZE, kv_offsets: list[int] | None = None, num_keys: int | None = None
    ):
        """The FlexAttention BlockMask of `flex_mask_mod(kv_offsets, num_keys)`, built from the batch layout in host
        integers.

        `create_block_mask` finds the blocks by evaluating the mask over the whole query x key grid (32 requests of
        65 tokens over 2k-token contexts: 135M entries, seconds and gigabytes per verify); the layout gives them
        directly. A query block holding requests r_lo..r_hi can only see keys of those requests: the blocks
        covering their key ranges. Its key blocks are full (no mask evaluated) where the query block holds one
        request and the key block lies inside that request's cached entries, which every token of it sees."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        offsets, num_keys = self.key_layout(kv_offsets, num_keys)
        if "seq_lengths" not in _from_kv_blocks_parameters():  # an older torch: the grid evaluation (exact, slower)
            return create_block_mask(
                self.flex_mask_mod(offsets, num_keys),
                None,
                None,
                self.num_tokens,
                num_keys,
                device=str(self.input_ids.device),
                BLOCK_SIZE=block_size,
            )
        num_q_blocks = max(1, -(-self.num_tokens // block_size))
        num_kv_blocks = max(1, -(-num_keys // block_size))
        partial: list[list[int]] = []
        full: list[list[int]] = []
        r_lo = 0
        for qb in range(num_q_blocks):
            first, last = qb * block_size, min((qb + 1) * block_size, self.num_tokens) - 1
            while self.query_starts[r_lo + 1] <= first:
                r_lo += 1
            r_hi = r_lo
            while self.query_starts[r_hi + 1] <= last:
                r_hi += 1
            blocks: set[int] = set()
            for r in range(r_lo, r_hi + 1):
                lo, hi = offsets[r], offsets[r] + self.num_keys(r)
                blocks.update(range(lo // block_size, -(-hi // block_size)))
            full_blocks: set[int] = set()
            if r_lo == r_hi:
                lo, cached_end = offsets[r_lo], offsets[r_lo] + self.num_cached[r_lo]
                full_blocks = {b for b in blocks if b * block_size >= lo and (b + 1) * block_size <= cached_end}
            partial.append(sorted(blocks - full_blocks))
            full.append(sorted(full_blocks))

        def as_tensors(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            counts = torch.tensor([len(row) for row in rows], dtype=torch.int32)
            indices = torch.zeros(len(rows), num_kv_blocks, dtype=torch.int32)
            for i, row in enumerate(rows):
                indices[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            device = self.input_ids.device
            return counts.view(1, 1, -1).to(device), indices.view(1, 1, len(rows), -1).to(device)

        kv_num_blocks, kv_indices = as_tensors(partial)
        full_kv_num_blocks, full_kv_indices = as_tensors(full)
        # the transposed index serves the backward pass only (a torch that can skip it is told to)
        skip_q_blocks = {"compute_q_blocks": False} if "compute_q_blocks" in _from_kv_blocks_parameters() else {}
        return BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            BLOCK_SIZE=block_size,
            mask_mod=self.flex_mask_mod(offsets, num_keys),
            seq_lengths=(self.num_tokens, num_keys),
            **skip_q_blocks,
        )


def pack(
    trees: list[DraftTree],
    root_token_ids: list[int],
    num_cached: list[int],
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack one tree per request (an empty tree for an autoregressive step) into a verify batch."""
    if not (len(trees) == len(root_token_ids) == len(num_cached)):
        raise ValueError("trees, root_token_ids and num_cached must have one entry per request")
    if not trees:
        raise ValueError("cannot pack an empty batch")
    if device is None:
        device = trees[0].token_ids.device
    if any(n < 0 for n in num_cached):
        raise ValueError(f"num_cached entries must be >= 0, got {list(num_cached)}")
    seg_lens = [1 + t.num_nodes for t in trees]
    query_starts = [0]
    for n in seg_lens:
        query_starts.append(query_starts[-1] + n)
    num_requests, num_tokens = len(trees), query_starts[-1]
    starts_t = torch.tensor(query_starts[:-1], device=device)  # [R]
    seq_index = torch.repeat_interleave(
        torch.arange(num_requests, device=device), torch.tensor(seg_lens, device=device), output_size=num_tokens
    )  # [N]
    seg_start = starts_t[seq_index]  # [N]
    local = torch.arange(num_tokens, device=device) - seg_start  # [N] offset in segment
    is_node = local > 0  # [N]: every token but the roots, in tree order

    # All trees' nodes at once, scattered behind their roots (masked_scatter_ keeps the order).
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    input_ids[starts_t] = torch.tensor(root_token_ids, dtype=torch.int64, device=device)
    input_ids.masked_scatter_(is_node, torch.cat([t.token_ids for t in trees]).to(device))
    depths = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    depths.masked_scatter_(is_node, torch.cat([t.depths for t in trees]).to(device))
    local_parents = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    local_parents.masked_scatter_(is_node, torch.cat([t.parents for t in trees]).to(device) + 1)
    node_index = local - 1
    position_ids = torch.tensor(num_cached, dtype=torch.int64, device=device)[seq_index] + depths

    ancestor_bits = _ancestor_bits(local_parents, depths, local, seg_start, max(seg_lens))
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        seq_index=seq_index,
        node_index=node_index,
        local_parents=local_parents,
        depths=depths,
        ancestor_bits=ancestor_bits,
        query_starts=query_starts,
        num_cached=list(num_cached),
    )


def _ancestor_bits(
    local_parents: torch.Tensor,  # [N]
    depths: torch.Tensor,  # [N]
    local: torch.Tensor,  # [N] offset in segment
    seg_start: torch.Tensor,  # [N] packed index of the token's segment start
    max_seg_len: int,
) -> torch.Tensor:
    """[N, W] int64: each token's own bit OR-ed over its ancestors, by pointer doubling: after step k a token holds
    the bits of its 2^k nearest ancestors-or-self (the root jumps to itself, and OR is idempotent), so
    ceil(log2(max depth + 1)) steps cover every path."""
    num_tokens = local.numel()
    num_words = (max_seg_len + BITS_PER_WORD - 1) // BITS_PER_WORD
    bits = torch.zeros(num_tokens, num_words, dtype=torch.int64, device=local.device)
    own_bit = torch.ones_like(local) << (local % BITS_PER_WORD)
    bits.scatter_(1, (local // BITS_PER_WORD)[:, None], own_bit[:, None])
    token_index = torch.arange(num_tokens, device=local.device)
    jump = torch.where(local_parents >= 0, seg_start + local_parents, token_index)  # [N] parent; the root: itself
    max_depth = int(depths.max()) if num_tokens else 0
    for _ in range(math.ceil(math.log2(max_depth + 1))):
        bits |= bits.index_select(0, jump)
        jump = jump.index_select(0, jump)
    return bits
