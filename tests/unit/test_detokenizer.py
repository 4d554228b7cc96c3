"""Streaming detokenization a user would notice: no broken characters, no leaked stop
strings, the same text as a full decode, and the prompt boundary handled."""
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"
IM_END = "<|im_end|>"


def _byte_to_char() -> dict[int, str]:
    """GPT-2 style byte-level alphabet: printable Latin-1 bytes stand for themselves, the
    rest are shifted past 255 so every byte has a visible, whitespace-free character."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# Merges chosen to make tokens that end inside a character, span two characters, or make up
# pieces of the stop strings used below.
MERGE_TEXTS = [
    ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), ("o", "r"), (" w", "or"),
    ("l", "d"), (" ", "S"), ("T", "O"), (" S", "TO"), ("P", "!"), ("\u00e9".encode()[:1], "\u00e9".encode()[1:]),
    ("\u4f60".encode()[2:], "\u597d".encode()[:1]), ("\U0001f642".encode()[:1], "\U0001f642".encode()[1:2]),
    ("\u00f6".encode()[:1], "\u00f6".encode()[1:]), ("\n", "\n"),
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    table = _byte_to_char()

    def chars(piece: str | bytes) -> str:
        data = piece.encode() if isinstance(piece, str) else piece
        return "".join(table[b] for b in data)

    vocab = {table[b]: b for b in range(256)}
    merges = []
    for left, right in MERGE_TEXTS:
        a, b = chars(left), chars(right)
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True), AddedToken(IM_END, special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, prompt=(), stop=(), skip_special_tokens=True):
    det = IncrementalDetokenizer(tokenizer, list(prompt), stop=list(stop), skip_special_tokens=skip_special_tokens)
    pieces = [det.add_token(t) for t in ids]
    pieces.append(det.finish())
    return det, pieces


MIXED = "h\u00e9llo w\u00f6rld \u2014 \u4f60\u597d \U0001f642"


@pytest.mark.parametrize("per_byte", [False, True], ids=["bpe", "one-byte-per-token"])
def test_multibyte_text_streams_without_broken_characters(tokenizer, per_byte):
    ids = enc(tokenizer, MIXED)
    if per_byte:
        ids = list(MIXED.encode())  # ids 0..255 are the raw bytes: every character split
    assert tokenizer.decode(ids) == MIXED
    det, pieces = stream(tokenizer, ids, prompt=enc(tokenizer, "say: "))
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # something was held back waiting for the rest of a character
    assert "".join(pieces) == det.text == MIXED
    assert det.stop_matched is None


def test_token_spanning_two_characters(tokenizer):
    ids = enc(tokenizer, "\u4f60\u597d")
    assert len(ids) < len("\u4f60\u597d".encode())  # the cross-character merge fired
    det, pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert det.text == "\u4f60\u597d"


def test_stop_string_spanning_tokens_is_never_emitted(tokenizer):
    ids = enc(tokenizer, "hello world STOP! more text")
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP!"])
    pieces = [det.add_token(t) for t in ids]
    assert det.stop_matched == "STOP!"
    assert "".join(pieces) == det.text == "hello world "
    assert all("S" not in p for p in pieces)
    assert det.add_token(enc(tokenizer, "x")[0]) == ""
    assert det.finish() == ""
    assert det.text == "hello world "


def test_false_alarm_prefix_is_released_once_it_cannot_match(tokenizer):
    ids = enc(tokenizer, "a STORM b")
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["a", "\u0120STO", "R"]
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    # "STO" is held while it could still become "STOP", and released at "R".
    assert [det.add_token(t) for t in ids[:3]] == ["a", " ", "STOR"]
    assert [det.add_token(t) for t in ids[3:]] == ["M", " ", "b"]
    assert det.finish() == ""
    assert det.text == "a STORM b" and det.stop_matched is None


def test_finish_flushes_a_held_stop_prefix(tokenizer):
    ids = enc(tokenizer, "end wi")
    det, pieces = stream(tokenizer, ids, stop=["with"])
    assert pieces[-1] == "wi"
    assert det.text == "end wi" and det.stop_matched is None


def test_finish_flushes_an_incomplete_character_like_a_full_decode(tokenizer):
    ids = enc(tokenizer, "ok ") + list("\U0001f642".encode()[:2])
    det, pieces = stream(tokenizer, ids)
    assert pieces[-1].endswith("\ufffd")
    assert det.text == tokenizer.decode(ids)


def test_earliest_stop_wins_and_single_token_stop(tokenizer):
    det, _ = stream(tokenizer, enc(tokenizer, "hello world"), stop=["world", "lo w"])
    assert det.stop_matched == "lo w" and det.text == "hel"
    det, _ = stream(tokenizer, enc(tokenizer, "hello"), stop=["hello"])
    assert det.stop_matched == "hello" and det.text == ""


def test_stop_across_a_multibyte_character(tokenizer):
    det, pieces = stream(tokenizer, list("x \u4f60\u597d y".encode()), stop=["\u597d y"])
    assert det.text == "x \u4f60" and "".join(pieces) == det.text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos, im_end = tokenizer.convert_tokens_to_ids([EOS, IM_END])
    ids = enc(tokenizer, "hi") + [im_end] + enc(tokenizer, " there") + [eos]
    det, pieces = stream(tokenizer, ids, prompt=[eos] + enc(tokenizer, "q"), skip_special_tokens=skip)
    assert det.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (IM_END in det.text) is (not skip)


def test_prompt_is_context_not_output(tokenizer):
    prompt = enc(tokenizer, "h\u00e9llo")
    det, _ = stream(tokenizer, enc(tokenizer, " w\u00f6rld"), prompt=prompt)
    assert det.text == " w\u00f6rld"


def test_each_step_decodes_a_short_window(tokenizer):
    class SpyBackend:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    class SpyTokenizer:
        def __init__(self, inner):
            self.backend_tokenizer = SpyBackend(inner.backend_tokenizer)

    spy = SpyTokenizer(tokenizer)
    text = "hello w\u00f6rld \u4f60\u597d " * 100
    ids = enc(tokenizer, text)
    det, _ = stream(spy, ids, prompt=enc(tokenizer, "prompt " * 50))
    assert det.text == text
    assert spy.backend_tokenizer.longest <= 12


ALPHABET = ["hello", " world", " STOP", "!", "\u00e9", "\u00f6", "\u4f60\u597d", "\U0001f642", " ", "\n\n", "wo", "S", "T"]


def test_random_streams_match_a_token_by_token_reference(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12)))
        ids = enc(tokenizer, text) if rng.random() < 0.5 else list(text.encode())
        stops = [rng.choice(["STOP", "\u597d", "\n\n", "d S", "\U0001f642!", "ow"])]
        if rng.random() < 0.5:  # a substring of this very text, so it is sure to match
            at = rng.randrange(len(text))
            stops.append(text[at : at + rng.randint(1, 5)])
        det, pieces = stream(tokenizer, ids, prompt=enc(tokenizer, "ctx \u00e9"), stop=stops)
        # Reference: the first token after which a stop string is visible in the full decode.
        expected, matched = tokenizer.decode(ids), None
        for k in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:k])
            hits = [(prefix.find(s), s) for s in stops if s in prefix]
            if hits:
                start, matched = min(hits)
                expected = prefix[:start]
                break
        assert det.stop_matched == matched, text
        assert "".join(pieces) == det.text == expected, text
        assert all("\ufffd" not in p for p in pieces), text


def test_prompt_ending_inside_a_character(tokenizer):
    # A prompt given as ids may stop mid-character; the output must still decode on its own.
    e_acute = list("\u00e9".encode())
    prompt = enc(tokenizer, "ok ") + e_acute[:1]
    ids = e_acute[1:] + enc(tokenizer, " x\u00f6")
    det, pieces = stream(tokenizer, ids, prompt=prompt)
    assert "".join(pieces) == det.text == tokenizer.decode(ids)


def test_random_ids_including_invalid_utf8_match_a_full_decode(tokenizer):
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        det, pieces = stream(tokenizer, ids, prompt=prompt)
        assert "".join(pieces) == det.text == tokenizer.decode(ids, skip_special_tokens=True), ids
