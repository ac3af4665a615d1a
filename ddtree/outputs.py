"""What the engine hands back: per-request outputs, final or incremental."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class RequestStats:
    # per speculative round: the tokens it committed, bonus token included (tokens accepted past a stop are not)
    acceptance_lengths: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # nodes verified per speculative round
    num_autoregressive_rounds: int = 0
    num_speculative_rounds: int = 0
    num_ngram_tokens: int = 0  # tokens accepted from n-gram chains in rounds without a draft (fallback)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    def to_dict(self) -> dict:
        return {
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_acceptance_length": self.mean_acceptance_length,
            "budgets": list(self.budgets),
            "num_speculative_rounds": self.num_speculative_rounds,
            "num_autoregressive_rounds": self.num_autoregressive_rounds,
            "num_ngram_tokens": self.num_ngram_tokens,
            "time_to_first_token_s": None
            if self.first_token_time is None
            else self.first_token_time - self.arrival_time,
            "latency_s": None if self.finish_time is None else self.finish_time - self.arrival_time,
        }


@dataclass
class TokenLogprobs:
    """Log-probabilities at one generated token, under the target's own distribution (its raw logits, before
    temperature, top-k and top-p, as vLLM reports them by default): the token's, and the `logprobs` most likely
    tokens', most likely first (`(token_id, text, logprob)`). `text` is the token's own decode (U+FFFD for part of a
    multi-byte character); `token_bytes` and `top_bytes` are the bytes of text the tokens stand for (joined over
    the output's tokens: its UTF-8)."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)
    token_bytes: bytes | None = None  # None: text.encode()
    top_bytes: list[bytes] | None = None  # per entry of `top`; None: their texts' encode()


@dataclass
class RequestOutput:
    """A request's state after a step. `new_text`/`new_token_ids` are what this step added (for streaming);
    `text`/`token_ids` are everything generated so far."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop string or stop token), "length", "abort"
    stats: RequestStats
    # with SamplingParams.logprobs: one per token of `token_ids` / `new_token_ids`; None otherwise
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # the engine left the text to its consumer (`Engine(detokenize=False)`): `text` and `new_text` are empty until
    # a `ddtree.detokenizer.TextDecoder` fills them (`TextDecoder.fill`)
    text_pending: bool = False

    @property
    def acceptance_lengths(self) -> list[int]:
        return self.stats.acceptance_lengths

    def following(self, earlier: RequestOutput) -> RequestOutput:
        """This output with `earlier`'s increment in front of its own: one output for two steps (a stream that
        sends fewer, larger chunks)."""
        new_logprobs = None
        if earlier.new_logprobs is not None or self.new_logprobs is not None:
            new_logprobs = (earlier.new_logprobs or []) + (self.new_logprobs or [])
        return replace(
            self,
            new_text=earlier.new_text + self.new_text,
            new_token_ids=earlier.new_token_ids + self.new_token_ids,
            new_logprobs=new_logprobs,
        )

    def increment(self) -> RequestOutput:
        """This step's part only (`new_text`, `new_token_ids`), without the cumulative fields: what a stream sends
        before the final output, so that a long answer's stream does not resend everything every round."""
        return RequestOutput(
            self.request_id,
            [],
            "",
            [],
            self.new_text,
            list(self.new_token_ids),
            self.finished,
            self.finish_reason,
            RequestStats(),
            new_logprobs=self.new_logprobs,
            text_pending=self.text_pending,
        )
