"""Per-request sampling parameters (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this decode greedily (vLLM's epsilon): logits divided by a smaller one overflow float32, and
# the "sample" would be whichever of the infinite scores argmax meets first.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most likely tokens reported per generated token (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (0..20)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, (list, tuple)), name, "a list", value)
            setattr(self, name, list(value or []))
        _check(
            _is_number(self.temperature) and 0 <= self.temperature < math.inf,
            "temperature",
            f"a finite number >= 0 (below {GREEDY_TEMPERATURE}: greedy)",
            self.temperature,
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)", self.top_k)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of integers >= 0",
            self.stop_token_ids,
        )
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(
            self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"None or an integer in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
