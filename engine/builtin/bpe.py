"""Deterministic byte-level BPE merges: a small trainer over `corpus.TRAINING_TEXT`, then
hash-chosen synthetic merges until the vocabulary is exactly full.

Tokens are strings over the GPT-2 byte-to-unicode alphabet (what `tokenizers`' ByteLevel
pre-tokenizer emits). Every merge creates a token that did not exist before, so the vocab
stays unique. Nothing here depends on `random` or on dict/set iteration order.
"""
from __future__ import annotations

import hashlib
from collections import Counter

# Synthetic tokens are built only from parts this short, so token lengths stay realistic.
_MAX_SYNTHETIC_PART = 8
_SYNTHETIC_SALT = b"pdcluster-builtin-bpe-v1"


def train_merges(words: Counter[str], existing: set[str], limit: int) -> list[tuple[str, str]]:
    """Classic BPE on pre-tokenized words: merge the most frequent adjacent pair, ties broken
    by the lexicographically smallest pair; stop at `limit` merges or when no pair repeats."""
    split = {w: tuple(w) for w in words}
    merges: list[tuple[str, str]] = []
    known = set(existing)
    while len(merges) < limit:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, symbols in split.items():
            freq = words[word]
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += freq
        # A pair whose concatenation already exists (made by another split) is skipped so
        # every merge adds a new token.
        candidates = [(c, p) for p, c in pairs.items() if c >= 2 and p[0] + p[1] not in known]
        if not candidates:
            break
        best_count = max(c for c, _ in candidates)
        best = min(p for c, p in candidates if c == best_count)
        merged = best[0] + best[1]
        merges.append(best)
        known.add(merged)
        split = {w: _apply(symbols, best, merged) for w, symbols in split.items()}
    return merges


def _apply(symbols: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def synthetic_merges(tokens: list[str], existing: set[str], count: int) -> list[tuple[str, str]]:
    """`count` merges of existing token pairs picked by a SHA-256 counter sequence.

    `tokens` are the mergeable tokens so far in id order (bytes, then learned merges)."""
    pool = [t for t in tokens if len(t) <= _MAX_SYNTHETIC_PART]
    known = set(existing)
    merges: list[tuple[str, str]] = []
    step = 0
    while len(merges) < count:
        digest = hashlib.sha256(_SYNTHETIC_SALT + step.to_bytes(8, "little")).digest()
        step += 1
        left = pool[int.from_bytes(digest[:8], "little") % len(pool)]
        right = pool[int.from_bytes(digest[8:16], "little") % len(pool)]
        merged = left + right
        if merged in known:
            continue
        merges.append((left, right))
        known.add(merged)
        if len(merged) <= _MAX_SYNTHETIC_PART:
            pool.append(merged)
    return merges
