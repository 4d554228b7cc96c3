"""The locked KV plane: a receiver whose TransferConfig has the cluster's secret answers no
KVTransfer RPC (Handshake, Begin, Push, Cancel) without it: UNAUTHENTICATED, nothing returned,
nothing changed (a request it expects is still expected, its pages still held). A sender with the
secret moves the KV exactly; one with a wrong secret fails its handshake, saying why. Both
receivers are real: the grpc transport's (grpc.aio service) and nixl's (its control service).
"""
from __future__ import annotations

import grpc
import pytest
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.registry import create_receiver, create_sender
from proto.pdcluster.v1 import kv_transfer_pb2 as pb
from tests.integration.kv_peer import make_pool, request_tokens

SPEC = {"model_id": "tiny-kv", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
LAYOUT = {"num_layers": 2, "page_size": 16, "head_start": 0, "num_heads": 2, "head_dim": 8, "dtype": "float32"}
SECRET = "cluster-secret-0123456789"
TOKENS = 20


def every_rpc():
    svc = pb.DESCRIPTOR.services_by_name["KVTransfer"]
    return [(f"/{svc.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in svc.methods]


def call_raw(endpoint: str, path: str, req_stream: bool, resp_stream: bool, metadata=()) -> tuple:
    """(status code, what came back) of `path` called with an empty message."""
    with grpc.insecure_channel(endpoint) as ch:
        try:
            if req_stream and resp_stream:
                got = list(ch.stream_stream(path)(iter([b""]), metadata=metadata, timeout=10))
            else:
                got = ch.unary_unary(path)(b"", metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), None
    return grpc.StatusCode.OK, got


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_no_kv_rpc_answers_without_the_clusters_credential(transport):
    pool = make_pool(SPEC, LAYOUT, 8, seed=0)
    recv = create_receiver(transport, pool, TransferConfig(secret=SECRET))
    try:
        desc = recv.expect("victim", [3, 5], TOKENS)
        before = recv.status("victim").state
        rpcs = every_rpc()
        assert {p.rsplit("/", 1)[1] for p, _, _ in rpcs} == {"Handshake", "Begin", "Push", "Cancel"}
        for path, rs, ss in rpcs:
            for md in ((), (("authorization", "Bearer wrong"),), (("authorization", SECRET),)):
                code, got = call_raw(desc.endpoint, path, rs, ss, md)
                assert code == grpc.StatusCode.UNAUTHENTICATED and got is None, (path, md, code)
        # a Cancel of the victim by its id, with a wrong credential: nothing happens to it
        code, _ = call_raw(desc.endpoint, "/pdcluster.v1.KVTransfer/Cancel", False, False,
                           (("authorization", "Bearer wrong"),))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert sorted(recv.tracked_pages()) == [3, 5] and recv.status("victim").state == before
    finally:
        recv.close()


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_a_sender_with_the_secret_moves_the_kv_and_one_without_is_refused(transport):
    src = make_pool(SPEC, LAYOUT, 8, seed=5)
    dst = make_pool(SPEC, LAYOUT, 8, seed=0)
    recv = create_receiver(transport, dst, TransferConfig(secret=SECRET))
    good = create_sender(transport, src, TransferConfig(secret=SECRET))
    bad = create_sender(transport, src, TransferConfig(secret="not-the-secret"))
    try:
        desc = recv.expect("r1", [2, 6], TOKENS)
        assert good.start("r1", [desc], [1, 4], TOKENS).state.name == "WAITING"
        for layer in range(2):
            good.send_layer("r1", layer)
        good.finish("r1", 9, TOKENS)
        status = recv.wait("r1", 30)
        assert status.state.name == "DONE" and status.first_token == 9
        assert torch.equal(request_tokens(dst, [2, 6], TOKENS), request_tokens(src, [1, 4], TOKENS))
        recv.take("r1")
        desc = recv.expect("r2", [0, 1], TOKENS)
        before = recv.status("r2").state
        status = bad.start("r2", [desc], [1, 4], TOKENS)
        assert status.state.name == "FAILED" and "UNAUTHENTICATED" in status.error, status.error
        assert recv.status("r2").state == before  # untouched: its own deadline or a cancel frees it
    finally:
        for x in (good, bad, recv):
            x.close()
