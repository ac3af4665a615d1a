"""Training blocks of the DFlash drafter: context strictly before the anchor, no cross-block leakage, labels
unshifted, weights as in the recipe, and the same guarantees checked end to end through a real tiny drafter."""

import math
import random

import pytest
import torch

from ddtree.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree.training.blocks import IGNORE_INDEX, build_block_batch, default_gamma, sample_anchors
from ddtree.training.evaluate import simulate_rounds

MASK = 99


def test_mask_labels_positions_and_weights_on_a_hand_checked_sequence():
    seq = [10, 11, 12, 13, 14, 15, 16]  # N = 7: features for positions 0..5
    batch = build_block_batch([seq], [[2, 5]], block_size=3, mask_token_id=MASK, gamma=2.0)
    c = 6
    assert batch.block_token_ids.tolist() == [[12, MASK, MASK, 15, MASK, MASK]]
    assert batch.block_positions.tolist() == [[2, 3, 4, 5, 6, 7]]
    assert batch.context_positions.tolist() == [list(range(c))]
    # labels are the tokens AT the block positions (no shift); past the end (position 7) there is none
    assert batch.labels.tolist() == [[IGNORE_INDEX, 13, 14, IGNORE_INDEX, 16, IGNORE_INDEX]]
    assert batch.loss_weights[0].tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), 0.0, 1.0, 0.0])
    mask = batch.attention_mask[0]
    expected_first = [True, True, False, False, False, False] + [True, True, True, False, False, False]
    expected_second = [True] * 5 + [False] + [False, False, False, True, True, True]
    for row in range(3):
        assert mask[row].tolist() == expected_first
        assert mask[3 + row].tolist() == expected_second


def test_context_strictly_before_anchor_and_block_diagonal_for_random_inputs():
    rng = random.Random(0)
    for _ in range(20):
        seqs = [[rng.randrange(50) for _ in range(rng.randint(6, 30))] for _ in range(3)]
        prompt_lengths = [rng.randint(1, len(s) - 2) for s in seqs]
        anchors = [sample_anchors(p, len(s), rng.randint(1, 6), rng) for p, s in zip(prompt_lengths, seqs)]
        block_size = rng.randint(2, 6)
        batch = build_block_batch(seqs, anchors, block_size, MASK)
        c = max(len(s) for s in seqs) - 1
        for b, (seq, seq_anchors) in enumerate(zip(seqs, anchors)):
            for j, a in enumerate(seq_anchors):
                assert prompt_lengths[b] <= a <= len(seq) - 2
                for k in range(block_size):
                    row = j * block_size + k
                    visible = batch.attention_mask[b, row]
                    assert visible[:c].tolist() == [col < a for col in range(c)]
                    own = range(c + j * block_size, c + (j + 1) * block_size)
                    assert visible[c:].tolist() == [c + col in own for col in range(batch.labels.shape[1])]
                    label = int(batch.labels[b, row])
                    if k == 0 or a + k >= len(seq):
                        assert label == IGNORE_INDEX
                    else:
                        assert label == seq[a + k]
            # rows of padding blocks still see something (an all-False row would give NaN in attention)
            assert bool(batch.attention_mask[b].any(dim=-1).all())


def test_sample_anchors_stays_in_the_response_and_needs_a_label():
    rng = random.Random(1)
    assert sample_anchors(5, 6, 10, rng) == []  # the only response token has nothing after it
    assert sample_anchors(5, 7, 10, rng) == [5]
    anchors = sample_anchors(3, 40, 8, rng)
    assert len(anchors) == 8 and anchors == sorted(set(anchors)) and all(3 <= a <= 38 for a in anchors)


def test_default_gamma_is_seven_for_blocks_of_sixteen():
    assert default_gamma(16) == pytest.approx(7.0)
    assert default_gamma(8) == pytest.approx(7.0 * 7 / 15)


def _tiny_drafter() -> DFlashDraftModel:
    config = DFlashConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=100,
        max_position_embeddings=128,
        block_size=4,
        num_target_layers=4,
        mask_token_id=MASK,
        target_layer_ids=[1, 2],
    )
    torch.manual_seed(0)
    return DFlashDraftModel(config).to(torch.float64).eval()


def test_no_leakage_through_a_real_drafter_forward():
    """Changing context at or after an anchor, or another block's tokens, leaves a block's outputs unchanged."""
    drafter = _tiny_drafter()
    embed = torch.randn(100, 32, dtype=torch.float64)
    seq = list(range(20, 40))  # N = 20
    anchors = [6, 11, 15]
    batch = build_block_batch([seq], [anchors], 4, MASK)
    features = torch.randn(1, 19, 64, dtype=torch.float64)

    def run(f, block_ids):
        ctx = drafter.project_context(f)
        return drafter(
            torch.nn.functional.embedding(block_ids, embed),
            ctx,
            batch.block_positions,
            batch.context_positions,
            batch.attention_mask,
        )

    base = run(features, batch.block_token_ids)
    # context at the anchor position and later: block 1 (anchor 11) must not see it, block 0 (anchor 6) neither
    changed = features.clone()
    changed[0, 11:] += 5.0
    out = run(changed, batch.block_token_ids)
    assert torch.equal(out[0, :8], base[0, :8])
    assert not torch.allclose(out[0, 8:], base[0, 8:])  # block 2 (anchor 15) sees positions 11..14
    # another block's anchor token
    ids = batch.block_token_ids.clone()
    ids[0, 4] = 77
    out = run(features, ids)
    assert torch.equal(out[0, :4], base[0, :4]) and torch.equal(out[0, 8:], base[0, 8:])
    assert not torch.allclose(out[0, 4:8], base[0, 4:8])


def test_simulated_chain_rounds_count_accepted_prefixes():
    tokens = [1, 2, 3, 4, 5, 6, 7]
    first_anchor = 1  # tokens 2..6 (positions 2..6) are to be produced
    # drafts at anchors 1..5 for offsets 1..2; anchor 1 drafts [3, 4] (both right), anchor 4 drafts [9, 9]
    ids = torch.tensor([[[3], [4]], [[0], [0]], [[0], [0]], [[9], [9]], [[7], [0]]])
    values = torch.zeros_like(ids, dtype=torch.float32)
    # round 1 at anchor 1 accepts 2 (commits 3, 4 and the bonus 5 -> anchor 4); round 2 accepts 0 -> anchor 5;
    # round 3 at anchor 5 accepts 7 (the last token) -> done
    assert simulate_rounds(tokens, first_anchor, ids, values, None) == 3


def test_lr_schedule_warms_up_then_anneals_to_zero_by_steps_or_by_deadline():
    from ddtree.training.train import TrainConfig, lr_factor, training_progress

    assert lr_factor(0.02, 0.04) == pytest.approx(0.5)
    assert lr_factor(0.04, 0.04) == pytest.approx(1.0)
    assert lr_factor(0.52, 0.04) == pytest.approx(0.5)
    assert lr_factor(1.0, 0.04) == pytest.approx(0.0)
    by_steps = TrainConfig(out_dir="x", max_steps=100)
    assert training_progress(25, 5.0, by_steps) == pytest.approx(0.25)
    by_time = TrainConfig(out_dir="x", max_steps=100, max_hours=2.0)
    assert training_progress(25, 1.0, by_time) == pytest.approx(0.5)  # the deadline comes first
    assert training_progress(90, 1.0, by_time) == pytest.approx(0.9)
    assert training_progress(90, 3.0, by_time) == 1.0
