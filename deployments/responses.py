"""The OpenAI wire protocol, responses: completion and chat bodies, stream chunks, usage and log-probabilities.

The requests are deployments/protocol.py. `usage.ddtree` (the request's acceptance statistics) is an extension, as
vLLM adds its own.
"""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def openai_finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "stop"}.get(reason, reason) if reason else None


@dataclass
class UsageInfo:
    prompt_tokens: int
    completion_tokens: int
    ddtree: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "ddtree": self.ddtree,
        }


def usage_of(final_outputs: list, speculation: str) -> UsageInfo:
    """Token counts and acceptance statistics of a request's finished `RequestOutput`s (one per prompt): counts
    summed; the per-round lists in prompt order, the mean over all of their rounds; the first token's time the
    earliest, the latency the longest."""
    stats = [o.stats.to_dict() for o in final_outputs]
    if len(stats) == 1:
        ddtree = stats[0]
    else:
        lengths = [n for s in stats for n in s["acceptance_lengths"]]
        first_times = [s["time_to_first_token_s"] for s in stats if s["time_to_first_token_s"] is not None]
        latencies = [s["latency_s"] for s in stats if s["latency_s"] is not None]
        ddtree = {
            "acceptance_lengths": lengths,
            "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else None,
            "budgets": [b for s in stats for b in s["budgets"]],
            **{
                key: sum(s[key] for s in stats)
                for key in ("num_speculative_rounds", "num_autoregressive_rounds", "num_ngram_tokens")
            },
            "time_to_first_token_s": min(first_times) if first_times else None,
            "latency_s": max(latencies) if latencies else None,
        }
    return UsageInfo(
        prompt_tokens=sum(len(o.prompt_token_ids) for o in final_outputs),
        completion_tokens=sum(len(o.token_ids) for o in final_outputs),
        ddtree={"speculation": speculation, **ddtree},
    )


class TextOffsets:
    """Where tokens start in the completion text, in characters: from their bytes, decoded incrementally (a
    character split across tokens starts at the offset of the token holding its first byte; the next ones share
    it). One per response, or per stream across its chunks."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def take(self, token_logprobs: list) -> list[int]:
        offsets = []
        for lp in token_logprobs:
            token_bytes = _token_bytes(lp)
            pending, _ = self.decoder.getstate()
            # Bytes an earlier token left pending that this one does not continue (an invalid sequence) come out
            # now, as replacement characters, before this token's own text: they are not this token's.
            abandoned = pending and not _continues_utf8(pending, token_bytes)
            offsets.append(self.num_chars + (len(pending.decode("utf-8", errors="replace")) if abandoned else 0))
            self.num_chars += len(self.decoder.decode(token_bytes))
        return offsets


def _continues_utf8(pending: bytes, token_bytes: bytes) -> bool:
    """Whether the token's first byte continues the incomplete UTF-8 sequence `pending` (or it has no bytes)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(pending + token_bytes[:1])
    except UnicodeDecodeError:
        return False
    return True


def _token_bytes(lp) -> bytes:
    return lp.token_bytes if lp.token_bytes is not None else lp.text.encode()


def completion_logprobs(token_logprobs: list | None, offsets: TextOffsets | None = None) -> dict | None:
    """The legacy completions `logprobs` object for `ddtree.TokenLogprobs` (None: not asked); `offsets`: the text
    offsets of a stream's earlier chunks (None: these tokens start the completion)."""
    if token_logprobs is None:
        return None
    offsets = (offsets or TextOffsets()).take(token_logprobs)
    return {
        "tokens": [lp.text for lp in token_logprobs],
        "token_logprobs": [lp.logprob for lp in token_logprobs],
        # the k most likely, and the generated token (OpenAI: up to logprobs + 1 entries)
        "top_logprobs": [
            {text: value for _, text, value in lp.top}
            | ({} if any(t == lp.token_id for t, _, _ in lp.top) else {lp.text: lp.logprob})
            for lp in token_logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(token_logprobs: list | None) -> dict | None:
    """The chat `logprobs` object ({"content": [...]}) for `ddtree.TokenLogprobs` (None: not asked)."""
    if token_logprobs is None:
        return None

    def entry(text: str, value: float, raw: bytes) -> dict:
        return {"token": text, "logprob": value, "bytes": list(raw)}

    def top(lp) -> list[dict]:
        raws = lp.top_bytes if lp.top_bytes is not None else [t.encode() for _, t, _ in lp.top]
        return [entry(t, v, raw) for (_, t, v), raw in zip(lp.top, raws)]

    return {
        "content": [{**entry(lp.text, lp.logprob, _token_bytes(lp)), "top_logprobs": top(lp)} for lp in token_logprobs]
    }


class StreamLogprobs:
    """A stream's log-probabilities: those of tokens generated since the last chunk (some of their text may still
    be held back, while it could begin a stop string) travel with the next chunk sent. Completion offsets count the
    text of the tokens sent before, as in the whole response."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.pending: list = []
        self.offsets = TextOffsets()

    def add(self, new_logprobs: list | None) -> None:
        self.pending += new_logprobs or []

    def take(self) -> dict:
        taken, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs(taken)
        return completion_logprobs(taken, self.offsets)


def completion_body(
    request_id: str, model: str, choices: list[tuple[str, str | None, list | None]], usage: UsageInfo
) -> dict:
    """`choices`: per prompt of the request, in order, (text, finish reason, log-probabilities or None)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": text,
                "finish_reason": openai_finish_reason(finish_reason),
                "logprobs": completion_logprobs(logprobs),
            }
            for i, (text, finish_reason, logprobs) in enumerate(choices)
        ],
        "usage": usage.body(),
    }


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage: UsageInfo, logprobs: list | None = None
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": openai_finish_reason(finish_reason),
                "logprobs": chat_logprobs(logprobs),
            }
        ],
        "usage": usage.body(),
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    include_usage: bool,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    chunk = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "text": text, "finish_reason": openai_finish_reason(finish_reason), "logprobs": logprobs}
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason: str | None,
    include_usage: bool,
    logprobs: dict | None = None,
) -> dict:
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "finish_reason": openai_finish_reason(finish_reason), "logprobs": logprobs}
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, object_name: str, usage: UsageInfo) -> dict:
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.body(),
    }


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "ddtree"}]}
