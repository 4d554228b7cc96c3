"""Prefix fetch between workers (issue 37 item 3, engine/prefix_fetch.py), in process over real
NIXL (UCX on host memory) and real gRPC on 127.0.0.1, with the tiny llama. The test plays the
router: the requester is admitted with a remote prefix and answers a PrefixFetch, the holder's
`export_prefix` pins and sends, the requester prefills only the rest.

Covered: a prefill worker fetching from a decode worker (the decode worker holds the previous
turn) and a decode worker fetching from a prefill worker (local prefill), for 1, several and all
full pages of the prompt: greedy tokens equal Hugging Face's with the fetch on and off, the
fetched tokens are counted as cached and are not computed; the holder's pages evicted before the
fetch (it pins fewer: the requester computes the rest; none: the router abandons the fetch);
the holder closed mid-transfer and a fetch nobody serves (the transfer deadline) -> the whole
prompt is computed, same tokens; the request cancelled before and during the fetch. After every
test: every page free on both engines, and no connector, sender or receiver tracking anything.
"""
from __future__ import annotations

import time

import pytest

from decode_worker import DecodeWorker
from engine.outputs import PrefixFetch, RemotePrefix
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from prefill_worker import PrefillTask, PrefillWorker
from tests.helpers import hf_greedy, random_prompts, wait_until

PAGE = 16
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(page_size=PAGE, num_pages=48, max_num_batched_tokens=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(tiny_model):
    """(X, Y, want): the previous turn X (70 tokens: 4 full pages), the next prompt Y sharing
    X's first 64 tokens (84 tokens: 5 full pages), and Y's greedy tokens from transformers."""
    model = tiny_model("llama")
    x, tail = random_prompts((70, 20), 2048, seed=37)
    y = x[:64] + tail
    return x, y, hf_greedy(model, [y], NEW_TOKENS)[0]


def _pair(model, transport: str, deadline_s: float = 4.0) -> tuple[PrefillWorker, DecodeWorker]:
    cfg = TransferConfig(deadline_s=deadline_s, liveness_interval_s=0.1)
    return (PrefillWorker(model, transport=transport, transfer_config=cfg, **ENGINE),
            DecodeWorker(model, transport=transport, transfer_config=cfg, detokenize=False, **ENGINE))


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def pair(request, tiny_model):
    p, d = _pair(tiny_model("llama"), request.param)
    yield p, d
    p.close()
    d.close()


@pytest.fixture
def workers(pair):
    """The module's pair with empty prefix caches; afterwards nothing held anywhere."""
    for w in pair:
        w.core.reset_prefix_cache()
    yield pair
    wait_until(lambda: idle(*pair), timeout_s=15, what="both workers idle")
    assert_nothing_held(*pair)


def idle(*ws) -> bool:
    for w in ws:
        w.step()
    return not any(w.has_requests for w in ws)


def assert_nothing_held(*ws) -> None:
    for w in ws:
        conn = w.connector
        assert w.core.num_free_pages == w.core.num_pages, f"{type(w).__name__}: {w.core.load()}"
        assert not w.core.has_requests and not w.core.prefix.exports and not w.core.prefix.fetching
        assert conn.tracking == {"sending": 0, "receiving": 0, "fetching": 0}, conn.tracking
        assert conn.sender.tracked_pages() == [] and conn.receiver.tracked_pages() == []


class Router:
    """Plays the router for one prefill and one decode worker: disaggregated requests, with or
    without a remote prefix (then the holder's export_prefix is called as the router would)."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.prefill, self.decode = prefill, decode
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[str, str | None]] = {}
        self.cached: dict[str, int] = {}  # prompt tokens not computed by whoever prefilled
        self.fetch_s: dict[str, float | None] = {}  # a prefill's wait for its fetched pages (PrefillResult)
        self.exports: dict = {}

    def disaggregated(self, rid: str, prompt: list[int], fetch_pages: int = 0, holder=None) -> None:
        """Prefill on the prefill worker (fetching `fetch_pages` from `holder`), decode on the decode worker."""
        self.tokens[rid] = []
        adm = self.decode.admit(rid, prompt, GREEDY)
        fetch = self.prefill.submit(PrefillTask(rid, prompt, GREEDY, adm.descriptors,
                                                RemotePrefix(fetch_pages) if fetch_pages else None))
        self._export(fetch, prompt, holder, self.prefill)

    def local(self, rid: str, prompt: list[int], fetch_pages: int, holder=None) -> PrefixFetch | None:
        """Prefill on the decode worker, fetching `fetch_pages` from `holder` (None: no export)."""
        self.tokens[rid] = []
        adm = self.decode.admit(rid, prompt, GREEDY, remote_prefix=RemotePrefix(fetch_pages))
        self._export(adm.prefix_fetch, prompt, holder, self.decode)
        return adm.prefix_fetch

    def _export(self, fetch: PrefixFetch | None, prompt, holder, requester) -> None:
        if fetch is None or holder is None:
            return
        exp = self.exports[fetch.request_id] = holder.export_prefix(fetch, prompt)
        assert exp.requested_tokens == fetch.num_tokens
        if not exp.sending:
            assert requester.abandon_fetch(fetch.request_id)

    def step(self) -> None:
        for r in self.prefill.step() if self.prefill is not None else []:
            self.cached[r.request_id] = r.num_cached_tokens
            self.fetch_s[r.request_id] = r.fetch_s
            if not r.ok:
                self.finished[r.request_id] = ("error", r.error)
        for out in self.decode.step():
            if out.source.value == "decode" and out.num_cached_tokens and out.request_id not in self.cached:
                self.cached[out.request_id] = out.num_cached_tokens
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = (out.finish_reason, out.error)

    def run(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        ws = [w for w in (self.prefill, self.decode) if w is not None]
        while len(self.finished) < len(self.tokens) or any(w.has_requests for w in ws):
            assert time.monotonic() < deadline, f"hung: {self.finished} {[w.core.load() for w in ws]}"
            self.step()
            if not any(w.has_work for w in ws):
                time.sleep(0.001)


def computed(w) -> int:
    return w.core.num_computed_prompt_tokens


@pytest.mark.parametrize("k", [1, 2, 4])
def test_prefill_worker_fetches_from_decode_worker(workers, prompts, k):
    """The decode worker decoded the previous turn X: the prefill worker (its cache empty) fetches
    the shared pages of Y from it, computes only the rest, and the decode side gets all of Y."""
    p, d = workers
    x, y, want = prompts
    r = Router(p, d)
    r.disaggregated("x", x)
    r.run()
    p.core.reset_prefix_cache()
    before = computed(p)
    r.disaggregated("y", y, fetch_pages=k, holder=d)
    r.run()
    assert r.finished["y"] == ("length", None) and r.tokens["y"] == want
    assert r.exports["y"].num_tokens == k * PAGE
    assert r.cached["y"] == k * PAGE and computed(p) - before == len(y) - k * PAGE
    assert p.core.prefix.num_failed_fetches == 0

    p.core.reset_prefix_cache()  # the same prompt, fetch off: the same tokens
    r.disaggregated("y-off", y)
    r.run()
    assert r.tokens["y-off"] == want and r.cached["y-off"] == 0


@pytest.mark.parametrize("k", [1, 4])
def test_decode_worker_fetches_from_prefill_worker(workers, prompts, k):
    """The prefill worker prefilled X: the decode worker (its cache empty) fetches Y's shared pages
    from it, prefills the rest locally and decodes."""
    p, d = workers
    x, y, want = prompts
    r = Router(p, d)
    r.disaggregated("x", x)
    r.run()
    d.core.reset_prefix_cache()
    before = computed(d)
    fetch = r.local("y", y, k, holder=p)
    assert (fetch.start_token, fetch.num_tokens, len(fetch.descriptors)) == (0, k * PAGE, 1)
    assert d.stage("y").name == "LOCAL_PREFILL"
    r.run()
    assert r.finished["y"] == ("length", None) and r.tokens["y"] == want
    assert r.cached["y"] == k * PAGE and computed(d) - before == len(y) - k * PAGE


def test_requester_takes_its_own_cached_pages_first(workers, prompts):
    """A requester that holds the first pages itself fetches only the pages after them."""
    p, d = workers
    x, y, want = prompts
    r = Router(p, d)
    r.disaggregated("x", x)  # both caches now hold X's 4 full pages
    r.run()
    d.core.kv.pool.reset_prefix_cache()
    r.local("warm", x[:33], 1, holder=p)  # the decode worker caches X's first 2 pages (fetching 1 of them)
    r.run()
    fetch = r.local("y", y, 4, holder=p)
    assert (fetch.start_token, fetch.num_tokens) == (2 * PAGE, 2 * PAGE)
    r.run()
    assert r.tokens["y"] == want and r.cached["y"] == 4 * PAGE
    assert r.local("y-again", y, 4, holder=p) is None, "all 4 pages are cached here now: nothing to fetch"
    r.run()
    assert r.tokens["y-again"] == want


def test_holder_evicted_pages_before_the_fetch(workers, prompts):
    """The holder lost the last pages of the prefix: it pins and sends fewer and the requester
    computes the rest; it lost all: it sends nothing and the fetch is abandoned. Same tokens."""
    p, d = workers
    x, y, want = prompts
    r = Router(p, d)
    r.disaggregated("x", x)
    r.run()
    evict_tail(p, 2)  # X's pages 2 and 3 are handed out and freed again: gone from the cache
    d.core.reset_prefix_cache()
    queries = p.core.kv.pool.queries
    r.local("y", y, 4, holder=p)
    r.run()
    assert p.core.kv.pool.queries == queries, "an export is not a prefix-cache query of the holder's own"
    assert r.exports["y"].num_tokens == 2 * PAGE
    assert r.tokens["y"] == want and r.cached["y"] == 2 * PAGE

    p.core.reset_prefix_cache()
    d.core.reset_prefix_cache()
    before = computed(d)
    r.local("y-none", y, 4, holder=p)
    assert r.exports["y-none"].num_tokens == 0 and r.exports["y-none"].error is None
    r.run()
    assert r.tokens["y-none"] == want and computed(d) - before == len(y)
    assert d.core.prefix.num_failed_fetches == 1


def evict_tail(w, n: int) -> None:
    """Evict the `n` least recently freed cached pages (a finished request's tail comes first)."""
    pool = w.core.kv.pool
    pages = pool.allocate(pool.num_free_pages - pool.num_cached_pages + n)
    pool.free(pages)


def test_request_cancelled_before_and_during_its_fetch(workers, prompts, monkeypatch):
    p, d = workers
    x, y, want = prompts
    r = Router(p, d)
    r.disaggregated("x", x)
    r.run()
    d.core.reset_prefix_cache()
    fetch = r.local("early", y, 4)  # cancelled before the holder is asked: the export finds no receiver
    assert d.cancel("early")
    exp = p.export_prefix(fetch, y)
    assert exp.num_tokens == 0 and exp.error, exp
    r.run()
    assert r.finished["early"][0] == "abort"

    monkeypatch.setattr(p.connector.sender, "finish", lambda *args: None)  # the KV goes, the final notice never
    r.local("mid", y, 4, holder=p)
    assert r.exports["mid"].num_tokens == 4 * PAGE
    def under_way() -> bool:
        r.step()
        inc = d.connector.receiver.book.get("mid#prefix")
        return inc is not None and inc.status.state.name == "TRANSFERRING"

    wait_until(under_way, what="the fetch under way")
    assert d.cancel("mid")
    r.run()
    assert r.finished["mid"][0] == "abort"


def test_fetch_fails_or_times_out_and_the_prompt_is_computed(tiny_model, prompts, monkeypatch):
    """The holder closed mid-transfer, and a fetch no holder ever serves (the transfer deadline):
    the requester computes the whole prompt, same tokens."""
    x, y, want = prompts
    p, d = _pair(tiny_model("llama"), "nixl", deadline_s=1.5)
    r = Router(p, d)
    try:
        r.disaggregated("x", x)
        r.run()
        d.core.reset_prefix_cache()
        t0 = time.monotonic()
        r.local("lost", y, 4)  # the router never asks a holder
        r.run()
        assert r.tokens["lost"] == want and time.monotonic() - t0 >= 1.5
        assert d.core.prefix.num_failed_fetches == 1

        d.core.reset_prefix_cache()
        monkeypatch.setattr(p.connector.sender, "finish", lambda *args: None)
        r.local("closed", y, 4, holder=p)
        assert r.exports["closed"].num_tokens == 4 * PAGE
        p.close()  # the export fails: the requester hears it and computes
        assert p.core.num_free_pages == p.core.num_pages and not p.core.prefix.exports
        assert p.connector.tracking == {"sending": 0, "receiving": 0, "fetching": 0}
        r.prefill = None
        before = computed(d)
        r.run()
        assert r.tokens["closed"] == want and computed(d) - before == len(y)
        assert d.core.prefix.num_failed_fetches == 2
        assert_nothing_held(d)
    finally:
        if r.prefill is not None:
            p.close()
        d.close()


def test_refusals(workers, prompts, tiny_model):
    p, d = workers
    _, y, _ = prompts
    with pytest.raises(ValueError, match=r"num_pages must be in \[1, 5\]"):
        d.admit("too-many", y, GREEDY, remote_prefix=RemotePrefix(6))  # 84 tokens: the last one is computed here
    with pytest.raises(ValueError, match="num_pages must be an integer >= 1"):
        RemotePrefix(0)
    colocated = DecodeWorker(tiny_model("llama"), transport=None, detokenize=False, **ENGINE)
    try:
        with pytest.raises(ValueError, match="sends and receives"):
            colocated.admit("c", y, GREEDY, remote_prefix=RemotePrefix(2))
    finally:
        colocated.close()
