"""Per-request sampling parameters: what the user may ask of the sampler and the detokenizer.

Owns validation of every field. Everything downstream (sampler, detokenizer, scheduler stop
checks) may trust a constructed `SamplingParams` without re-checking it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Seeds go straight to torch.Generator.manual_seed, which accepts this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `max_tokens=True` is a bug at the caller, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value}")
    return value


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    max_tokens: output tokens to generate, >= 1.
    temperature: >= 0; 0 means greedy.
    top_k: -1 or 0 disables; otherwise keep the k most likely tokens.
    top_p: in (0, 1]; keep the smallest set of tokens whose mass reaches top_p.
    min_p: in [0, 1]; drop tokens whose probability is below min_p * max probability.
    seed: per-request seed; the same seed and the same logits give the same tokens.
    stop: stop strings; the output text ends right before the first one and never holds it.
    stop_token_ids: token ids that end the request (the token itself is not detokenized).
    ignore_eos: keep generating past the model's EOS token.
    logprobs: None = off; n in 0..20 = chosen token's logprob plus the top n alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")

        top_k = _check_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not SEED_MIN <= seed <= SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

        if self.logprobs is not None:
            n = _check_int("logprobs", self.logprobs)
            if not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {n}")

    @staticmethod
    def _normalize_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
        out: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty, got ''")
            out.append(s)
        return out

    @staticmethod
    def _normalize_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int, got {type(ids).__name__}")
        out: list[int] = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"stop_token_ids must contain only int, got {type(t).__name__} {t!r}")
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
            out.append(t)
        return out

    @property
    def greedy(self) -> bool:
        # top_k == 1 leaves a single candidate, so it is argmax whatever the temperature.
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy, with `changes` applied; the stop lists are not shared."""
        changes.setdefault("stop", list(self.stop))
        changes.setdefault("stop_token_ids", list(self.stop_token_ids))
        return dataclasses.replace(self, **changes)
