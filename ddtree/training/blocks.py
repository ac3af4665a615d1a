"""Training blocks for a DFlash drafter: anchors, block inputs, the attention mask and the weighted labels.

One sequence of N tokens (prompt + the target's response) gives target features for positions 0..N-2 (the last
token was never fed to the target). A block anchored at position a holds the anchor token at block position 0 and
the mask token at positions 1..L-1 (L = block_size), at target positions a..a+L-1; block position k >= 1 is
trained to predict the token at position a + k (no shift: the output at k predicts the token AT k). The block sees
the context features of positions strictly before a (the anchor itself is not yet run through the target when the
drafter drafts at inference), all of its own positions bidirectionally, and no other block. Many blocks of one
sequence are concatenated along S with a block-diagonal mask.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

import torch

IGNORE_INDEX = -100


@dataclass
class BlockBatch:
    """Blocks of B sequences, concatenated along S; everything the drafter forward and the loss need."""

    block_token_ids: torch.Tensor  # [B, S] anchor token at block position 0, mask token elsewhere
    block_positions: torch.Tensor  # [B, S] target positions a + k
    context_positions: torch.Tensor  # [B, C] 0..C-1
    attention_mask: torch.Tensor  # [B, S, C + S] bool, True = may attend
    labels: torch.Tensor  # [B, S] token at a + k, IGNORE_INDEX at k = 0, past the sequence end and in padding
    loss_weights: torch.Tensor  # [B, S] exp(-(k - 1) / gamma) where labelled, else 0
    block_offsets: torch.Tensor  # [B, S] k, the position inside the block
    label_positions: torch.Tensor  # [B, S] a + k, the label's position in its sequence, where labelled (else 0)
    # [M] flat indices (into B * S) of the labelled positions, found on the host when the batch is built: boolean
    # indexing on a GPU would wait for the device every step to learn M
    labelled_rows: torch.Tensor

    def to(self, device: torch.device | str) -> BlockBatch:
        """The same batch with every tensor on `device` (itself when already there)."""
        return BlockBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def default_gamma(block_size: int) -> float:
    """DFlash uses gamma 7 for blocks of 16; scale it with the number of predicted positions."""
    return 7.0 * (block_size - 1) / 15.0


def sample_anchors(prompt_length: int, num_tokens: int, max_anchors: int, rng: random.Random) -> list[int]:
    """Sorted distinct anchor positions in the response part: a in [prompt_length, num_tokens - 2].

    The first draft after prefill is anchored at the first response token (position prompt_length), and an anchor
    needs at least one token after it to have a label.
    """
    valid = range(prompt_length, num_tokens - 1)
    if len(valid) == 0:
        return []
    return sorted(rng.sample(valid, min(max_anchors, len(valid))))


def build_block_batch(
    sequences: list[list[int]],
    anchors: list[list[int]],
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
) -> BlockBatch:
    """Blocks for B sequences; sequence b has len(sequences[b]) - 1 context features and the anchors anchors[b]."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if len(sequences) != len(anchors) or not sequences:
        raise ValueError("need one anchor list per sequence and at least one sequence")
    gamma = default_gamma(block_size) if gamma is None else gamma
    num_seqs = len(sequences)
    max_blocks = max(1, max(len(a) for a in anchors))
    s = max_blocks * block_size
    c = max(len(seq) - 1 for seq in sequences)
    block_token_ids = torch.full((num_seqs, s), mask_token_id, dtype=torch.long)
    block_positions = torch.zeros((num_seqs, s), dtype=torch.long)
    labels = torch.full((num_seqs, s), IGNORE_INDEX, dtype=torch.long)
    loss_weights = torch.zeros((num_seqs, s), dtype=torch.float32)
    label_positions = torch.zeros((num_seqs, s), dtype=torch.long)
    attention_mask = torch.zeros((num_seqs, s, c + s), dtype=torch.bool)
    offsets = torch.arange(s) % block_size  # [S]
    position_weights = torch.tensor(
        [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)], dtype=torch.float32
    )  # [L]
    for b, (seq, seq_anchors) in enumerate(zip(sequences, anchors)):
        n = len(seq)
        tokens = torch.tensor(seq, dtype=torch.long)
        for j in range(max_blocks):
            rows = slice(j * block_size, (j + 1) * block_size)
            # a block only ever attends to itself; padding blocks too (an all-False row would make NaNs)
            attention_mask[b, rows, c + j * block_size : c + (j + 1) * block_size] = True
            if j >= len(seq_anchors):
                continue
            a = seq_anchors[j]
            if not 0 < a < n - 1:
                raise ValueError(f"anchor {a} outside 1..{n - 2} for a sequence of {n} tokens")
            block_token_ids[b, j * block_size] = tokens[a]
            block_positions[b, rows] = torch.arange(a, a + block_size)
            attention_mask[b, rows, :a] = True  # context strictly before the anchor
            num_labelled = min(block_size - 1, n - 1 - a)
            first = j * block_size + 1
            labels[b, first : first + num_labelled] = tokens[a + 1 : a + 1 + num_labelled]
            loss_weights[b, first : first + num_labelled] = position_weights[1 : 1 + num_labelled]
            label_positions[b, first : first + num_labelled] = torch.arange(a + 1, a + 1 + num_labelled)
    context_positions = torch.arange(c).unsqueeze(0).expand(num_seqs, c).contiguous()  # [B, C]
    labelled_rows = (labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # [M]
    return BlockBatch(
        block_token_ids,
        block_positions,
        context_positions,
        attention_mask,
        labels,
        loss_weights,
        offsets.unsqueeze(0).expand(num_seqs, s).contiguous(),
        label_positions,
        labelled_rows,
    )
