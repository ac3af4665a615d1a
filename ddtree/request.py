"""A request inside the engine: its checks on the way in, and how committed tokens become its outputs (text,
log-probabilities)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ddtree.detokenizer import Detokenizer, OutputState
from ddtree.ngram import NgramIndex
from ddtree.outputs import RequestOutput, RequestStats, TokenLogprobs
from ddtree.sampling_params import SamplingParams
from ddtree.workers import RawLogprobs


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context window (HTTP 400/413)."""


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids: with the tokenizer's own special tokens (BOS for Llama/Mistral), as Hugging Face
    and vLLM encode a prompt."""
    return tokenizer.encode(text, add_special_tokens=True)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output: OutputState
    stats: RequestStats
    root_token_id: int | None = None  # last committed token, not yet in the KV cache
    ngrams: NgramIndex | None = None  # prompt + committed tokens (auto mode with ngram_tokens > 0)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per committed token (SamplingParams.logprobs)
    text_started: bool = False  # a committed token decoded to something (special tokens do not): logprobs' bytes
    # the engine decodes the text (else its consumer does, `TextDecoder`: no stop string, no log-probabilities)
    decodes_text: bool = True

    @property
    def tokens_left(self) -> int:
        return self.output.max_new_tokens - len(self.output.token_ids)

    def to_output(
        self, new_text: str, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None, finished: bool
    ) -> RequestOutput:
        asked_logprobs = self.output.params.logprobs is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            text=self.output.text if finished else self.output.text[: self.output.num_text_emitted],
            token_ids=list(self.output.token_ids),
            new_text=new_text,
            new_token_ids=list(new_token_ids),
            finished=finished,
            finish_reason=self.output.finish_reason,
            stats=self.stats,
            logprobs=list(self.logprobs) if asked_logprobs else None,
            new_logprobs=list(new_logprobs or []) if asked_logprobs else None,
            text_pending=not self.decodes_text,
        )


@dataclass
class Committed:
    """What one commit added to a request: the tokens kept (none past a stop), their text, their log-probabilities."""

    token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs] | None


class OutputWriter:
    """Commits tokens to requests: stops applied token by token, text decoded incrementally, and each kept token's
    log-probabilities with its text and bytes."""

    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        # A token's text for log-probabilities (up to 21 per generated token): decoded once per token id.
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: self.detokenizer.decode([token_id]))
        self._token_bytes = functools.lru_cache(maxsize=1 << 16)(self.detokenizer.token_bytes)

    def commit(self, req: Request, tokens: list[int], logprobs: RawLogprobs | None = None) -> Committed:
        if req.decodes_text:
            kept = self.detokenizer.append(req.output, tokens)
        else:  # (its consumer decodes the text: `TextDecoder`)
            kept = self.detokenizer.append_tokens(req.output, tokens)
        if req.ngrams is not None:
            req.ngrams.extend(kept)
        req.root_token_id = kept[-1] if kept else req.root_token_id
        if not req.decodes_text:
            return Committed(kept, "", None)
        new_logprobs = None
        if req.output.params.logprobs is not None:
            new_logprobs = self.token_logprobs(kept, logprobs, at_text_start=not req.text_started)
            req.logprobs.extend(new_logprobs)
            req.text_started = req.text_started or any(lp.token_bytes for lp in new_logprobs)
        return Committed(kept, self.detokenizer.take_new_text(req.output), new_logprobs)

    def token_logprobs(self, kept: list[int], raw: RawLogprobs | None, at_text_start: bool) -> list[TokenLogprobs]:
        """The worker's numbers for the kept tokens, with each token's text and bytes (`at_text_start`: the output
        has no text before them)."""
        if raw is None or len(raw.chosen) < len(kept):
            raise RuntimeError("the target worker returned no log-probabilities for a request that asked for them")
        text = self._token_text
        out = []
        for k, token_id in enumerate(kept):
            token_bytes = self._bytes(token_id, at_text_start)
            top = [(t, text(t), v) for t, v in zip(raw.top_ids[k], raw.top_values[k])]
            top_bytes = [self._bytes(t, at_text_start) for t in raw.top_ids[k]]
            out.append(TokenLogprobs(token_id, text(token_id), raw.chosen[k], top, token_bytes, top_bytes))
            at_text_start = at_text_start and not token_bytes
        return out

    def _bytes(self, token_id: int, at_text_start: bool) -> bytes:
        raw_bytes = self._token_bytes(token_id)
        if at_text_start:
            # The spaces a decode drops at the start of a text (SentencePiece: the first word's one) are not in the
            # output's text either: the bytes join into the text as decoded.
            own = self._token_text(token_id)
            drop = (len(raw_bytes) - len(raw_bytes.lstrip(b" "))) - (len(own) - len(own.lstrip(" ")))
            if drop > 0:
                return raw_bytes[drop:]
        return raw_bytes


def validated(
    prompt: str | list[int], params: SamplingParams | None, tokenizer, vocab_size: int, max_model_len: int
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and a checked copy of the params, or a clear error (ValueError, PromptTooLongError)."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    # A copy, validated again: fields may have been set after construction (or unpickled, which skips
    # __post_init__), and a bad value found in the middle of a round would fail every request in it.
    params = replace(params)
    if isinstance(prompt, str):
        prompt_token_ids = encode_prompt(tokenizer, prompt)
    elif isinstance(prompt, (list, tuple)):
        prompt_token_ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    else:
        raise ValueError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if max_model_len - len(prompt_token_ids) < 1:
        raise PromptTooLongError(
            f"the prompt has {len(prompt_token_ids)} tokens; the context window is {max_model_len}"
        )
    return prompt_token_ids, params
