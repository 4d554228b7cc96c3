"""The built-in byte-level BPE tokenizer: special tokens, the 256 byte tokens, then merges
up to exactly `vocab_size`, saved as the three files `AutoTokenizer` reads.

Ids: 0 <|endoftext|> (eos), 1 <|bos|>, 2 <|pad|>, 3 <|im_start|>, 4 <|im_end|>, 5..260 the
bytes 0..255, then merged tokens. Nothing is added on encode, so encode/decode round-trips.

Vocab and merges depend only on vocab_size. The pre-tokenizer depends on the arch's style:
"gpt2" is plain ByteLevel; "qwen" is NFC + the Qwen2 split regex + ByteLevel without regex,
because transformers 5 loads model_type qwen2 with Qwen2Tokenizer, which rebuilds exactly
that pipeline from our vocab and ignores the one in tokenizer.json. Writing it ourselves
keeps `tokenizers.Tokenizer.from_file` and `AutoTokenizer` in agreement.
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine.builtin.bpe import synthetic_merges, train_merges
from engine.builtin.corpus import TRAINING_TEXT
from engine.builtin.special_tokens import (
    BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS,
)

NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
TOKENIZER_STYLES = ("gpt2", "qwen")
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _gpt2_bytes_to_unicode() -> list[str]:
    """The single characters ByteLevel uses for bytes 0..255, in byte order: printable
    Latin-1 bytes stand for themselves, the rest are shifted to U+0100 upwards (as GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return [chars[b] for b in range(NUM_BYTE_TOKENS)]


@functools.lru_cache(maxsize=8)
def build_vocab(vocab_size: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(tokens in id order, merges in rank order); pure function of vocab_size."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}; got {vocab_size}")
    byte_tokens = _gpt2_bytes_to_unicode()
    tokens = [*SPECIAL_TOKENS, *byte_tokens]
    existing = set(tokens)
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(piece for piece, _ in level.pre_tokenize_str(TRAINING_TEXT))
    merges = train_merges(words, existing, vocab_size - len(tokens))
    tokens += [a + b for a, b in merges]
    existing.update(tokens)
    extra = synthetic_merges(tokens[len(SPECIAL_TOKENS):], existing, vocab_size - len(tokens))
    merges += extra
    tokens += [a + b for a, b in extra]
    assert len(tokens) == vocab_size == len(set(tokens))
    return tuple(tokens), tuple(merges)


def build_tokenizer(vocab_size: int, style: str = "gpt2") -> Tokenizer:
    if style not in TOKENIZER_STYLES:
        raise ValueError(f"tokenizer style must be one of {', '.join(TOKENIZER_STYLES)}; got {style!r}")
    tokens, merges = build_vocab(vocab_size)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=None, byte_fallback=False))
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int, style: str = "gpt2") -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    paths = [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json", out_dir / "special_tokens_map.json"]
    paths[0].write_text(build_tokenizer(vocab_size, style).to_str(pretty=True) + "\n", encoding="utf-8")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        **special_map,
    }
    paths[1].write_text(_dump(config), encoding="utf-8")
    paths[2].write_text(_dump(special_map), encoding="utf-8")
    return paths


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
