"""A request ends when its client leaves, whichever door it came through (gRPC, HTTP streamed,
HTTP not streamed) and whatever stage it is at (queued for an admission slot, prefilling,
decoding): within a second the router's running and queued counts drop and every worker's
pages are back. Real router, real in-process prefill and decode workers (tiny llama, local KV
transfer); HTTP clients are raw sockets on 127.0.0.1 that send a request and close."""
from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, hold_engine_thread, local_pair, slow_steps, stub, wait_until

BOUND_S = 1.0  # the promise: slot and pages free within this after the client left
PROMPT = list(range(5, 45))  # 40 tokens: 3 pages, room for 200 more


@pytest.fixture(scope="module")
def served(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256, http_port=0, max_inflight=1, max_queue=4)
    loop.run(server.start())
    yield server, (prefill, decode), (ph, dh)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


@contextlib.contextmanager
def slowed(worker, step_s: float):
    slow_steps(worker, step_s)
    try:
        yield
    finally:
        del worker.step  # the class's own again


class GrpcClient:
    def __init__(self, server, max_tokens: int) -> None:
        self.stub = stub(server)  # kept: its channel must outlive the call
        self.call = self.stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=60)

    def read_tokens(self, n: int) -> None:
        got = 0
        for msg in self.call:
            got += len(msg.token_ids)
            if got >= n:
                return

    def leave(self) -> None:
        self.call.cancel()


class HttpClient:
    """A raw HTTP/1.1 client: sends the whole request, may read some events, then closes."""

    def __init__(self, server, max_tokens: int, stream: bool) -> None:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": stream}).encode()
        host, port = server.http_url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.buf = b""

    def read_tokens(self, n: int) -> None:  # streamed: n events with text
        while self.buf.count(b"data: ") < n:
            data = self.sock.recv(65536)
            assert data, "the stream ended early"
            self.buf += data

    def leave(self) -> None:
        self.sock.close()


DOORS = ["grpc", "http-stream", "http"]


def client(door, server, max_tokens):
    return GrpcClient(server, max_tokens) if door == "grpc" else HttpClient(server, max_tokens, door == "http-stream")


def idle(server, workers) -> bool:
    svc = server.service
    return (svc._running == 0 and svc._waiting == 0 and
            all(w.core.num_free_pages == w.core.num_pages and not w.has_requests for w in workers))


def time_to(predicate, guard_s: float = 15.0) -> float:
    t0 = time.monotonic()
    wait_until(predicate, guard_s, 0.005, "the request to end")
    return time.monotonic() - t0


@pytest.mark.parametrize("door", DOORS)
def test_a_client_leaving_while_queued_frees_its_place(served, door):
    server, workers, _ = served
    svc = server.service
    failed = svc.failed
    with slowed(workers[1], 0.05):
        first = GrpcClient(server, 200)  # holds the only slot for seconds
        wait_until(lambda: svc._running == 1, 10, 0.01, "the first request running")
        queued = client(door, server, 8)
        wait_until(lambda: svc._waiting == 1, 10, 0.01, "the second request queued")
        queued.leave()
        took = time_to(lambda: svc._waiting == 0)
        assert took < BOUND_S, f"the queued request still waited {took:.2f} s after its client left"
        assert svc._running == 1  # the first still runs
        first.leave()
        wait_until(lambda: idle(server, workers), 10, 0.01, "the first request ended, pages back")
    assert svc.failed == failed + 2


def _leave_during_prefill(served, door):
    """The prefill worker is busy (its engine thread held for 2.5 s, as by one long step of
    other prompts) when the request is placed on it; its client leaves before a token. Returns
    (seconds until the router let the request go, the hold's future)."""
    server, workers, (ph, dh) = served
    svc = server.service
    placed = svc.dispatcher.views["prefill-0"]
    held = hold_engine_thread(ph, 2.5)
    c = client(door, server, 200)
    wait_until(lambda: svc._running == 1 and placed.inflight == 1, 10, 0.005, "the request placed for prefill")
    c.leave()
    took = time_to(lambda: svc._running == 0 and placed.inflight == 0)
    return took, held


@pytest.mark.parametrize("door", DOORS)
def test_a_client_leaving_during_prefill_ends_the_request(served, door):
    server, workers, _ = served
    served_before = server.service.served
    with slowed(workers[1], 0.05):  # 200 tokens would take 10 s
        took, held = _leave_during_prefill(served, door)
        assert took < BOUND_S and not held.done(), (
            f"the request held its slot {took:.2f} s after its client left, until the prefill worker was free")
        held.result(10)
        back = time_to(lambda: idle(server, workers))
    assert took < BOUND_S, f"the request still held its slot {took:.2f} s after its client left"
    assert back < BOUND_S, f"pages still held {back:.2f} s after the prefill worker was free again"
    assert server.service.served == served_before


def test_a_busy_prefill_worker_does_not_hold_the_decode_workers_pages(served):
    server, workers, _ = served
    decode = workers[1]
    with slowed(decode, 0.05):
        took, held = _leave_during_prefill(served, "grpc")
        try:
            wait_until(lambda: decode.core.num_free_pages == decode.core.num_pages, BOUND_S, 0.005,
                       "the decode worker's pages back while the prefill worker is busy")
        finally:
            held.result(10)
            wait_until(lambda: idle(server, workers), 10, 0.01, "idle")


@pytest.mark.parametrize("door", DOORS)
def test_a_client_leaving_mid_decode_ends_the_request(served, door):
    server, workers, _ = served
    prefill, decode = workers
    svc = server.service
    served_before = svc.served
    with slowed(decode, 0.03):  # 200 tokens take 6 s
        c = client(door, server, 200)
        if door == "http":  # nothing to read before the end: wait until tokens are being made
            wait_until(lambda: decode.has_requests and not prefill.has_requests and
                       decode.core.num_free_pages < decode.core.num_pages, 10, 0.005, "decoding")
            time.sleep(0.2)  # a few decode steps in (not a synchronization: the state is checked above)
        else:
            c.read_tokens(3)
        c.leave()
        took = time_to(lambda: idle(server, workers))
    assert took < BOUND_S, f"slot and pages still held {took:.2f} s after the client left"
    assert svc.served == served_before  # cut, not finished
