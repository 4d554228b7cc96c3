"""Two real OS processes move paged KV over nixl and grpc: bytes exact in the receiver's
pages across page-size, head-range and dtype mappings; incompatible peers refused before
any byte; a killed peer, a deadline and a dead endpoint end FAILED in bounded time; page
ids outside the allocation rejected; no pages left tracked on either side."""
from __future__ import annotations

import base64
import os
import socket
import subprocess

import numpy as np
import pytest
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.registry import create_receiver, create_sender
from tests.helpers import wait_until
from tests.integration.kv_peer import Child, make_pool, request_tokens

SPEC = {"model_id": "tiny-kv", "num_layers": 6, "num_kv_heads": 8, "head_dim": 32}
NUM_PAGES = 48
TOKENS = 200


def lay(page_size=16, head_start=0, num_heads=8, dtype="float32", num_layers=6, tp_size=1, tp_rank=0):
    return {"num_layers": num_layers, "page_size": page_size, "head_start": head_start, "num_heads": num_heads,
            "head_dim": SPEC["head_dim"], "dtype": dtype, "tp_size": tp_size, "tp_rank": tp_rank}


def pages(n_needed: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(NUM_PAGES)[:n_needed].tolist()


def need(layout: dict, tokens: int = TOKENS) -> int:
    return -(-tokens // layout["page_size"])


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def child(transport):
    c = Child()
    yield c
    c.close()


class Side:
    """A receiver or sender in the test process, with its release log."""

    def __init__(self, kind: str, transport: str, layout: dict, seed: int = 0, **cfg) -> None:
        from kv_transfer.layout import ModelSpec  # noqa: F401  (import check)

        self.pool = make_pool(SPEC, layout, NUM_PAGES, seed)
        self.released: list[str] = []
        config = TransferConfig(**cfg)
        if kind == "receiver":
            for t in self.pool.layers:
                t.zero_()
            self.obj = create_receiver(transport, self.pool, config,
                                       on_release=lambda rid, p: self.released.append(rid))
        else:
            self.obj = create_sender(transport, self.pool, config,
                                     on_release=lambda rid, p, st: self.released.append(rid))

    def close(self):
        self.obj.close()


def desc_b64(desc: DestinationDescriptor) -> str:
    return base64.b64encode(desc.to_bytes()).decode()


def expected(src_layout: dict, seed: int, src_pages: list[int], dst_layout: dict, tokens: int = TOKENS):
    tok = request_tokens(make_pool(SPEC, src_layout, NUM_PAGES, seed), src_pages, tokens)
    lo = max(src_layout["head_start"], dst_layout["head_start"])
    hi = min(src_layout["head_start"] + src_layout["num_heads"], dst_layout["head_start"] + dst_layout["num_heads"])
    tok = tok[:, :, :, lo - src_layout["head_start"]:hi - src_layout["head_start"]]
    return tok.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dst_layout["dtype"]])


def assert_no_leaks(*sides, children=()):
    for s in sides:
        assert s.obj.tracked_pages() == []
    for c, name in children:
        assert c.call("state", name=name)["tracked"] == []


CASES = {  # (sender layout, receiver layout, TransferConfig of both sides, seconds between layers, before the final)
    "same-layout": (lay(16), lay(16), {}, 0.0, 0.0),
    "pages-16-to-64": (lay(16), lay(64), {}, 0.0, 0.0),
    "pages-64-to-16": (lay(64), lay(16), {}, 0.0, 0.0),
    "float32-to-bfloat16": (lay(16), lay(16, dtype="bfloat16"), {}, 0.0, 0.0),
    "three-grpc-lanes": (lay(16), lay(64), {"grpc_streams": 3, "chunk_bytes": 16384}, 0.0, 0.0),  # striped, small chunks
    # nixl: layers one by one (READs made when posted, then the rest prepared in one pass), and
    # every layer its own READ prepared at Begin (no coalescing)
    "layers-one-by-one": (lay(16), lay(16), {}, 0.05, 0.0),
    "one-read-per-layer": (lay(16), lay(16), {"nixl_coalesce_reads": False}, 0.0, 0.0),
    # the first token comes well after the last layer, as when the sampler runs after the forward:
    # the receiver must still let go of the request (and park its poller) once both are in
    "final-after-last-read": (lay(16), lay(16), {}, 0.0, 0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pages_arrive_exact(transport, child, case):
    src_l, dst_l, cfg, delay_s, final_delay_s = CASES[case]
    name = f"s-{case}"
    child.call("sender", name=name, transport=transport, spec=SPEC, layout=src_l, num_pages=NUM_PAGES, seed=11,
               config=cfg or None)
    recv = Side("receiver", transport, dst_l, **cfg)
    try:
        rid = f"req-{case}"
        dst_pages, src_pages = pages(need(dst_l), 1), pages(need(src_l), 2)
        desc = recv.obj.expect(rid, dst_pages, TOKENS)
        start = child.call("start", name=name, request_id=rid, descriptors=[desc_b64(desc)], src_pages=src_pages,
                           num_tokens=TOKENS)
        assert start["state"] == "WAITING", start
        child.call("send", name=name, request_id=rid, layers=list(range(6)), delay_s=delay_s, first_token=42,
                   prompt_len=TOKENS, final_delay_s=final_delay_s)
        status = recv.obj.wait(rid, 20)
        assert status.state.name == "DONE", status.error
        assert status.first_token == 42 and status.prompt_len == TOKENS
        got = request_tokens(recv.pool, dst_pages, TOKENS)
        assert torch.equal(got, expected(src_l, 11, src_pages, dst_l))
        assert child.call("wait", name=name, request_id=rid, wait_s=10)["state"] == "DONE"
        recv.obj.take(rid)
        assert_no_leaks(recv, children=[(child, name)])
        assert recv.obj.transfers_in_flight() == 0, "a finished transfer keeps the receiver's poller busy"
        assert child.call("state", name=name)["released"] == [rid]
    finally:
        recv.close()
        child.call("close", name=name)


def test_heads_one_sender_to_two_receivers(transport, child):
    """TP 1 -> 2: a sender holding heads [0, 8) feeds receivers holding [0, 4) and [4, 8)."""
    src_l = lay(16)
    halves = {"ra": lay(16, 0, 4, tp_size=2, tp_rank=0), "rb": lay(16, 4, 4, tp_size=2, tp_rank=1)}
    sender = Side("sender", transport, src_l, seed=5)
    rid, src_pages, dst_pages = "req-split", pages(need(src_l), 3), pages(need(src_l), 4)
    try:
        descs = []
        for name, layout in halves.items():
            child.call("receiver", name=name, transport=transport, spec=SPEC, layout=layout, num_pages=NUM_PAGES)
            descs.append(DestinationDescriptor.from_bytes(base64.b64decode(
                child.call("expect", name=name, request_id=rid, page_ids=dst_pages, num_tokens=TOKENS)["descriptor"])))
        assert sender.obj.start(rid, descs, src_pages, TOKENS).state.name == "WAITING"
        for layer in range(6):
            sender.obj.send_layer(rid, layer)
        sender.obj.finish(rid, 7, TOKENS)
        assert sender.obj.wait(rid, 20).state.name == "DONE"
        from tests.integration.kv_peer import digest
        for name, layout in halves.items():
            reply = child.call("wait", name=name, request_id=rid, wait_s=20, pages=dst_pages)
            assert reply["state"] == "DONE", reply
            assert reply["digest"] == digest(expected(src_l, 5, src_pages, layout))
            child.call("take", name=name, request_id=rid)
        assert_no_leaks(sender, children=[(child, n) for n in halves])
    finally:
        sender.close()
        for name in halves:
            child.call("close", name=name)


def test_heads_two_senders_to_one_receiver(transport, child):
    """TP 2 -> 1: senders holding [0, 4) and [4, 8) feed one receiver holding [0, 8). (grpc: two
    lanes each, so the first sender's lanes end while the receiver still waits for the second.)"""
    parts = {"sa": (lay(16, 0, 4, tp_size=2, tp_rank=0), 21), "sb": (lay(64, 4, 4, tp_size=2, tp_rank=1), 22)}
    dst_l = lay(16)
    recv = Side("receiver", transport, dst_l)
    rid, dst_pages = "req-merge", pages(need(dst_l), 6)
    try:
        desc = desc_b64(recv.obj.expect(rid, dst_pages, TOKENS))
        src_pages = {}
        for name, (layout, seed) in parts.items():
            child.call("sender", name=name, transport=transport, spec=SPEC, layout=layout, num_pages=NUM_PAGES,
                       seed=seed, config={"grpc_streams": 2})
            src_pages[name] = pages(need(layout), seed)
            assert child.call("start", name=name, request_id=rid, descriptors=[desc], src_pages=src_pages[name],
                              num_tokens=TOKENS)["state"] == "WAITING"
        for name in parts:
            child.call("send", name=name, request_id=rid, layers=list(range(6)), first_token=9, prompt_len=TOKENS)
        status = recv.obj.wait(rid, 20)
        assert status.state.name == "DONE", status.error
        want = torch.cat([expected(layout, seed, src_pages[name], dst_l) for name, (layout, seed) in parts.items()],
                         dim=3)
        assert torch.equal(request_tokens(recv.pool, dst_pages, TOKENS), want)
        for name in parts:
            assert child.call("wait", name=name, request_id=rid, wait_s=10)["state"] == "DONE"
        recv.obj.take(rid)
        assert_no_leaks(recv, children=[(child, n) for n in parts])
    finally:
        recv.close()
        for name in parts:
            child.call("close", name=name)


@pytest.mark.parametrize("field,sender_spec,sender_layout", [
    ("compat.num_layers", {**SPEC, "num_layers": 4}, lay(num_layers=4)),
    ("compat.model_id", {**SPEC, "model_id": "other-model"}, lay()),
    ("compat.dtype", SPEC, lay(dtype="bfloat16")),  # bf16 -> f32 is not an allowed conversion
])
def test_incompatible_sender_refused_before_any_byte(transport, child, field, sender_spec, sender_layout):
    recv = Side("receiver", transport, lay(16))
    name, rid = "s-bad", "req-bad"
    try:
        child.call("sender", name=name, transport=transport, spec=sender_spec, layout=sender_layout,
                   num_pages=NUM_PAGES, seed=1)
        dst_pages = pages(need(lay(16)), 7)
        desc = recv.obj.expect(rid, dst_pages, TOKENS)
        reply = child.call("start", name=name, request_id=rid, descriptors=[desc_b64(desc)],
                           src_pages=pages(need(sender_layout), 8), num_tokens=TOKENS)
        assert reply["state"] == "FAILED" and field in reply["error"], reply
        assert recv.obj.status(rid).state.name == "BOOTSTRAPPING"  # nothing began, nothing moved
        assert all(int(t.count_nonzero()) == 0 for t in recv.pool.layers)
        recv.obj.cancel(rid)
        assert recv.released == [rid]
        assert_no_leaks(recv, children=[(child, name)])
    finally:
        recv.close()
        child.call("close", name=name)


def test_sender_killed_mid_transfer(transport):
    """Found dead well before the 30 s deadline: grpc by its broken stream, nixl by its
    liveness probe (the sender is idle between layers, so nothing else would notice)."""
    peer = Child()
    recv = Side("receiver", transport, lay(16), deadline_s=30.0)
    rid = "req-kill-sender"
    try:
        peer.call("sender", name="s", transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES, seed=3)
        desc = recv.obj.expect(rid, pages(need(lay(16)), 9), TOKENS)
        assert peer.call("start", name="s", request_id=rid, descriptors=[desc_b64(desc)],
                         src_pages=pages(need(lay(16)), 10), num_tokens=TOKENS)["state"] == "WAITING"
        peer.post("send", name="s", request_id=rid, layers=list(range(6)), delay_s=0.3)
        wait_until(lambda: recv.obj.status(rid).state.name == "TRANSFERRING", 10, 0.01, "layers moving")
        peer.kill()
        status = recv.obj.wait(rid, 5)  # the deadline is 30 s: only the peer's loss ends it this soon
        assert status.state.name == "FAILED", status
        assert "deadline" not in status.error, status.error
        # pages come back once no read into them is in flight
        wait_until(lambda: recv.released == [rid], 5, 0.01, "the pages released")
        assert_no_leaks(recv)
    finally:
        peer.kill()
        peer.close()
        recv.close()


def test_receiver_killed_mid_transfer(transport):
    """The sender learns of it well before the 30 s deadline while it computes the next layer."""
    peer = Child()
    sender = Side("sender", transport, lay(16), seed=4, deadline_s=30.0)
    rid = "req-kill-receiver"
    try:
        peer.call("receiver", name="r", transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES)
        desc = DestinationDescriptor.from_bytes(base64.b64decode(peer.call(
            "expect", name="r", request_id=rid, page_ids=pages(need(lay(16)), 11), num_tokens=TOKENS)["descriptor"]))
        assert sender.obj.start(rid, [desc], pages(need(lay(16)), 12), TOKENS).state.name == "WAITING"
        sender.obj.send_layer(rid, 0)
        sender.obj.send_layer(rid, 1)
        peer.kill()
        # no further layer, so nothing sent could fail; the deadline is 30 s: the probe finds the loss
        status = sender.obj.wait(rid, 5)
        assert status.state.name == "FAILED", status
        assert "deadline" not in status.error, status.error
        assert sender.released == [rid]
        assert_no_leaks(sender)
    finally:
        peer.kill()
        peer.close()
        sender.close()


def test_transfer_slower_than_deadline_fails_both_sides(transport, child):
    recv = Side("receiver", transport, lay(16), deadline_s=1.0)
    name, rid = "s-slow", "req-slow"
    try:
        child.call("sender", name=name, transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES, seed=2,
                   config={"deadline_s": 1.0})
        desc = recv.obj.expect(rid, pages(need(lay(16)), 13), TOKENS)
        child.call("start", name=name, request_id=rid, descriptors=[desc_b64(desc)],
                   src_pages=pages(need(lay(16)), 14), num_tokens=TOKENS)
        child.call("send", name=name, request_id=rid, layers=[0])  # then the "compute" stalls
        status = recv.obj.wait(rid, 5)
        assert status.state.name == "FAILED" and ("deadline" in status.error or "stream ended" in status.error)
        assert child.call("wait", name=name, request_id=rid, wait_s=5)["state"] == "FAILED"
        assert recv.released == [rid]
        assert_no_leaks(recv, children=[(child, name)])
        assert child.call("state", name=name)["released"] == [rid]
    finally:
        recv.close()
        child.call("close", name=name)


def test_handshake_to_dead_endpoint_fails_fast(transport, child):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    recv = Side("receiver", transport, lay(16))
    name, rid = "s-dead", "req-dead"
    try:
        real = recv.obj.expect(rid, pages(need(lay(16)), 15), TOKENS)
        desc = DestinationDescriptor(rid, real.transport, dead, real.page_ids, TOKENS, real.layout, real.compat)
        child.call("sender", name=name, transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES, seed=2,
                   config={"handshake_timeout_s": 1.0})
        reply = child.call("start", name=name, request_id=rid, descriptors=[desc_b64(desc)],
                           src_pages=pages(need(lay(16)), 16), num_tokens=TOKENS)
        assert reply["state"] == "FAILED" and dead in reply["error"], reply
        assert child.call("state", name=name) == {"tracked": [], "released": [rid]}
        recv.obj.cancel(rid)
        assert_no_leaks(recv)
    finally:
        recv.close()
        child.call("close", name=name)


def test_receiver_rejects_pages_outside_allocation(transport, child):
    recv = Side("receiver", transport, lay(16))
    name, rid = "s-evil", "req-evil"
    try:
        child.call("sender", name=name, transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES, seed=2)
        n = need(lay(16))
        real = recv.obj.expect(rid, list(range(n)), TOKENS)
        forged = DestinationDescriptor(rid, real.transport, real.endpoint, tuple(range(n, 2 * n)), TOKENS, real.layout,
                                       real.compat)
        reply = child.call("start", name=name, request_id=rid, descriptors=[desc_b64(forged)],
                           src_pages=pages(n, 17), num_tokens=TOKENS)
        assert reply["state"] == "FAILED" and "outside the request's allocation" in reply["error"], reply
        status = recv.obj.wait(rid, 2)
        assert status.state.name == "FAILED" and "outside" in status.error
        assert all(int(t.count_nonzero()) == 0 for t in recv.pool.layers)  # not a byte written anywhere
        assert recv.released == [rid]
        assert_no_leaks(recv, children=[(child, name)])
    finally:
        recv.close()
        child.call("close", name=name)


def _listening(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_everything_listens_on_loopback_only(transport, child):
    child.call("receiver", name="r-lo", transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES)
    child.call("sender", name="s-lo", transport=transport, spec=SPEC, layout=lay(16), num_pages=NUM_PAGES, seed=1)
    recv = Side("receiver", transport, lay(16))
    try:
        addrs = _listening(child.proc.pid) + _listening(os.getpid())
        assert addrs, "expected the receivers' listeners"
        for addr in addrs:
            host = addr.rsplit(":", 1)[0].strip("[]")
            assert host in ("127.0.0.1", "::ffff:127.0.0.1", "::1"), f"listening on {addr}"
    finally:
        recv.close()
        child.call("close", name="r-lo")
        child.call("close", name="s-lo")
