"""The training loss and its statistics on a tiny random target: the weighted cross-entropy over the softmax
vocabulary, accuracy as the argmax would count it, and the restricted (sampled) softmax's columns."""

import random

import pytest
import torch
import torch.nn.functional as F

from ddtree.models.dflash import DFlashDraftModel
from ddtree.training.blocks import build_block_batch, sample_anchors
from ddtree.training.target import load_target
from ddtree.training.train import FrozenTargetHead, TrainConfig, block_loss, drafter_config_for, label_is_top


@pytest.fixture(scope="module")
def setup(tiny_target):
    target_model, _ = load_target(str(tiny_target), dtype=torch.float32)
    config = drafter_config_for(
        target_model.config,
        TrainConfig(out_dir="unused", num_draft_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=1),
    )
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config)
    head = FrozenTargetHead(target_model)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (14, 20, 9)]
    rng = random.Random(0)
    anchors = [sample_anchors(3, len(s), 4, rng) for s in sequences]
    batch = build_block_batch(sequences, anchors, config.block_size, config.mask_token_id)
    c = max(len(s) - 1 for s in sequences)
    features = torch.randn(len(sequences), c, config.num_target_features, generator=gen)
    return drafter, head, features, batch, sequences


def _labelled_hidden(drafter, head, features, batch):
    """The drafter's output at the labelled rows [M, H], computed directly."""
    return drafter(
        head.embed(batch.block_token_ids),
        drafter.project_context(features),
        batch.block_positions,
        batch.context_positions,
        batch.attention_mask,
    ).flatten(0, 1)[batch.labelled_rows]


def _expected(drafter, head, features, batch, columns):
    hidden = _labelled_hidden(drafter, head, features, batch)
    labels = batch.labels.reshape(-1)[batch.labelled_rows]
    logits = hidden @ head.lm_head_weight[columns].T
    label_columns = torch.searchsorted(columns, labels)
    weights = batch.loss_weights.reshape(-1)[batch.labelled_rows]
    ce = F.cross_entropy(logits, label_columns, reduction="none")
    is_correct = logits.argmax(-1) == label_columns
    is_k1 = batch.block_offsets.reshape(-1)[batch.labelled_rows] == 1
    return (ce * weights).sum() / weights.sum(), is_correct.float().mean(), (is_correct & is_k1).sum() / is_k1.sum()


@torch.no_grad()
def test_full_and_restricted_softmax_loss_and_accuracy(setup):
    drafter, head, features, batch, sequences = setup
    head.restrict_softmax(None)
    loss, stats = block_loss(drafter, head, features, batch)
    expected = _expected(drafter, head, features, batch, torch.arange(head.vocab_size))
    for got, want in zip((loss, stats["acc"], stats["acc_k1"]), expected):
        torch.testing.assert_close(got, want)
    # restricted to the response tokens, no negatives: the softmax over exactly those columns
    response_tokens = torch.tensor(sorted({t for s in sequences for t in s[3:]}))
    head.restrict_softmax(response_tokens, num_negatives=0)
    loss, stats = block_loss(drafter, head, features, batch)
    expected = _expected(drafter, head, features, batch, response_tokens)
    for got, want in zip((loss, stats["acc"], stats["acc_k1"]), expected):
        torch.testing.assert_close(got, want)
    head.restrict_softmax(None)


@torch.no_grad()
def test_the_soft_target_term_is_the_cross_entropy_against_the_targets_top_k(setup):
    """loss = label CE + w x soft CE (both position-weighted); the soft CE is against the stored top-k
    distribution, renormalised over the tokens the step's softmax holds; the logged loss is the label CE alone. A
    one-hot target distribution on the label makes the soft term the label CE itself."""
    drafter, head, features, batch, sequences = setup
    weights = batch.loss_weights.reshape(-1)[batch.labelled_rows]
    labels = batch.labels.reshape(-1)[batch.labelled_rows]
    num_rows, k = labels.numel(), 4
    gen = torch.Generator().manual_seed(3)
    others = torch.randint(2, head.vocab_size, (num_rows, k - 1), generator=gen)
    top_ids = torch.cat([labels.unsqueeze(1), others], dim=1)  # the label first, as the greedy token is
    top_logprobs = torch.log_softmax(torch.randn(num_rows, k, generator=gen), dim=-1)
    response_tokens = torch.tensor(sorted({t for s in sequences for t in s[3:]}))
    for columns in (torch.arange(head.vocab_size), response_tokens):
        head.restrict_softmax(None if columns.numel() == head.vocab_size else columns, num_negatives=0)
        label_loss, _, _ = _expected(drafter, head, features, batch, columns)
        loss, stats = block_loss(drafter, head, features, batch, (top_ids, top_logprobs), 0.5)
        hidden = _labelled_hidden(drafter, head, features, batch)
        log_q = torch.log_softmax(hidden @ head.lm_head_weight[columns].T, dim=-1)  # [M, V']
        soft = torch.zeros(num_rows)
        for m in range(num_rows):
            kept = [j for j in range(k) if int(top_ids[m, j]) in set(columns.tolist())]
            p = torch.softmax(top_logprobs[m, kept], dim=-1)
            cols = torch.searchsorted(columns, top_ids[m, kept])
            soft[m] = -(p * log_q[m, cols]).sum()
        torch.testing.assert_close(loss, label_loss + 0.5 * (soft * weights).sum() / weights.sum())
        torch.testing.assert_close(stats["loss"], label_loss)
        one_hot = torch.full((num_rows, k), -30.0)
        one_hot[:, 0] = 0.0
        loss, _ = block_loss(drafter, head, features, batch, (top_ids, one_hot), 1.0)
        torch.testing.assert_close(loss, 2 * label_loss)
    head.restrict_softmax(None)


def test_a_label_outside_the_restricted_vocabulary_is_an_error(setup):
    _, head, _, _, _ = setup
    head.restrict_softmax(torch.tensor([5, 6, 7]), num_negatives=4)
    with pytest.raises(ValueError, match="outside the training data"):
        head.training_logits(torch.randn(2, head.embed_weight.shape[1]), torch.tensor([5, 9]))
    head.restrict_softmax(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_is_top_agrees_with_argmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen).to(dtype)
    labels = torch.randint(0, 300, (64,), generator=gen)
    labels[::2] = logits[::2].float().argmax(-1)  # half of the rows right
    assert torch.equal(label_is_top(logits, labels), logits.float().argmax(-1) == labels)
    assert int(label_is_top(logits, labels).sum()) >= 32
    tied = torch.tensor([[1.0, 3.0, 3.0], [0.0, 2.0, 1.0]], dtype=dtype)
    assert label_is_top(tied, torch.tensor([2, 2])).tolist() == [True, False]
