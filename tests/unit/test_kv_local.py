"""kv_transfer in one process: the local transport end to end, the layout mapping against
a token-by-token reference, the receiver's validation, states, handshake and descriptors,
the gRPC transport's Push codec."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kv_transfer import (CompatInfo, DestinationDescriptor, KVLayout, KVPool, ModelSpec, TransferConfig,
                         TransferRejected, TransferState, TransferStatus)
from kv_transfer.handshake import answer, make_request
from kv_transfer.local import LocalHub, LocalReceiver, LocalSender
from kv_transfer.mapping import read_token_run, write_pages, write_token_run
from kv_transfer.wire import WireError, decode_push, encode_chunk, encode_chunk_into, encode_final
from proto.pdcluster.v1 import kv_transfer_pb2 as pb
from tests.helpers import wait_until

SPEC = ModelSpec("tiny-kv", num_layers=3, num_kv_heads=4, head_dim=8)
T = 70


def pool(page_size=16, head_start=0, num_heads=4, dtype="float32", pages=24, seed=None, tp=(1, 0)) -> KVPool:
    p = KVPool.allocate(SPEC, KVLayout(3, page_size, head_start, num_heads, 8, dtype, *tp), pages)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in p.layers:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return p


def reference_tokens(p: KVPool, pages: list[int], n: int) -> torch.Tensor:
    """Token by token, straight from the layout rule: token t is in pages[t // ps] at t % ps."""
    ps = p.layout.page_size
    return torch.stack([torch.stack([layer[pages[t // ps], :, t % ps] for t in range(n)], dim=1)
                        for layer in p.layers])  # [layers, 2, n, heads, D]


def transfer(src: KVPool, dsts: list[KVPool], n=T, config=None):
    hub = LocalHub()
    released = []
    receivers = [LocalReceiver(d, config, on_release=lambda r, pg: released.append(r), hub=hub) for d in dsts]
    sender = LocalSender(src, config, hub=hub)
    dst_pages = [list(range(d.num_pages - 1, d.num_pages - 1 - d.layout.pages_for(n), -1)) for d in dsts]
    descs = [r.expect("r1", pg, n) for r, pg in zip(receivers, dst_pages)]
    src_pages = list(range(2, 2 + src.layout.pages_for(n)))
    assert sender.start("r1", descs, src_pages, n).state == TransferState.WAITING
    for layer in range(3):
        sender.send_layer("r1", layer)
    sender.finish("r1", 5, n)
    return sender, receivers, src_pages, dst_pages, released


@pytest.mark.parametrize("src_ps,dst_ps", [(16, 16), (16, 64), (64, 16), (8, 48)])
def test_local_pages_exact_across_page_sizes(src_ps, dst_ps):
    src, dst = pool(src_ps, seed=1), pool(dst_ps)
    sender, (recv,), sp, (dp,), _ = transfer(src, [dst])
    assert recv.status("r1").state == TransferState.DONE and sender.status("r1").state == TransferState.DONE
    assert torch.equal(reference_tokens(dst, dp, T), reference_tokens(src, sp, T))
    recv.take("r1")
    assert recv.tracked_pages() == [] and sender.tracked_pages() == []


def test_local_head_split_and_dtype():
    src = pool(16, seed=2)
    a, b = pool(32, 0, 2, "bfloat16", tp=(2, 0)), pool(16, 2, 2, "bfloat16", tp=(2, 1))  # TP 1 -> 2
    sender, (ra, rb), sp, (pa, pb_), _ = transfer(src, [a, b])
    want = reference_tokens(src, sp, T).to(torch.bfloat16)
    assert torch.equal(reference_tokens(a, pa, T), want[:, :, :, 0:2])
    assert torch.equal(reference_tokens(b, pb_, T), want[:, :, :, 2:4])
    assert sender.status("r1").state == TransferState.DONE


def test_mapping_partial_runs_match_reference():
    src, dst = pool(16, seed=3), pool(64)
    sp, dp = [5, 1, 7, 3, 9], [4, 2]
    for start, n in [(0, 7), (7, 30), (37, 33)]:
        for li in range(3):
            data = read_token_run(src.layers[li], np.array(sp), src.layout, start, n)
            write_token_run(dst.layers[li], np.array(dp), dst.layout, start, data, src.layout)
    assert torch.equal(reference_tokens(dst, dp, 70), reference_tokens(src, sp, 70))


def test_receiver_validates_every_run():
    dst = pool(16)
    hub = LocalHub()
    released = []
    recv = LocalReceiver(dst, on_release=lambda r, pg: released.append(r), hub=hub)
    recv.expect("r1", [3, 4, 5, 6, 7], T)
    book = recv.book
    book.begin("r1", "s", pool(16).layout, [3, 4, 5, 6, 7])
    with pytest.raises(TransferRejected, match="outside the request's allocation"):
        book.check_run("r1", "s", 0, 0, 16, dst_page_ids=[11])
    assert recv.status("r1").state == TransferState.FAILED and released == ["r1"]
    recv.expect("r2", [3, 4, 5, 6, 7], T)
    book.begin("r2", "s", pool(16).layout, [3, 4, 5, 6, 7])
    for bad, match in [(dict(layer=3), "layer 3"), (dict(token_start=60, num_tokens=16), "outside"),
                       (dict(nbytes=10), "bytes")]:
        recv.expect(f"x{match}", [10, 11, 12, 13, 14], T)
        book.begin(f"x{match}", "s", pool(16).layout, [10, 11, 12, 13, 14])
        args = dict(layer=0, token_start=0, num_tokens=16, nbytes=None) | bad
        with pytest.raises(TransferRejected, match=match):
            book.check_run(f"x{match}", "s", args["layer"], args["token_start"], args["num_tokens"],
                           nbytes=args["nbytes"])
    book.check_run("r2", "s", 0, 0, 16)
    book.mark("r2", "s", 0, 0, 16)
    with pytest.raises(TransferRejected, match="written twice"):
        book.check_run("r2", "s", 0, 0, 16)
    with pytest.raises(TransferRejected, match="unknown request"):
        book.check_run("nope", "s", 0, 0, 16)
    assert recv.tracked_pages() == []
    with pytest.raises(ValueError, match="page_ids must lie"):
        recv.expect("big", [0, 99, 1, 2, 3], T)
    with pytest.raises(ValueError, match="need 5 pages"):
        recv.expect("few", [0, 1], T)


def test_deadline_fails_and_releases():
    """No sender begins within the begin timeout: FAILED, pages handed back."""
    dst = pool(16)
    released = []
    recv = LocalReceiver(dst, on_release=lambda r, pg: released.append((r, pg)), hub=LocalHub())
    recv.expect("slow", [0, 1, 2, 3, 4], T, deadline_s=0.1, begin_timeout_s=0.1)
    status = recv.wait("slow", 2)
    assert status.state == TransferState.FAILED and "begin deadline" in status.error
    # FAILED is visible a moment before the reaper thread hands the pages back
    wait_until(lambda: released, 5, 0.005, "the pages handed back")
    assert released == [("slow", [0, 1, 2, 3, 4])]
    recv.close()


def test_transfer_deadline_runs_from_the_first_begin_not_from_expect():
    """A sender queued behind other work (a busy prefill worker) is not a slow transfer: the
    destination waits out the begin timeout, and the transfer deadline starts at begin()."""
    hub = LocalHub()
    dst, src = pool(16), pool(16, seed=3)
    recv = LocalReceiver(dst, hub=hub)
    sender = LocalSender(src, hub=hub)
    desc = recv.expect("queued", [0, 1, 2, 3, 4], T, deadline_s=0.3, begin_timeout_s=10.0)
    time.sleep(0.6)  # let twice the transfer deadline pass with no sender yet (the time is the test)
    assert recv.status("queued").state == TransferState.BOOTSTRAPPING
    assert sender.start("queued", [desc], [5, 6, 7, 8, 9], T).state == TransferState.WAITING
    sender.send_layer("queued", 0)  # then stalls: this is a slow transfer
    status = recv.wait("queued", 3)
    assert status.state == TransferState.FAILED and status.error == "deadline exceeded"
    # the ledger's own record: failed a deadline after the begin, not after the expect
    assert status.entered[TransferState.FAILED] - status.entered[TransferState.WAITING] > 0.25
    wait_until(lambda: recv.tracked_pages() == [], 5, 0.005, "the pages no longer tracked")
    sender.cancel("queued", "test over")
    recv.close()


def test_states_are_ordered_and_monotonic():
    assert TransferState.FAILED < TransferState.BOOTSTRAPPING < TransferState.WAITING < TransferState.TRANSFERRING \
        < TransferState.DONE
    st = TransferStatus("r")
    assert st.advance(TransferState.TRANSFERRING) and not st.advance(TransferState.WAITING)
    assert st.advance(TransferState.DONE) and not st.fail("late")
    assert st.state == TransferState.DONE and set(st.entered) == {TransferState.BOOTSTRAPPING,
                                                                   TransferState.TRANSFERRING, TransferState.DONE}
    assert min(TransferState.DONE, TransferState.FAILED) == TransferState.FAILED


def test_handshake_refuses_mismatch_naming_the_field():
    lay = pool(16).layout
    other = ModelSpec("tiny-kv", num_layers=3, num_kv_heads=4, head_dim=16)
    req = make_request(other, KVLayout(3, 16, 0, 4, 16, "float32"), "grpc", "s")
    reply = answer(req, SPEC, lay, "grpc", "r", TransferConfig().allowed_dtype_conversions)
    assert not reply.accepted and "compat.head_dim" in reply.reason
    forged = make_request(SPEC, lay, "grpc", "s")
    forged.compat.hash = "0" * 64
    assert "hash" in answer(forged, SPEC, lay, "grpc", "r", frozenset()).reason
    ok = answer(make_request(SPEC, lay, "grpc", "s"), SPEC, lay, "grpc", "r", frozenset())
    assert ok.accepted
    wrong_transport = answer(make_request(SPEC, lay, "nixl", "s"), SPEC, lay, "grpc", "r", frozenset())
    assert "transport" in wrong_transport.reason


def test_descriptor_round_trips_as_protobuf():
    lay = pool(16).layout
    d = DestinationDescriptor("r1", "nixl", "127.0.0.1:5", (3, 1, 2), 40, lay, CompatInfo.of(SPEC, lay))
    assert DestinationDescriptor.from_bytes(d.to_bytes()) == d


def test_config_and_layout_validation_name_the_field():
    with pytest.raises(ValueError, match="chunk_bytes"):
        TransferConfig(chunk_bytes=10)
    with pytest.raises(ValueError, match=r"grpc_streams must be in \[1, 16\], got 0"):
        TransferConfig(grpc_streams=0)
    with pytest.raises(ValueError, match="liveness_interval_s must be >= 0"):
        TransferConfig(liveness_interval_s=-1)
    with pytest.raises(ValueError, match="page_size"):
        KVLayout(3, 0, 0, 4, 8, "float32")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(3, 16, 0, 4, 8, "int7")


def test_local_sender_refused_by_incompatible_receiver_moves_nothing():
    hub = LocalHub()
    dst = pool(16)
    recv = LocalReceiver(dst, hub=hub)
    other = ModelSpec("other", 3, 4, 8)
    src = KVPool.allocate(other, KVLayout(3, 16, 0, 4, 8, "float32"), 8)
    sender = LocalSender(src, hub=hub)
    desc = recv.expect("r1", [0, 1, 2, 3, 4], T)
    status = sender.start("r1", [desc], [0, 1, 2, 3, 4], T)
    assert status.state == TransferState.FAILED and "model_id" in status.error
    assert sender.tracked_pages() == []
    assert all(int(t.count_nonzero()) == 0 for t in dst.layers)
    # the receiver keeps waiting for a compatible sender until its deadline
    assert recv.status("r1").state == TransferState.BOOTSTRAPPING
    recv.cancel("r1")
    assert recv.tracked_pages() == []


@pytest.mark.parametrize("pages", [[0, 1, 2, 3], [7, 2, 3, 4, 11], list(range(20, 0, -2))])
def test_write_pages_puts_each_block_in_its_page(pages):
    """Consecutive pages go by slice copies, scattered ones by index_copy_: same result."""
    layer = torch.zeros(24, 2, 4, 2, 8)
    block = torch.randn(len(pages), 2, 4, 2, 8)
    write_pages(layer, np.array(pages), block)
    for i, p in enumerate(pages):
        assert torch.equal(layer[p], block[i])
    untouched = sorted(set(range(24)) - set(pages))
    assert int(layer[untouched].count_nonzero()) == 0


def test_push_chunk_round_trips_and_reads_like_protobuf():
    header = pb.PageChunk(request_id="r1", sender_id="s", layer=2, token_start=32, num_tokens=16,
                          dst_page_ids=[4, 5, 300], whole_pages=True, defer_ack=True)
    payload = np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8)
    raw = encode_chunk(header, memoryview(payload))
    parsed = pb.PushItem.FromString(raw)  # any protobuf reader reads it
    assert parsed.chunk.data == payload.tobytes() and parsed.chunk.dst_page_ids == [4, 5, 300]
    frame = decode_push(raw)
    assert frame.final is None and bytes(frame.payload) == payload.tobytes()
    # the gather-in-place encoder writes the very same bytes
    assert encode_chunk_into(header, payload.nbytes, lambda out: out.__setitem__(slice(None), payload.data)) == raw
    assert frame.chunk == header  # every header field, and no data copied into it
    # field order is free in protobuf: data first, as another encoder may write it
    reordered = pb.PushItem(chunk=pb.PageChunk(data=b"xyz")).SerializeToString()[2:]
    body = reordered + header.SerializeToString()
    frame = decode_push(b"\x0a" + bytes([len(body)]) + body)
    assert bytes(frame.payload) == b"xyz" and frame.chunk.layer == 2 and frame.chunk.request_id == "r1"
    final = decode_push(encode_final(pb.FinalNotice(request_id="r1", sender_id="s", first_token=7, prompt_len=9)))
    assert final.chunk is None and final.final.first_token == 7


@pytest.mark.parametrize("raw", [b"", b"\x0a\x05ab", b"\x0a\xff", b"\x0b\x00", b"\x08\x01"])
def test_push_decoder_rejects_malformed_items(raw):
    with pytest.raises(WireError):
        decode_push(raw)


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_wait_returns_a_failure_only_after_its_pages_are_released(side):
    """A caller that sees FAILED from wait() may reuse the pages at once: the release already ran."""
    import threading

    from kv_transfer.receiver_book import ReceiverBook
    from kv_transfer.sender_book import SenderBook

    released: list[str] = []

    def slow_release(rid, *_):
        time.sleep(0.3)
        released.append(rid)

    p = pool(16)
    if side == "sender":
        book = SenderBook(p.layout.num_layers, p.num_pages, slow_release)
        dest = DestinationDescriptor("r", "local", "127.0.0.1:5", (5, 6, 7, 8, 9), T, p.layout,
                                     CompatInfo.of(SPEC, p.layout))
        status = book.start("r", [0, 1, 2, 3, 4], T, [dest], 30.0, 16).status
    else:
        book = ReceiverBook(p, slow_release)
        status = book.expect("r", [0, 1, 2, 3, 4], T, 30.0)
    threading.Thread(target=book.fail, args=("r", "peer died"), daemon=True).start()
    assert status.wait(5.0) == TransferState.FAILED
    assert released == ["r"]


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("heads", [(0, 4), (0, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("pages", [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [14, 2, 9, 0, 5, 11, 7, 1, 13, 3, 8, 12]])
def test_write_token_run_into_a_head_slice_matches_token_by_token(ps, heads, pages):
    """A sender holding some of the receiver's heads (a TP rank) writes whole pages at once and
    the tail token by token; every cell equals a per-token reference, other heads untouched."""
    from kv_transfer.layout import KVLayout

    D, H = 8, 4
    dst = KVLayout(num_layers=1, page_size=ps, head_start=0, num_heads=H, head_dim=D, dtype="float32")
    lo, hi = heads
    src = KVLayout(num_layers=1, page_size=ps, head_start=lo, num_heads=hi - lo, head_dim=D, dtype="float32")
    page_ids = np.array(pages)
    g = torch.Generator().manual_seed(ps * 100 + lo * 10 + hi)
    for start, n in [(0, len(pages) * ps), (0, 3 * ps + 1), (ps, 2 * ps - 1 if ps > 1 else 2), (1, 5)]:
        if start + n > len(pages) * ps:
            continue
        layer = torch.randn(16, 2, ps, H, D, generator=g)
        want = layer.clone()
        data = torch.randn(2, n, hi - lo, D, generator=g)
        for t in range(n):
            p = start + t
            want[page_ids[p // ps], :, p % ps, lo:hi] = data[:, t]
        write_token_run(layer, page_ids, dst, start, data, src)
        assert torch.equal(layer, want), (start, n)


def test_partial_receive_takes_the_first_whole_pages_only():
    """A prefix fetch's receive (`expect(partial=True)`): the sender may fill only the first
    whole pages of the descriptor, and the request is then done with those; a plain receive
    refuses the same cut, and a partial one refuses a cut that is not whole leading pages."""
    src, dst = pool(16, seed=3), pool(16)
    hub = LocalHub()
    recv = LocalReceiver(dst, None, hub=hub)
    sender = LocalSender(src, None, hub=hub)
    desc = recv.expect("p", [20, 21, 22, 23], 64, partial=True)
    cut = DestinationDescriptor("p", desc.transport, desc.endpoint, desc.page_ids[:2], 32, desc.layout, desc.compat)
    assert sender.start("p", [cut], [5, 6], 32).state == TransferState.WAITING
    for layer in range(3):
        sender.send_layer("p", layer)
    sender.finish("p", -1, 32)
    status = recv.wait("p", 5)
    assert status.state == TransferState.DONE and status.prompt_len == 32
    assert torch.equal(reference_tokens(dst, [20, 21], 32), reference_tokens(src, [5, 6], 32))
    recv.take("p")

    recv.expect("q", [10, 11], 32)
    cut = DestinationDescriptor("q", desc.transport, desc.endpoint, (10,), 16, desc.layout, desc.compat)
    assert sender.start("q", [cut], [5], 16).state == TransferState.FAILED
    plain = recv.status("q")
    assert plain.state == TransferState.FAILED and "differ from the published descriptor" in plain.error
    for pages, n in (([11], 16), ([10], 8)):  # not the leading page; not a whole page
        recv.expect("r", [10, 11], 32, partial=True)
        cut = DestinationDescriptor("r", desc.transport, desc.endpoint, tuple(pages), n, desc.layout, desc.compat)
        assert sender.start("r", [cut], [5], n).state == TransferState.FAILED
        assert recv.status("r").state == TransferState.FAILED
    assert recv.tracked_pages() == [] and sender.tracked_pages() == []
