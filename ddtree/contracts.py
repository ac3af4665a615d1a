"""The engine's contract with its two workers.

The engine calls a target and a drafter through these methods only. The in-process workers (ddtree.workers:
`TargetWorker`, `DrafterWorker`) satisfy them, and so do the actor proxies (deployments/proxies.py: `TargetProxy`,
`DrafterProxy`), which is how the Serve app places the same engine over two actors. The round's two large calls are
submitted (`*_async`) and read later (`Pending.result()`), so that on actors a draft and a verify can overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ddtree.sampling_params import SamplingParams
    from ddtree.tree import DraftTree
    from ddtree.workers import PrefillResult


@runtime_checkable
class Pending(Protocol):
    """A call submitted to a worker. `seconds` (inside the worker) and `wall_seconds` (what the call cost its caller,
    an actor call's hops included) are known once `result()` has returned."""

    seconds: float
    wall_seconds: float

    def result(self) -> Any: ...


@runtime_checkable
class Target(Protocol):
    """The target model, its KV cache and sampling state. Raises `ddtree.workers.WorkerLostError` when its worker is
    gone."""

    can_overlap: bool  # its calls run on other cores or devices than the drafter's
    max_model_len: int
    max_request_tokens: int  # one request's largest KV reservation
    eos_token_ids: list[int]
    vocab_size: int

    def allocate(self, request_id: str, max_tokens: int, params: SamplingParams) -> bool:
        """Reserve KV for a request; False when it does not fit now (the request waits)."""

    def allocate_many(self, requests: list[tuple[str, int, SamplingParams]]) -> int:
        """`allocate` for each (request_id, max_tokens, params) in order, stopping at the first that does not fit;
        how many got their KV (one call for a round's admissions)."""

    def prefill(self, request_ids: list[str], prompts: list[list[int]]) -> PrefillResult: ...

    def verify_async(
        self,
        request_ids: list[str],
        trees: list[DraftTree | None],
        root_token_ids: list[int],
        prompt_ids: list[str] = (),
        prompts: list[list[int]] = (),
    ) -> Pending:
        """ONE forward over every request's root and tree (None: the root alone), and the prompts of newly admitted
        `prompt_ids` (kept whole: their first tokens in `VerifyResult.prefilled`); `result()` is a `VerifyResult`."""

    def take_features(self, request_ids: list[str]) -> list[torch.Tensor] | None:
        """The target features the drafter needs before drafting these requests (None: the target sends them)."""

    def free(self, request_id: str) -> None: ...

    def measure_verify_cost(self, token_counts: list[int]) -> list[tuple[int, float]]: ...

    def measure_batch_cost(self, request_counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of a verify pass over R one-token requests, for each R (`measure_batch_cost_curve`)."""


@runtime_checkable
class Drafter(Protocol):
    """The DFlash drafter and its per-request context caches. Raises `WorkerLostError` when its worker is gone."""

    can_overlap: bool
    block_len: int

    def draft_async(
        self, request_ids: list[str], root_token_ids: list[int], new_features: list[torch.Tensor] | None, max_k: int
    ) -> Pending:
        """ONE forward for all requests; `result()` is (top-K log-probs [R, L, K], token ids [R, L, K])."""

    def free(self, request_id: str) -> None: ...

    def measure_draft_cost(self, batch_sizes: list[int], max_k: int) -> list[tuple[int, float]]: ...
