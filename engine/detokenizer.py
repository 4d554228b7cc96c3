"""Incremental detokenization of one request's output, with stop strings.

Owns turning generated token ids into text that is safe to stream: never half a UTF-8
character, never any part of a stop string. Must not import the scheduler or the sampler.

Per token: decode two short windows of recent ids, the context (tokens already turned into
text) and the context plus the new tokens; the new text is the difference. Windows are re-anchored
after every emission, so each call decodes O(1) tokens whatever the output length. The first
window starts a few tokens into the prompt so the first generated token decodes in context
(leading spaces, merges across the prompt boundary).

Stop strings: decoded text goes into a hold buffer; only the part that can no longer grow
into a stop string leaves it. Once a stop string appears, the text before it is released and
the detokenizer goes inert.
"""
from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens used as left context for the first window (the value production engines use).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        # The Rust tokenizer decodes without the Python wrapper's per-call overhead and without
        # clean_up_tokenization_spaces, which would rewrite text across window boundaries.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_ids = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode_ids = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops: tuple[str, ...] = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # The window: `_ids[:_read]` decoded to `_window_text` and is already accounted for;
        # `_ids[_read:]` are new tokens not yet turned into text. Older ids are dropped.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self._window_text = self._decode_ids(self._ids) if self._ids else ""
        if self._window_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character (a prompt given as ids): the output's first bytes
            # would complete a character that belongs to the prompt, so decode the output alone.
            self._ids, self._read, self._window_text = [], 0, ""

        self._held = ""  # decoded text that might still be the start of a stop string
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self.stop_matched: str | None = None
        self.output_token_ids: list[int] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    @property
    def done(self) -> bool:
        return self.stop_matched is not None

    def add_token(self, token_id: int) -> str:
        """Feed one generated id; return the new text that is safe to emit now."""
        if self.stop_matched is not None:
            return ""
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        new_text = self._decode_ids(self._ids)
        # A trailing U+FFFD means the last token ended inside a multi-byte character: wait for
        # the rest. Equal length means the token decoded to nothing (a skipped special token).
        if len(new_text) <= len(self._window_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._window_text) :]
        self._advance_window()
        return self._release(delta, final=False)

    def finish(self) -> str:
        """Release held-back text at the end of the request (length, EOS, stop token)."""
        if self.stop_matched is not None:
            return ""
        delta = ""
        if self._read < len(self._ids):
            # Whatever is still undecoded ends the output; decode it as is, as a full decode would.
            new_text = self._decode_ids(self._ids)
            delta = new_text[len(self._window_text) :]
            self._advance_window()
        return self._release(delta, final=True)

    def _advance_window(self) -> None:
        # The tokens just turned into text become the left context of the next window.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._window_text = self._decode_ids(self._ids)

    def _release(self, delta: str, final: bool) -> str:
        buf = self._held + delta
        if self._stops:
            hit = _earliest_stop(buf, self._stops)
            if hit is not None:
                start, stop = hit
                self.stop_matched = stop
                self._held = ""
                return self._emit(buf[:start])
            if not final:
                keep = _stop_prefix_suffix_len(buf, self._stops, self._max_stop_len)
                self._held = buf[len(buf) - keep :] if keep else ""
                return self._emit(buf[: len(buf) - keep])
        self._held = ""
        return self._emit(buf)

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
            self._text_cache = None
        return piece


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _stop_prefix_suffix_len(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for n in range(min(len(text), max_len - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
