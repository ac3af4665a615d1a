"""The engine's settings: `EngineConfig`, plain values only (no torch), the one source of their defaults.

The offline `LLM` takes them as keyword arguments and the Serve app as args (`deployments/config.py: AppArgs`); both
take their defaults from here, and tests/test_serve_protocol.py fails when a field is missing from either.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.budget import check_max_probe_overhead, check_speculation_margin
from ddtree.guard import check_max_explore_share

SPECULATION_MODES = ("ddtree", "dflash", "off")


@dataclass
class EngineConfig:
    speculation: str = "ddtree"  # "ddtree" (draft trees), "dflash" (the drafter's argmax chain), "off"
    budget: int | str = "auto"  # "auto": adaptive per round; an int: fixed nodes per speculative request
    max_budget: int = 64  # cap per request in "auto" mode (and the drafter's top-K)
    max_num_seqs: int = 16  # requests decoded together
    max_waiting: int = 256  # queued requests beyond the free seats before add_request answers EngineFullError
    max_model_len: int | None = None  # None: the model's own context window
    allow_fallback: bool = True  # auto mode: requests whose drafts do not pay decode autoregressively
    max_probe_overhead: float = 0.03  # fallback probes may cost at most this fraction of a request's time
    # auto mode: a round speculates only where the policy predicts it faster than plain decoding by more than this
    # share (what the cost model and the acceptance estimates may err by)
    speculation_margin: float = 0.05
    # auto mode: up to this many n-gram (prompt lookup) tokens from the request's own history join its tree, or
    # form the tree of a request in fallback (no drafter call); the allocation keeps those that pay. 0: none.
    ngram_tokens: int = 3
    # Two request groups in flight: draft one while the target verifies the other (pays when the drafter has its
    # own device and the verify pass is compute-bound; docs/serving.md has measurements). "auto": when the cost
    # model predicts it faster and the workers run concurrently (on actors of their own; never in one process).
    pipeline: bool | str = "auto"
    # auto mode: the closed loop over the policy (guard.py) runs the faster of "as the policy plans" and plain
    # decoding per batch size, as measured, and the other in at most this share of the time. 0: the policy alone.
    max_explore_share: float = 0.03
    # A request still waiting for admission after this many seconds leaves unserved, finish_reason "queue_timeout"
    # (the server answers it with a retriable 503). None: it waits as long as it takes (offline, where the LLM
    # queues a whole batch; the Serve app bounds it: SERVE_DEFAULTS).
    max_queue_seconds: float | None = None
    # Prompts of newly admitted requests join the round's verify pass (one pass, one read of the weights, instead of
    # a prefill pass of their own) while they sum to at most this many tokens; past it, and when no other request
    # runs, they are prefilled in a pass of their own. 0: always a pass of their own.
    max_folded_prompt_tokens: int = 512

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        if self.budget != "auto" and not (isinstance(self.budget, int) and not isinstance(self.budget, bool)):
            raise ValueError(f"budget must be 'auto' or a positive integer, got {self.budget!r}")
        if isinstance(self.budget, int) and self.budget < 1:
            raise ValueError(f"budget must be 'auto' or a positive integer, got {self.budget!r}")
        check_max_probe_overhead(self.max_probe_overhead)
        check_speculation_margin(self.speculation_margin)
        if not isinstance(self.pipeline, bool) and self.pipeline != "auto":
            raise ValueError(f"pipeline must be true, false or 'auto', got {self.pipeline!r}")
        if isinstance(self.ngram_tokens, bool) or not isinstance(self.ngram_tokens, int) or self.ngram_tokens < 0:
            raise ValueError(f"ngram_tokens must be an integer >= 0, got {self.ngram_tokens!r}")
        if (
            isinstance(self.max_folded_prompt_tokens, bool)
            or not isinstance(self.max_folded_prompt_tokens, int)
            or self.max_folded_prompt_tokens < 0
        ):
            raise ValueError(f"max_folded_prompt_tokens must be an integer >= 0, got {self.max_folded_prompt_tokens!r}")
        for name in ("max_budget", "max_num_seqs", "max_waiting"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        check_max_explore_share(self.max_explore_share)
        if self.max_queue_seconds is not None and (
            isinstance(self.max_queue_seconds, bool)
            or not isinstance(self.max_queue_seconds, (int, float))
            or not self.max_queue_seconds > 0
        ):
            raise ValueError(f"max_queue_seconds must be a positive number or None, got {self.max_queue_seconds!r}")

    @property
    def fixed_budget(self) -> int | None:
        return None if self.budget == "auto" else int(self.budget)


# Where the Serve app's default differs from the engine's, and why: a client on a socket should hear that the
# server is overloaded, and retry, rather than wait without bound.
SERVE_DEFAULTS = {"max_queue_seconds": 60.0}
