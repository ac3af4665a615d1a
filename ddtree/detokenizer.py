"""Turning accepted tokens into text, with every stop condition applied token by token.

A round can accept several tokens at once; anything accepted past a stop is discarded, and a stop string is never
emitted (streamed text holds back any tail that could still become the start of a stop string).

Decoding is incremental (as vLLM does it): each round decodes only the tokens since the last text it could
complete, with a few tokens of left context (`prefix_offset`..`read_offset`) so that tokenizers which drop a word's
leading space at the start of a decode (SentencePiece) or need more bytes to finish a character (byte-level BPE)
give the same text as decoding everything; a round whose tokens end inside a character adds no text until the
character is complete, and an output that finishes inside a character drops it (as vLLM does) rather than ending
in U+FFFD. Decoding the whole output every round instead would cost time linear in the output's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ddtree.outputs import RequestOutput
from ddtree.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for a multi-byte character whose bytes are not all there yet


@dataclass
class OutputState:
    """Everything about one request's output that is plain data."""

    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_new_tokens: int  # min(max_tokens, what the context window still holds)
    max_new_tokens_reason: str = "length"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # final text (stop string and anything after it removed)
    num_text_emitted: int = 0  # characters already handed to the user
    finish_reason: str | None = None
    prefix_offset: int = 0  # incremental decoding: left context starts here (a token index of the text tokens)
    read_offset: int = 0  # text is complete up to this token


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of_char = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self._added_ids = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for: a byte-level BPE token (GPT-2, Llama 3, SmolLM2) or a
        SentencePiece byte-fallback token (`<0xE2>`) may hold part of a character, whose own decode shows U+FFFD;
        the tokens' bytes, joined, are the text's UTF-8 (OpenAI's `bytes` in log-probabilities), once the
        engine drops the leading space a decode strips at the text's start (ddtree/request.py, `OutputWriter`)."""
        if token_id in self._added_ids:  # spelled out (or, for special tokens, decoded to nothing)
            return self.decode([token_id]).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_of_char is not None and all(c in self._byte_of_char for c in piece):
                return bytes(self._byte_of_char[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if "\u2581" in piece:  # SentencePiece's word boundary: a space (a decode drops it at the start)
                return piece.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()

    def append_tokens(self, state: OutputState, new_token_ids: list[int]) -> list[int]:
        """Add tokens until one of them finishes the request (EOS, a stop token, the length: the stops that need no
        text); returns the tokens actually kept. The text is left alone: `append` decodes it, or a `TextDecoder`
        does later (an output without stop strings)."""
        if state.finish_reason is not None:
            return []
        params = state.params
        kept: list[int] = []
        for token in new_token_ids:
            kept.append(token)
            state.token_ids.append(token)
            if (token in state.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                state.finish_reason = "stop"
                break
            if len(state.token_ids) >= state.max_new_tokens:
                state.finish_reason = state.max_new_tokens_reason
                break
        return kept

    def append(self, state: OutputState, new_token_ids: list[int]) -> list[int]:
        """Add tokens until one of them finishes the request, stop strings included, and decode their text; returns
        the tokens actually kept."""
        if state.finish_reason is not None:
            return []
        params = state.params
        kept = self.append_tokens(state, new_token_ids)
        text_tokens = _text_tokens(state)
        new_text = self._new_text(state, text_tokens)
        text = state.text + new_text
        if params.stop:
            searched = text
            if not new_text and state.finish_reason is None:
                # The round's tokens end inside a character: the text before that character is complete and may
                # hold a stop string (found now, so that no later round's tokens are kept past it).
                searched = text + self._complete_pending_text(state, text_tokens)
            # Only text that can hold a new stop is searched: from just before the end of the previous text (which
            # holds complete characters only, `_new_text`, so it is a prefix of this one).
            start = max(0, len(state.text) - max(map(len, params.stop)) + 1)
            if self._first_stop(searched, start, params.stop) is not None:
                state.finish_reason = "stop"
                # Keep only the tokens needed to produce the text up to (and including) the stop string.
                kept_text = self.decode(state.token_ids)
                while len(kept) > 1:
                    shorter = self.decode(state.token_ids[:-1])
                    if self._first_stop(shorter, 0, params.stop) is None:
                        break
                    state.token_ids.pop()
                    kept.pop()
                    kept_text = shorter
                # The cut of a token-by-token decode: the earliest start among the stops the kept tokens complete (a
                # stop that starts earlier but completes only in a dropped token never ended the output there).
                completed = [stop for stop in params.stop if stop in kept_text]
                cut = self._first_stop(searched, start, completed)
                text = searched[: cut if cut is not None else self._first_stop(searched, start, params.stop)]
        state.text = text
        return kept

    def _new_text(self, state: OutputState, text_tokens: list[int]) -> str:
        """Text the tokens past `read_offset` add; "" while they end inside a character. Once finished, a character
        the output ends inside of is dropped (as vLLM does: its bytes will never complete, and a U+FFFD standing
        for them is not text the model wrote); its tokens still count."""
        prefix_text = self.decode(text_tokens[state.prefix_offset : state.read_offset])
        window_text = self.decode(text_tokens[state.prefix_offset :])
        if state.finish_reason is None and (
            len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        state.prefix_offset, state.read_offset = state.read_offset, len(text_tokens)
        new_text = window_text[len(prefix_text) :]
        return new_text.rstrip(REPLACEMENT_CHAR) if state.finish_reason is not None else new_text

    def _complete_pending_text(self, state: OutputState, text_tokens: list[int]) -> str:
        """The complete characters of the tokens past `read_offset` while they end inside a character."""
        prefix_text = self.decode(text_tokens[state.prefix_offset : state.read_offset])
        window_text = self.decode(text_tokens[state.prefix_offset :])
        return window_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)

    @staticmethod
    def _first_stop(text: str, start: int, stops: list[str]) -> int | None:
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    @staticmethod
    def take_new_text(state: OutputState) -> str:
        """Text not yet emitted that is safe to emit: held back while it could still grow into a stop string (an
        unfinished character never reaches `state.text`: `_new_text`)."""
        end = len(state.text)
        if state.finish_reason is None:
            # the longest end of the text that some stop string starts with, whichever stop that is
            unsettled = min(end - state.num_text_emitted, max((len(stop) - 1 for stop in state.params.stop), default=0))
            end -= max(
                (k for k in range(unsettled, 0, -1) for stop in state.params.stop if state.text.endswith(stop[:k])),
                default=0,
            )
        new = state.text[state.num_text_emitted : end]
        state.num_text_emitted = max(state.num_text_emitted, end)
        return new


def _is_byte_level(tokenizer) -> bool:
    """Whether the (fast) tokenizer's decoder maps GPT-2's byte alphabet back to bytes."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders") or [decoder]
    return any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68 for the
    characters 256 and up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _text_tokens(state: OutputState) -> list[int]:
    """The output's tokens that make its text: a stop token is not part of it (EOS is special anyway)."""
    tokens = state.token_ids
    if state.finish_reason == "stop" and tokens and tokens[-1] in state.params.stop_token_ids:
        return tokens[:-1]
    return tokens


class TextDecoder:
    """One output's text, decoded incrementally from tokens the engine has already cut at every stop (an output
    without stop strings, which the engine leaves undecoded: `RequestOutput.text_pending`), so that its consumer
    decodes it off the engine's loop. The text equals what `Detokenizer.append` gives."""

    def __init__(self, detokenizer: Detokenizer, params: SamplingParams) -> None:
        if params.stop:
            raise ValueError("an output with stop strings is decoded by the engine, which must find them")
        self.detokenizer = detokenizer
        self.state = OutputState(params, frozenset(), max_new_tokens=0)

    @property
    def text(self) -> str:
        return self.state.text

    def add(self, token_ids: list[int], finish_reason: str | None) -> str:
        """The text that `token_ids` (the output's next tokens) add; `finish_reason` once the output has finished.
        An aborted output's text ends where it was (its held-back bytes are never completed), as the engine's."""
        state = self.state
        if state.finish_reason is not None:
            raise ValueError("the output has finished already")
        state.token_ids.extend(token_ids)
        state.finish_reason = finish_reason
        if finish_reason == "abort" and not token_ids:
            return ""
        new_text = self.detokenizer._new_text(state, _text_tokens(state))
        state.text += new_text
        return new_text

    def fill(self, output: RequestOutput) -> RequestOutput:
        """The engine's next output of this request, `text_pending`, with its text."""
        new_text = self.add(output.new_token_ids, output.finish_reason if output.finished else None)
        return replace(output, text=self.text, new_text=new_text, text_pending=False)
