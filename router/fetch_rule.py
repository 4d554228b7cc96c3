"""Fetch or recompute: where a prefill worker takes a prompt's cached leading pages from.

The worker chosen to prefill a prompt holds `have` of its leading pages itself. Other places hold
more: peer workers' prefix caches and the node KV stores (kv_store/), each offering its count of
leading pages and what one page costs to move from there. Moving `extra` pages saves computing
`extra * page_size` tokens and costs one fetch's fixed overhead plus the pages' transfer:

    gain(offer) = extra * page_size * prefill_s_per_token - (overhead_s + extra * s_per_page)

The rule takes the offer of largest gain, when it is positive and `extra >= min_pages`; None:
compute the prompt here. Ties go to the earlier offer (the router lists the stores first: a
store has no engine whose step a send would share). An offer may carry its own fixed cost
(`Offer.overhead_s`): a worker's export waits for its engine's current step, a store's does not.

Estimates, not measurements of this request: `FetchCosts` holds what the router measured of
recent prefills and fetches (`observe_*`), seeded with defaults until it has seen any. The
capacity planner's simulator calls the same `choose` with its own latency model's figures.
No torch, no asyncio: a pure function of counts and seconds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Seeds until something is measured (a CPU `small` model prefills ~1.5-3 ms a token here; one
# page of its KV crosses NIXL in well under a millisecond, a fetch's round trips cost ~5 ms).
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3
DEFAULT_FETCH_S_PER_PAGE = {"nixl": 2e-4, "grpc": 1e-3}
DEFAULT_FETCH_OVERHEAD_S = 5e-3
_EWMA = 0.2   # weight of a new observation


@dataclass(slots=True, frozen=True)
class Offer:
    holder: str          # a worker id, or a store's id
    pages: int           # leading pages of the prompt it holds
    s_per_page: float    # seconds one page takes to move from there
    overhead_s: float | None = None  # its fixed cost per fetch; None: the caller's


def choose(have: int, offers: Iterable[Offer], page_size: int, prefill_s_per_token: float, overhead_s: float,
           min_pages: int = 1) -> Offer | None:
    """The offer worth fetching (module docstring), or None."""
    return best_offer(have, offers, page_size, prefill_s_per_token, overhead_s, min_pages)[0]


def best_offer(have: int, offers: Iterable[Offer], page_size: int, prefill_s_per_token: float, overhead_s: float,
               min_pages: int = 1) -> tuple[Offer | None, float]:
    """(the offer worth fetching or None, its gain in seconds: 0.0 with None)."""
    best, best_gain = None, 0.0
    for o in offers:
        extra = o.pages - have
        if extra < max(min_pages, 1):
            continue
        fixed = overhead_s if o.overhead_s is None else o.overhead_s
        gain = extra * page_size * prefill_s_per_token - (fixed + extra * o.s_per_page)
        if gain > best_gain:
            best, best_gain = o, gain
    return best, best_gain


SOURCES = ("store", "worker")


class FetchCosts:
    """The router's running estimates: seconds per prefilled token, per fetched page, and the
    fixed cost of one fetch from each kind of source (a store answers at once; a worker exports
    between its engine steps), as exponentially weighted means of what it observed."""

    def __init__(self, transport: str = "nixl") -> None:
        self.transport = transport
        self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN
        self.s_per_page = DEFAULT_FETCH_S_PER_PAGE.get(transport, DEFAULT_FETCH_S_PER_PAGE["grpc"])
        self.overhead_s = DEFAULT_FETCH_OVERHEAD_S
        self.source_overhead_s = dict.fromkeys(SOURCES, DEFAULT_FETCH_OVERHEAD_S)
        self.prefills_seen = 0
        self.fetches_seen = 0
        self._source_seen = dict.fromkeys(SOURCES, 0)

    def observe_prefill(self, computed_tokens: int, seconds: float) -> None:
        """A prefill that computed `computed_tokens` took `seconds` from submit to first token."""
        if computed_tokens >= 16 and seconds > 0:
            self.prefill_s_per_token = _mix(self.prefill_s_per_token, seconds / computed_tokens, self.prefills_seen)
            self.prefills_seen += 1

    def observe_fetch(self, pages: int, seconds: float, source: str | None = None) -> None:
        """A fetch of `pages` pages took `seconds` from the holder's call to its answer. With a
        `source` kind, what is left after the pages' own time is that kind's fixed cost; without,
        the per-page time is learned against the seeded fixed cost."""
        if pages < 1 or seconds <= 0:
            return
        if source in self.source_overhead_s:
            fixed = max(seconds - pages * self.s_per_page, 0.0)
            self.source_overhead_s[source] = _mix(self.source_overhead_s[source], fixed, self._source_seen[source])
            self._source_seen[source] += 1
        else:
            per = max(seconds - self.overhead_s, 0.0) / pages  # the fixed part stays the seed's
            self.s_per_page = _mix(self.s_per_page, per, self.fetches_seen)
        self.fetches_seen += 1

    def offer(self, holder: str, pages: int, source: str | None = None) -> Offer:
        """An offer of `pages` from `holder`, with its kind's fixed cost when `source` is given."""
        return Offer(holder, pages, self.s_per_page, self.source_overhead_s.get(source) if source else None)


def _mix(old: float, new: float, seen: int) -> float:
    return new if seen == 0 else (1 - _EWMA) * old + _EWMA * new
