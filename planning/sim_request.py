"""A simulated request (`SimRequest`: the cluster-wide record of arrival, placement and token
times, and the synthetic prompt every worker that holds it builds its engine request from) and
a worker's engine limits (`EngineLimits`).

A shared prefix block's tokens are derived from its chained key, so prompts that share blocks
share pages and hash to the same prefix-cache entries, and every other token is unique to its
request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_PRIVATE = 1 << 40   # token ids of a request's unshared tokens start here (shared ones stay below)


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    block_keys: tuple = ()       # chained keys of the shared prefix blocks, in order
    block_tokens: int = 0        # tokens per shared block
    generated: int = 0           # tokens sampled so far, on whichever worker
    cached: int = -1             # prompt tokens served by the prefix cache (first admission)
    # where and when (absolute simulated seconds)
    token_times: list = field(default_factory=list)
    admitted: float = -1.0
    prefill_start: float = -1.0
    first_token: float = -1.0
    kv_done: float = -1.0
    finished: float = -1.0
    prefill_worker: str = ""
    decode_worker: str = ""
    local_prefill: bool = False
    error: str = ""
    preemptions: int = 0
    scheduled: float = 0.0       # the workload's arrival (the send may wait for a client slot)
    dest_pages: int = 0          # pages reserved on the decode worker while the prefill runs
    kv_bytes: int = 0
    page_keys: tuple = ()        # the router's hashes of its shared full pages (prefix-aware placement)
    fetched: int = 0             # prompt tokens fetched from a peer or a KV store (sim_store.py), not computed
    fetch_from: str = ""         # "peer" or "store" when fetched
    _prompt: list | None = None  # token ids, made once for all the workers that hold it
    _hashes: dict = field(default_factory=dict)  # page size -> the prompt's chained page hashes

    def token_ids(self) -> list[int]:
        """The prompt as token ids: each shared block's from its key, the rest unique to it."""
        if self._prompt is None:
            ids: list[int] = []
            for key in self.block_keys:
                base = (key + 1) * self.block_tokens
                ids.extend(range(base, base + self.block_tokens))
            ids = ids[: self.prompt_len]
            ids.extend([_PRIVATE + self.index] * (self.prompt_len - len(ids)))
            self._prompt = ids
        return self._prompt

    def page_hashes(self, page_size: int) -> list[int]:
        """The prompt's chained page hashes, once per page size (the prefill and the decode worker
        would each hash their own copy, to the same values). A hash only has to name a page's
        content and everything before it: for a page within the shared blocks that is the
        chained key of the block holding its last token (which names every block before it)
        and the page's position, so it gets the value ((key + 1) << 24) + page, equal for equal
        prefixes and different otherwise, as the engine's blake2b hashes are (engine.block_hash;
        hashing 145 M prompt tokens' pages with it was a fifth of a Mooncake hour's simulation).
        A page with any token of this request's own can never match another request's, so it
        gets a value unique to the request, (1 << 63) + (index << 24) + page, apart from the
        shared ones (below 2**63). All stay below 2**64: the scheduler hashes output pages with
        the engine's own function, chained from these, and that takes a 64-bit parent (the
        earlier (2**40 + index) << 24 overflowed it as soon as a prompt with a private tail
        decoded past a page on a worker with the prefix cache on)."""
        hashes = self._hashes.get(page_size)
        if hashes is None:
            bt, keys = self.block_tokens, self.block_keys
            shared_pages = min(len(keys) * bt, self.prompt_len) // page_size
            if bt % page_size == 0:  # whole pages to a block: a range of values per block
                per = bt // page_size
                hashes = []
                for b, key in enumerate(keys[: -(-shared_pages // per)]):
                    base = ((key + 1) << 24) + b * per
                    hashes += range(base, base + per)
                del hashes[shared_pages:]
            else:
                hashes = [((keys[((j + 1) * page_size - 1) // bt] + 1) << 24) + j for j in range(shared_pages)]
            own = (1 << 63) + (self.index << 24)
            hashes += range(own + shared_pages, own + self.prompt_len // page_size)
            self._hashes[page_size] = hashes
        return hashes

    def kv_page_hashes(self, page_size: int) -> list[int]:
        """The hashes of the full pages of prompt + output but the last token (whose KV is never
        computed): what a finished request leaves in a decode worker's cache and a KV store takes
        (sim_store.py). Pages past the prompt's full pages get values of this request's own,
        continuing `page_hashes`' private range: the traces name a prompt's blocks only, so no later
        prompt can match an answer's pages."""
        hashes = self.page_hashes(page_size)
        full = (self.prompt_len + max(self.generated, 1) - 1) // page_size
        if full > len(hashes):
            own = (1 << 63) + (self.index << 24)
            hashes = hashes + list(range(own + len(hashes), own + full))
        return hashes

    def forget_prompt(self) -> None:
        """Drop the token ids and hashes once no worker needs them (an hour of long prompts would
        otherwise keep gigabytes of them)."""
        self._prompt = None
        self._hashes = {}


@dataclass(slots=True)
class EngineLimits:
    page_size: int = 16
    num_pages: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)
