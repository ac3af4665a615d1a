"""A real (Hugging Face fast) character-level tokenizer for tests with tiny vocabularies."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<eos>"]
CHARS = list(string.ascii_lowercase + " .,!?0123456789\n")


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (byte-level, as GPT-2/Llama-3/SmolLM2 tokenizers fall back to): a multi-byte
    character spans several tokens, and decoding part of it gives U+FFFD."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(SPECIAL + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


def make_sentencepiece_tokenizer(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral) over `pieces` (id = index): words with a leading "\u2581"
    (a decode drops the first one), byte-fallback tokens <0xNN> for what no piece covers."""
    from tokenizers import normalizers

    tok = Tokenizer(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
