"""One round's record: per request, what it drafts, what the verify pass checks and what the target answered.

Every stage of `Engine.step` takes the round's `RoundBatch` and fills in its part of each entry, so no stage
depends on the order in which another one listed the requests. Entries that draft come first, in the order the
budget policy planned them: that is the order of the drafter's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ddtree.budget import RoundPlan
from ddtree.tree import DraftTree
from ddtree.workers import RawLogprobs, VerifyResult


@dataclass
class RoundEntry:
    request_id: str
    root_token_id: int  # the last committed token: the root of the tree, the first token of the verify pass
    max_budget: int = 0  # nodes the tree builder may draft; 0: the request does not draft this round
    # Open: the tree is still to be chosen (drafted, or an n-gram chain in auto mode). Closed: `tree` is final,
    # and the entry only takes its place in the verify pass.
    is_open: bool = True
    chain: list[int] | None = None  # the n-gram proposal made this round, whether or not the allocation kept it
    tree: DraftTree | None = None  # the nodes verified beyond the root; None: the root alone
    predicted: float = 0.0  # the tree's expected accepted nodes, S(b), uncalibrated
    # What the verify pass answered
    accepted: list[int] = field(default_factory=list)  # tokens of the accepted nodes
    bonus: int | None = None  # the target's own token after them
    logprobs: RawLogprobs | None = None

    @property
    def drafts(self) -> bool:
        return self.max_budget > 0

    @property
    def num_tokens(self) -> int:
        """Tokens the entry puts into the verify pass."""
        return 1 + (self.tree.num_nodes if self.tree is not None else 0)


@dataclass
class RoundBatch:
    entries: list[RoundEntry]
    arm: str | None = None  # the throughput guard's choice for the round (sequential rounds in auto mode)
    started_at: float = 0.0  # time.perf_counter() when the round was scheduled
    # a round of the policy in which a request drafts for the first time since the guard ran it in plain rounds: the
    # draft call also takes in that request's features of every plain round since (a cost of switching arms, not
    # of the round's own work)
    resumes_drafting: bool = False
    draft_seconds: float | None = None  # what the drafter call cost the round (None: nothing drafted)
    num_drafting: int = 0  # rows of that drafter call
    verify_seconds: float = 0.0  # what the verify call cost the round
    num_verified_tokens: int = 0  # packed tokens of the verify pass, prompts included
    # Newly admitted requests whose prompts the verify pass takes in whole, and what it answered: their first tokens
    prompt_ids: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # their token ids, in the order of `prompt_ids`
    first_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[RawLogprobs | None] = field(default_factory=list)

    @classmethod
    def from_plan(cls, plan: RoundPlan, roots: dict[str, int], **kwargs) -> RoundBatch:
        drafting = [RoundEntry(r, roots[r], b) for r, b in zip(plan.speculative_ids, plan.max_budgets)]
        return cls(drafting + [RoundEntry(r, roots[r]) for r in plan.autoregressive_ids], **kwargs)

    @property
    def request_ids(self) -> list[str]:
        return [e.request_id for e in self.entries]

    @property
    def num_verified_requests(self) -> int:
        """Requests in the verify pass: the entries and the admitted prompts."""
        return len(self.entries) + len(self.prompts)

    @property
    def drafting(self) -> list[RoundEntry]:
        return [e for e in self.entries if e.drafts]

    @property
    def speculates(self) -> bool:
        """Whether the round did anything plain decoding does not: a drafter call, or nodes beyond a root."""
        return any(e.drafts or (e.tree is not None and e.tree.num_nodes > 0) for e in self.entries)

    def open_plan(self) -> RoundPlan:
        """The open entries as the budget policy plans them: drafting ones, then chain candidates."""
        drafting = [e for e in self.entries if e.is_open and e.drafts]
        plain = [e for e in self.entries if e.is_open and not e.drafts]
        return RoundPlan(
            [e.request_id for e in drafting], [e.request_id for e in plain], [e.max_budget for e in drafting]
        )

    def closed_load(self) -> tuple[int, float, int]:
        """What the closed entries and the prompts put into the verify pass: tokens, the tokens they are expected to
        commit (a prompt commits its first token), and requests."""
        closed = [e for e in self.entries if not e.is_open]
        num_tokens = sum(e.num_tokens for e in closed) + sum(len(p) for p in self.prompts)
        expected = sum(1 + e.predicted for e in closed) + len(self.prompt_ids)
        return num_tokens, expected, len(closed) + len(self.prompt_ids)

    def close(self) -> None:
        for e in self.entries:
            e.is_open = False

    def without(self, request_ids: set[str]) -> RoundBatch | None:
        """The batch minus some requests (aborted while it waits for its verify); None when nothing is left."""
        entries = [e for e in self.entries if e.request_id not in request_ids]
        if not entries:
            return None
        return replace(self, entries=entries)

    def record(self, result: VerifyResult, seconds: float) -> None:
        """The verify pass's answer, one per entry in order."""
        answers = zip(result.accepted_token_ids, result.bonus_token_ids, result.logprobs)
        for e, (accepted, bonus, logprobs) in zip(self.entries, answers):
            e.accepted, e.bonus, e.logprobs = accepted, bonus, logprobs
        self.verify_seconds, self.num_verified_tokens = seconds, result.num_tokens
        if result.prefilled is not None:
            self.first_token_ids, self.first_logprobs = result.prefilled.token_ids, result.prefilled.logprobs
