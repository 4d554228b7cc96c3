"""64 concurrent transfers over the real grpc KV transport on 127.0.0.1, in the order a
prefill engine makes them: every transfer of a step is started (Handshake once, then one
Begin and one open Push stream per request and lane) before any layer is sent. None may be
lost: each ends DONE on both sides with the sender's exact bytes in the receiver's pages,
and every page comes back to both pools.

Regression: the receiver's service once ran on a sync gRPC server with 8 threads. Each open
Push stream held a thread until its final notice, so the 9th Begin queued behind 8 streams
that waited for layers its own caller was to send after the Begin, and failed after the 5 s
handshake timeout (DEADLINE_EXCEEDED).
"""
from __future__ import annotations

import base64

import pytest
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.registry import create_receiver, create_sender
from tests.helpers import wait_until
from tests.integration.kv_peer import Child, make_pool, request_tokens

CONCURRENT = 64
LAYERS = 4
TOKENS = 40  # 3 pages of 16, 1 page of 64
SPEC = {"model_id": "tiny-kv", "num_layers": LAYERS, "num_kv_heads": 4, "head_dim": 16}


def lay(page_size: int = 16, head_start: int = 0, num_heads: int = 4) -> dict:
    return {"num_layers": LAYERS, "page_size": page_size, "head_start": head_start, "num_heads": num_heads,
            "head_dim": SPEC["head_dim"], "dtype": "float32"}


def need(layout: dict) -> int:
    return -(-TOKENS // layout["page_size"])


def page_ids(layout: dict, i: int) -> list[int]:
    """Request i's pages: disjoint per request, in reverse order (no request's pages are consecutive)."""
    n = need(layout)
    return list(range((i + 1) * n - 1, i * n - 1, -1))


class Receiver:
    def __init__(self, layout: dict, **cfg) -> None:
        self.layout = layout
        self.pool = make_pool(SPEC, layout, CONCURRENT * need(layout), seed=0)
        for t in self.pool.layers:
            t.zero_()
        self.released: list[str] = []
        self.obj = create_receiver("grpc", self.pool, TransferConfig(**cfg),
                                   on_release=lambda rid, pages: self.released.append(rid))


def expected(src_layout: dict, seed: int, src_pages: list[int], dst_layout: dict) -> torch.Tensor:
    """What the receiver must hold: the sender's tokens, cut to the heads both hold."""
    tok = request_tokens(make_pool(SPEC, src_layout, CONCURRENT * need(src_layout), seed), src_pages, TOKENS)
    lo = max(src_layout["head_start"], dst_layout["head_start"])
    hi = min(src_layout["head_start"] + src_layout["num_heads"], dst_layout["head_start"] + dst_layout["num_heads"])
    return tok[:, :, :, lo - src_layout["head_start"]:hi - src_layout["head_start"]]


def check_all_arrived(recv: Receiver, rids: list[str], src_layout: dict, seed: int) -> None:
    for i, rid in enumerate(rids):
        status = recv.obj.wait(rid, 30)  # a guard against a hang, not a measurement
        assert status.state.name == "DONE", f"{rid}: {status.state.name} {status.error}"
        assert status.first_token == 7 and status.prompt_len == TOKENS
        got = request_tokens(recv.pool, page_ids(recv.layout, i), TOKENS)
        assert torch.equal(got, expected(src_layout, seed, page_ids(src_layout, i), recv.layout)), rid
        recv.obj.take(rid)
    assert recv.obj.tracked_pages() == []
    assert recv.released == []  # released is the failure path on the receiver: nothing failed


# (sender layout, receiver layout, TransferConfig of both sides)
CASES = {
    "same-layout": (lay(16), lay(16), {}),
    # 128 streams (two lanes per request), token runs re-laid out into pages of 64
    "two-lanes-pages-16-to-64": (lay(16), lay(64), {"grpc_streams": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_64_concurrent_transfers_in_process(case):
    src_l, dst_l, cfg = CASES[case]
    seed = 11
    recv = Receiver(dst_l, **cfg)
    src_pool = make_pool(SPEC, src_l, CONCURRENT * need(src_l), seed)
    sent_released: list[tuple[str, str]] = []
    sender = create_sender("grpc", src_pool, TransferConfig(**cfg),
                           on_release=lambda rid, pages, state: sent_released.append((rid, state.name)))
    rids = [f"load-{case}-{i}" for i in range(CONCURRENT)]
    try:
        descs = [recv.obj.expect(rid, page_ids(dst_l, i), TOKENS) for i, rid in enumerate(rids)]
        for i, (rid, desc) in enumerate(zip(rids, descs)):  # a step's starts, all before its forward
            status = sender.start(rid, [desc], page_ids(src_l, i), TOKENS)
            assert status.state.name == "WAITING", f"start {i} of {CONCURRENT}: {status.state.name} {status.error}"
        for layer in range(LAYERS):  # the forward: layer by layer, every request of the step
            for rid in rids:
                sender.send_layer(rid, layer)
        for rid in rids:
            sender.finish(rid, 7, TOKENS)
        check_all_arrived(recv, rids, src_l, seed)
        for rid in rids:
            status = sender.wait(rid, 30)
            assert status.state.name == "DONE", f"{rid}: {status.state.name} {status.error}"
        wait_until(lambda: len(sent_released) == CONCURRENT, 10, what="every source page set released")
        assert sorted(sent_released) == sorted((rid, "DONE") for rid in rids)
        assert sender.tracked_pages() == []
    finally:
        sender.close()
        recv.obj.close()


def test_64_concurrent_transfers_from_another_process():
    """The same with the sender in its own process, as a prefill worker is: its starts come
    one by one over the test's pipe, then every request's layers and final notice."""
    src_l, dst_l, seed = lay(16), lay(16), 12
    child = Child()
    recv = Receiver(dst_l)
    rids = [f"load-proc-{i}" for i in range(CONCURRENT)]
    try:
        child.call("sender", name="s", transport="grpc", spec=SPEC, layout=src_l,
                   num_pages=CONCURRENT * need(src_l), seed=seed)
        for i, rid in enumerate(rids):
            desc = base64.b64encode(recv.obj.expect(rid, page_ids(dst_l, i), TOKENS).to_bytes()).decode()
            reply = child.call("start", name="s", request_id=rid, descriptors=[desc], src_pages=page_ids(src_l, i),
                               num_tokens=TOKENS)
            assert reply["state"] == "WAITING", f"start {i} of {CONCURRENT}: {reply}"
        for rid in rids:  # call, not post: Child reads replies with select() on a buffered pipe,
            # so replies arriving together can wait in its buffer unseen (tests/integration/kv_peer.py)
            child.call("send", name="s", request_id=rid, layers=list(range(LAYERS)), first_token=7,
                       prompt_len=TOKENS)
        check_all_arrived(recv, rids, src_l, seed)
        for rid in rids:
            assert child.call("wait", name="s", request_id=rid, wait_s=30)["state"] == "DONE"
        state = wait_until(lambda: (s := child.call("state", name="s"))["tracked"] == [] and s, 10,
                           what="the sender's pages released")
        assert sorted(state["released"]) == sorted(rids)
    finally:
        recv.obj.close()
        try:
            child.call("close", name="s")
        finally:
            child.close()

