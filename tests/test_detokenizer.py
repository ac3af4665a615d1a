import pytest

from ddtree.detokenizer import REPLACEMENT_CHAR, Detokenizer, OutputState
from ddtree.sampling_params import SamplingParams
from tests.factories import decode_in_random_rounds
from tests.tiny_tokenizer import make_byte_tokenizer, make_char_tokenizer, make_sentencepiece_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def state(tok, max_new=100, **kw):
    return OutputState(SamplingParams(**kw), frozenset({tok.eos_token_id}), max_new_tokens=max_new)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_roundtrip(tok):
    assert tok.decode(ids(tok, "hello, world 42.")) == "hello, world 42."


def test_eos_discards_tokens_after_it(tok):
    d, s = Detokenizer(tok), state(tok)
    kept = d.append(s, ids(tok, "ab") + [tok.eos_token_id] + ids(tok, "cd"))
    assert kept == ids(tok, "ab") + [tok.eos_token_id]
    assert s.text == "ab" and s.finish_reason == "stop"
    assert d.append(s, ids(tok, "zz")) == []


def test_ignore_eos_keeps_going(tok):
    d, s = Detokenizer(tok), state(tok, ignore_eos=True)
    d.append(s, ids(tok, "a") + [tok.eos_token_id] + ids(tok, "b"))
    assert s.finish_reason is None and s.text == "ab"


def test_max_tokens_cuts_a_round_short(tok):
    d, s = Detokenizer(tok), state(tok, max_new=3)
    assert d.append(s, ids(tok, "abcdef")) == ids(tok, "abc")
    assert s.finish_reason == "length" and s.text == "abc"


def test_stop_token_id_not_in_text(tok):
    stop_id = ids(tok, "x")[0]
    d, s = Detokenizer(tok), state(tok, stop_token_ids=[stop_id])
    d.append(s, ids(tok, "abxcd"))
    assert s.text == "ab" and s.token_ids == ids(tok, "abx") and s.finish_reason == "stop"


def test_stop_string_across_rounds_never_emitted(tok):
    d, s = Detokenizer(tok), state(tok, stop=["end."])
    streamed = []
    for chunk in ["the e", "n", "d. more"]:
        d.append(s, ids(tok, chunk))
        streamed.append(d.take_new_text(s))
    assert s.finish_reason == "stop"
    assert "".join(streamed) == "the " == s.text
    assert "e" not in streamed[0][-1:]  # the partial stop string was held back
    assert s.token_ids == ids(tok, "the end.")  # tokens past the stop string discarded


def test_stop_string_inside_one_round(tok):
    d, s = Detokenizer(tok), state(tok, stop=["!", "??"])
    kept = d.append(s, ids(tok, "hi?? there!"))
    assert s.text == "hi" and kept == ids(tok, "hi??")


@pytest.mark.parametrize("stops", [["a", "bac"], ["bac", "a"], ["!", "4!!"], ["c", "xbac"]])
def test_several_stop_strings_cut_where_a_token_by_token_decode_cuts(tok, stops):
    """A stop that starts first but completes after another must not decide the cut when one round brings every
    token (an accepted tree): the text and tokens are those of one token per round (speculation "off")."""
    text = "yd44xbac4!!"
    results = []
    for rounds in ([1] * len(text), [len(text)], [3, 4, 4], [2] * 6):
        d, s, i = Detokenizer(tok), state(tok, stop=stops), 0
        streamed = ""
        for n in rounds:
            if s.finish_reason is not None:
                break
            d.append(s, ids(tok, text[i : i + n]))
            streamed += d.take_new_text(s)
            i += n
        assert s.finish_reason == "stop" and streamed == s.text
        results.append((s.text, tok.decode(s.token_ids)))
    assert len(set(results)) == 1, results
    assert not any(stop in results[0][0] for stop in stops)


def test_text_held_back_is_the_longest_start_of_any_stop(tok):
    """While the text's end could still grow into a stop string, that end is held back: the longest such end over
    all stops, whatever their order (and no more)."""
    for stops in (["b?", "a!"], ["a!", "b?"]):
        d, s = Detokenizer(tok), state(tok, stop=stops)
        d.append(s, ids(tok, "xab"))
        assert d.take_new_text(s) == "xa"
    for stops in (["ab?", "b!"], ["b!", "ab?"]):
        d, s = Detokenizer(tok), state(tok, stop=stops)
        d.append(s, ids(tok, "xab"))
        assert d.take_new_text(s) == "x"


@pytest.mark.parametrize("split", [1, 2, 3])
def test_stop_string_completed_by_the_bytes_of_a_later_round(split):
    # "🎉" is 4 bytes: the first round ends inside it (decoded as U+FFFD), the next completes it.
    byte_tok = make_byte_tokenizer()
    d, s = Detokenizer(byte_tok), state(byte_tok, stop=["🎉"])
    tokens = ids(byte_tok, "ab🎉cd")
    first, rest = tokens[: 2 + split], tokens[2 + split :]
    d.append(s, first)
    # no text while the round's last token ends inside a character (the decode window is still open)
    assert s.finish_reason is None and Detokenizer.take_new_text(s) == ""
    kept = d.append(s, rest)
    assert s.finish_reason == "stop" and s.text == "ab"
    assert kept == tokens[2 + split : 6]  # nothing past the stop string's last byte
    assert Detokenizer.take_new_text(s) == "ab"  # the stop string itself is never emitted


def test_stop_string_found_in_a_round_that_ends_inside_a_character():
    # The round holding the stop string ends with the first byte of "é": its text is withheld until the character
    # completes, but the stop before it is found in this round, and nothing after it is kept.
    byte_tok = make_byte_tokenizer()
    d, s = Detokenizer(byte_tok), state(byte_tok, stop=["a"])
    tokens = ids(byte_tok, "baécd")
    kept = d.append(s, tokens[:3])
    assert s.finish_reason == "stop" and s.text == "b" and kept == tokens[:2]
    assert d.append(s, tokens[3:]) == [] and s.token_ids == tokens[:2]
    assert Detokenizer.take_new_text(s) == "b"


@pytest.mark.parametrize("make", [make_byte_tokenizer, make_char_tokenizer])
def test_incremental_text_equals_decoding_everything(make):
    # Rounds of 1-4 tokens, cut anywhere (inside multi-byte characters too): the streamed pieces and the final text
    # equal one decode of all tokens, while each round decodes only a short window.
    import random

    tok = make()
    text = "héllo wörld, 12 ✓ café 🎉 naïve!" if make is make_byte_tokenizer else "hello world, 12 cafe naive!"
    tokens = ids(tok, text)
    rng = random.Random(0)
    for _ in range(20):
        s, pieces = decode_in_random_rounds(tok, tokens, 4, rng)
        assert s.finish_reason == "length" and s.text == tok.decode(tokens) == "".join(pieces)
        assert s.read_offset == len(tokens)


def _byte_fallback_tokenizer():
    """Every byte as a <0xNN> token, a few letters and words."""
    return make_sentencepiece_tokenizer(
        ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *"abcdehlnorw\u00e9", "\u2581h", "\u2581w"]
    )


@pytest.mark.parametrize("make", [make_byte_tokenizer, make_char_tokenizer, _byte_fallback_tokenizer])
def test_token_bytes_join_into_the_text(make):
    """OpenAI's `bytes` of log-probabilities: a token holding part of a character decodes to U+FFFD alone, but its
    bytes are that part, so the tokens' bytes join into the text."""
    tok = make()
    text = {
        make_byte_tokenizer: "héllo 🎉 東京!",
        make_char_tokenizer: "hello, world 42.",
        _byte_fallback_tokenizer: "hello w\u00e9rld \u6771\U0001f389",
    }[make]
    tokens = ids(tok, text)
    joined = b"".join(Detokenizer(tok).token_bytes(t) for t in tokens)
    # (SentencePiece: the first word's "\u2581" is a space that a decode strips at the start of a text)
    assert joined == (" " + text if make is _byte_fallback_tokenizer else text).encode()
    if make is not make_char_tokenizer:
        assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in tokens)  # parts of characters


def test_an_output_ending_inside_a_character_drops_that_character():
    """As vLLM: the bytes of a character the output stops inside of never complete, so no U+FFFD stands for them
    in the text (their tokens are still the output's)."""
    byte_tok = make_byte_tokenizer()
    tokens = ids(byte_tok, "ab🎉")  # the emoji is 4 byte tokens
    d, s = Detokenizer(byte_tok), state(byte_tok, max_new=4)
    assert d.append(s, tokens) == tokens[:4] and s.finish_reason == "length"
    assert s.text == "ab" and Detokenizer.take_new_text(s) == "ab"


@pytest.mark.parametrize("make", [make_byte_tokenizer, make_char_tokenizer, _byte_fallback_tokenizer])
@pytest.mark.parametrize("ending", ["length", "eos", "stop_token", "abort"])
def test_text_decoded_by_the_consumer_equals_the_engines(make, ending):
    """An output without stop strings may leave the engine undecoded (`append_tokens`) and be decoded by its
    consumer (`TextDecoder`): the same pieces, round by round, and the same text, whatever cuts the output (a
    length inside a character, EOS, a stop token) or aborts it."""
    import random

    from ddtree.detokenizer import TextDecoder

    tok = make()
    text = {
        make_byte_tokenizer: "héllo wörld, 12 ✓ café 🎉 naïve! 東京",
        make_char_tokenizer: "hello world, 12 cafe naive!",
        _byte_fallback_tokenizer: "hello w\u00e9rld \u6771\U0001f389 hello",
    }[make]
    tokens = ids(tok, text)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0  # (SentencePiece's: <unk>)
    kw, max_new = {}, len(tokens) + 5
    if ending == "length":
        max_new = len(tokens) - 2  # (the byte tokenizers: inside the last character)
    elif ending == "eos":
        tokens = [*tokens[:-3], eos, *tokens[-3:]]
    elif ending == "stop_token":
        kw["stop_token_ids"] = [tokens[len(tokens) // 2]]
    rng = random.Random(1)
    for _ in range(10):
        d = Detokenizer(tok)
        engine, undecoded = (OutputState(SamplingParams(**kw), frozenset({eos}), max_new) for _ in range(2))
        decoder = TextDecoder(Detokenizer(tok), undecoded.params)
        rest, pieces, decoded = list(tokens), [], []
        while rest and engine.finish_reason is None:
            n = rng.randint(1, 4)
            if ending == "abort" and len(rest) <= len(tokens) // 2:
                engine.finish_reason = undecoded.finish_reason = "abort"
                pieces.append("")
                decoded.append(decoder.add([], "abort"))
                break
            d.append(engine, rest[:n])
            pieces.append(Detokenizer.take_new_text(engine))
            kept = d.append_tokens(undecoded, rest[:n])
            decoded.append(decoder.add(kept, undecoded.finish_reason))
            rest = rest[n:]
        assert decoded == pieces and decoder.text == engine.text and undecoded.token_ids == engine.token_ids
        assert (
            engine.finish_reason == undecoded.finish_reason == {"eos": "stop", "stop_token": "stop"}.get(ending, ending)
        )
    with pytest.raises(ValueError, match="finished already"):
        decoder.add([1], None)
    with pytest.raises(ValueError, match="stop strings"):
        TextDecoder(Detokenizer(tok), SamplingParams(stop=["x"]))
