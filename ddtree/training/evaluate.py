"""Offline acceptance length (tau) of a drafter against the target's greedy continuations (T=0).

For a prompt and the target's greedy response, speculative decoding is simulated exactly: a round anchored at
position p (the last committed token) drafts from the target features of positions < p; the chain accepts the
leading drafted tokens equal to the target's, a DDTree of budget B accepts the deepest tree path that matches
the target's continuation, and the round commits 1 + accepted tokens (the target's bonus token included). At T=0
the target's token after an accepted prefix is the greedy continuation's, so the simulation needs only one target
forward per sequence (its features) and one drafter forward at every anchor. tau = committed tokens / rounds.

The drafter forwards run where the drafter's weights are (a GPU with `--device cuda`); the top-k drafts come back
to the CPU once per sequence for the round simulation (a Python walk).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ddtree.models.dflash import DFlashDraftModel
from ddtree.training.blocks import build_block_batch
from ddtree.tree import build_tree_from_topk

DEFAULT_BUDGETS = (8, 16, 32, 64, 128)


@dataclass
class TauResult:
    category: str
    num_sequences: int = 0
    num_tokens: int = 0  # response tokens after the first (the ones speculation can produce)
    num_rounds_chain: int = 0
    num_rounds_tree: dict[int, int] = field(default_factory=dict)  # budget -> rounds

    @property
    def tau_chain(self) -> float:
        return self.num_tokens / max(1, self.num_rounds_chain)

    def tau_tree(self, budget: int) -> float:
        return self.num_tokens / max(1, self.num_rounds_tree.get(budget, 0))

    def summary(self) -> dict:
        return {
            "category": self.category,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "tau_chain": round(self.tau_chain, 3),
            **{f"tau_tree_B{b}": round(self.tau_tree(b), 3) for b in sorted(self.num_rounds_tree)},
        }


def load_for_evaluation(
    drafter_dir: Path,
    target: str = "smollm2-135m-instruct",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[DFlashDraftModel, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the offline evaluation needs: the drafter (in the dtype it is served in), the target's frozen input
    embedding and LM head, and the draft vocabulary's token ids (None: the full vocabulary), on `device`."""
    from ddtree.models.dflash import load_dflash, load_draft_vocab
    from ddtree.training.target import load_target

    _, drafter = load_dflash(drafter_dir, device=device, dtype=dtype)
    target_model, _ = load_target(target, dtype=dtype)
    embed = target_model.get_input_embeddings().weight.detach().to(device)
    lm_head = target_model.get_output_embeddings().weight.detach().to(device)
    del target_model
    draft_vocab = load_draft_vocab(drafter_dir, lm_head.shape[0])
    draft_token_ids = None if draft_vocab is None else torch.tensor(draft_vocab, device=device)
    return drafter, embed, lm_head, draft_token_ids


@torch.no_grad()
def draft_topk_at_every_anchor(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,  # [V, H] target input embedding
    lm_head_weight: torch.Tensor,  # [V, H] target LM head
    features: torch.Tensor,  # [N - 1, F] target features of positions 0..N-2
    token_ids: list[int],  # N tokens: prompt + response
    first_anchor: int,
    top_k: int,
    anchors_per_forward: int = 32,
    draft_token_ids: torch.Tensor | None = None,  # [Vd] the draft vocabulary (as served); None: the full vocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft log-probs at every anchor a in [first_anchor, N - 2]: values, ids [A, L - 1, k], on the
    drafter's device (features may come from the CPU)."""
    config = drafter.config
    weight = next(drafter.parameters())
    if draft_token_ids is not None:
        lm_head_weight = lm_head_weight[draft_token_ids]  # [Vd, H]
    anchors = list(range(first_anchor, len(token_ids) - 1))
    values, ids = [], []
    context = drafter.project_context(features.to(weight.device, weight.dtype).unsqueeze(0))  # [1, C, H]
    for start in range(0, len(anchors), anchors_per_forward):
        chunk = anchors[start : start + anchors_per_forward]
        batch = build_block_batch([token_ids], [chunk], config.block_size, config.mask_token_id).to(weight.device)
        block_hidden = torch.nn.functional.embedding(batch.block_token_ids, embed_weight)  # [1, S, H]
        hidden = drafter(
            block_hidden, context, batch.block_positions, batch.context_positions, batch.attention_mask
        )  # [1, S, H]
        hidden = hidden.view(len(chunk), config.block_size, -1)[:, 1:]  # [A, L - 1, H]
        logprobs = torch.log_softmax((hidden @ lm_head_weight.T).float(), dim=-1)  # [A, L - 1, V]
        v, i = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        values.append(v)
        ids.append(i if draft_token_ids is None else draft_token_ids[i])
    return torch.cat(values), torch.cat(ids)


def simulate_rounds(
    token_ids: list[int],
    first_anchor: int,
    topk_ids: torch.Tensor,
    topk_values: torch.Tensor,
    budget: int | None,
) -> int:
    """Number of speculative rounds to produce tokens first_anchor+1..N-1; budget None = chain (top-1 path)."""
    n = len(token_ids)
    p, num_rounds = first_anchor, 0
    while p < n - 1:
        row = p - first_anchor
        target_next = token_ids[p + 1 :]
        if budget is None:
            accepted = 0
            for k, token in enumerate(topk_ids[row, :, 0].tolist()):
                if k >= len(target_next) or token != target_next[k]:
                    break
                accepted += 1
        else:
            accepted = _tree_accepted(topk_values[row], topk_ids[row], budget, target_next)
        num_rounds += 1
        p += 1 + accepted
    return num_rounds


def _tree_accepted(values: torch.Tensor, ids: torch.Tensor, budget: int, target_next: list[int]) -> int:
    tree = build_tree_from_topk(values, ids, budget)
    return accepted_length(tree.token_ids.tolist(), tree.parents.tolist(), target_next)


def accepted_length(token_ids: list[int], parents: list[int], target_next: list[int]) -> int:
    """How deep a tree (nodes' tokens and parents, -1 for the root's children) follows the target's continuation."""
    children: dict[int, dict[int, int]] = {}
    for node, (parent, token) in enumerate(zip(parents, token_ids)):
        children.setdefault(parent, {})[token] = node
    node, depth = -1, 0
    while depth < len(target_next):
        node = children.get(node, {}).get(target_next[depth])
        if node is None:
            break
        depth += 1
    return depth


def load_evaluation_set(data_dir: Path, drafter: DFlashDraftModel, max_sequences: int | None = None):
    """(sequences, feature reader) of one evaluation category's data folder (`train-drafter eval-data`)."""
    from ddtree.training.data import FeatureReader, read_sequences, stored_layer_ids

    sequences = read_sequences(data_dir)[:max_sequences]
    if not sequences:
        raise ValueError(f"no evaluation data in {data_dir}: run `ddtree train-drafter eval-data` first")
    return sequences, FeatureReader(data_dir, stored_layer_ids(data_dir), drafter.config.target_layer_ids)


def drafts_of_sequences(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sequences: list,
    read_features,
    top_k: int,
    draft_token_ids: torch.Tensor | None = None,
):
    """For every sequence with a response to speculate on: (sequence, first anchor, values, ids) of
    `draft_topk_at_every_anchor` (on the CPU), the first anchor being the prompt's last token."""
    for seq in sequences:
        first_anchor = seq.prompt_length  # the first response token comes from prefill, not from a draft
        if len(seq.token_ids) - 1 <= first_anchor:
            continue
        values, ids = draft_topk_at_every_anchor(
            drafter,
            embed_weight,
            lm_head_weight,
            read_features(seq),
            seq.token_ids,
            first_anchor,
            top_k,
            draft_token_ids=draft_token_ids,
        )
        yield seq, first_anchor, values.cpu(), ids.cpu()  # one copy per sequence: the simulations walk them in Python


def evaluate_tau(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sequences: list,  # ddtree.training.data.Sequence
    read_features,  # Sequence -> [N - 1, F]
    category: str,
    budgets: tuple[int, ...] = DEFAULT_BUDGETS,
    draft_token_ids: torch.Tensor | None = None,
) -> TauResult:
    result = TauResult(category, num_rounds_tree={b: 0 for b in budgets})
    top_k = min(max(budgets, default=1), lm_head_weight.shape[0])
    for seq, first_anchor, values, ids in drafts_of_sequences(
        drafter, embed_weight, lm_head_weight, sequences, read_features, top_k, draft_token_ids
    ):
        result.num_sequences += 1
        result.num_tokens += len(seq.token_ids) - 1 - first_anchor
        result.num_rounds_chain += simulate_rounds(seq.token_ids, first_anchor, ids, values, None)
        for b in budgets:
            result.num_rounds_tree[b] += simulate_rounds(seq.token_ids, first_anchor, ids, values, b)
    return result


def format_table(results: list[TauResult], budgets: tuple[int, ...] = DEFAULT_BUDGETS) -> str:
    header = "| category | seqs | tokens | tau chain | " + " | ".join(f"tau B={b}" for b in budgets) + " |"
    lines = [header, "|" + "---|" * (4 + len(budgets))]
    for r in results:
        lines.append(
            f"| {r.category} | {r.num_sequences} | {r.num_tokens} | {r.tau_chain:.2f} | "
            + " | ".join(f"{r.tau_tree(b):.2f}" for b in budgets)
            + " |"
        )
    return "\n".join(lines)


def write_results(path: Path, results: list[TauResult], extra: dict) -> None:
    path.write_text(json.dumps({**extra, "results": [r.summary() for r in results]}, indent=1))


__all__ = ["TauResult", "evaluate_tau", "format_table", "write_results", "asdict"]
