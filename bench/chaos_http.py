"""The chaos suite's `http-flood` scenario (bench/chaos.py), and the flood itself, which
tests/integration/test_http_hardening.py runs against an in-process router:

Clients send HTTP bodies in a loop: "big" ones announce 50 MB (Content-Length) and start
sending it, "under" ones send a whole body just under the router's cap (accepted and parsed; the
prompt is then too long, a 400). Meanwhile gRPC ModelInfo and `GET /v1/models` are timed in a
loop, first without the flood (the baseline), then during it. The target: both stay under
100 ms at p99 during the flood; every big body gets 413, from its Content-Length.
"""
from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from typing import Any

BIG_BYTES = 50 * 1000 * 1000


def _read_status(sock: socket.socket, timeout_s: float = 30.0) -> int:
    sock.settimeout(timeout_s)
    buf = b""
    while b"\r\n" not in buf:
        data = sock.recv(4096)
        if not data:
            return 0
        buf += data
    return int(buf.split(b" ", 2)[1])


def big_client(host: str, port: int, stop, out: dict, body_bytes: int = BIG_BYTES) -> None:
    """Announce `body_bytes` and send them until the answer comes; count the statuses (0: no
    answer before the connection closed)."""
    chunk = b"x" * (256 << 10)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_bytes}\r\n\r\n").encode()
    while not stop.is_set():
        status = 0
        try:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(head)
                s.setblocking(False)
                sent = 0
                while sent < body_bytes:
                    readable, writable, _ = select.select([s], [s], [], 5)
                    if readable:
                        break
                    if writable:
                        try:
                            sent += s.send(chunk[:body_bytes - sent])
                        except BlockingIOError:
                            pass
                s.setblocking(True)
                status = _read_status(s)
        except OSError:
            pass
        out[status] = out.get(status, 0) + 1


def under_client(host: str, port: int, stop, out: dict, cap: int) -> None:
    """Send a whole body just under the cap (a prompt too long for the model: a 400 after
    parsing); count the statuses."""
    body = json.dumps({"prompt": "a" * (cap - 100), "max_tokens": 1}).encode()
    assert len(body) <= cap
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    while not stop.is_set():
        status = 0
        try:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(head + body)
                status = _read_status(s)
        except OSError:
            pass
        out[status] = out.get(status, 0) + 1


def _model_info_loop(address: str, stop, lat: list, errors: list) -> None:
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)  # connected before timing
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
                lat.append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors.append(1)
            time.sleep(0.005)


def _models_loop(host: str, port: int, stop, lat: list, errors: list) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/v1/models")
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors.append(r.status)
            else:
                lat.append(time.perf_counter() - t0)
        except (OSError, http.client.HTTPException):
            errors.append(0)
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
        time.sleep(0.005)
    conn.close()


def percentiles(lat: list[float]) -> dict:
    if not lat:
        return {"samples": 0}
    xs = sorted(lat)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000  # noqa: E731
    return {"samples": len(xs), "p50_ms": round(pick(0.5), 2), "p99_ms": round(pick(0.99), 2),
            "max_ms": round(xs[-1] * 1000, 2)}


def _timed(grpc_address: str, host: str, port: int, seconds: float, during=None) -> dict:
    """ModelInfo and GET /v1/models timed for `seconds` (while `during` runs, if given)."""
    stop = threading.Event()
    mi, mi_err, mo, mo_err = [], [], [], []
    threads = [threading.Thread(target=_model_info_loop, args=(grpc_address, stop, mi, mi_err), daemon=True),
               threading.Thread(target=_models_loop, args=(host, port, stop, mo, mo_err), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(seconds)  # the measurement window itself, not a synchronization
    stop.set()
    for t in threads:
        t.join(30)
    return {"modelinfo": percentiles(mi) | {"errors": len(mi_err)},
            "models": percentiles(mo) | {"errors": len(mo_err)}}


def flood(grpc_address: str, http_url: str, cap: int, *, big: int = 3, under: int = 3, seconds: float = 5.0,
          baseline_s: float = 2.0, big_bytes: int = BIG_BYTES, processes: bool = False,
          sample=None) -> dict[str, Any]:
    """Run the flood (client threads, or processes), the baseline first; returns the figures.
    `sample`: called every 50 ms during the flood (e.g. to read the router's RSS)."""
    host, port = http_url.removeprefix("http://").split(":")
    port = int(port)
    baseline = _timed(grpc_address, host, port, baseline_s)
    if processes:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        stop, manager = ctx.Event(), ctx.Manager()
        outs = [manager.dict() for _ in range(big + under)]
        workers = [ctx.Process(target=big_client, args=(host, port, stop, outs[i], big_bytes), daemon=True)
                   for i in range(big)]
        workers += [ctx.Process(target=under_client, args=(host, port, stop, outs[big + i], cap), daemon=True)
                    for i in range(under)]
    else:
        stop = threading.Event()
        outs = [{} for _ in range(big + under)]
        workers = [threading.Thread(target=big_client, args=(host, port, stop, outs[i], big_bytes), daemon=True)
                   for i in range(big)]
        workers += [threading.Thread(target=under_client, args=(host, port, stop, outs[big + i], cap), daemon=True)
                    for i in range(under)]
    for w in workers:
        w.start()
    sampler_stop = threading.Event()

    def sampler():
        while not sampler_stop.is_set():
            sample()
            time.sleep(0.05)

    st = threading.Thread(target=sampler, daemon=True) if sample else None
    if st:
        st.start()
    try:
        # the clients under way first: until each has had an answer
        deadline = time.monotonic() + 60
        while not all(outs[i] for i in range(big + under)) and time.monotonic() < deadline:
            time.sleep(0.05)
        during = _timed(grpc_address, host, port, seconds)
    finally:
        stop.set()
        sampler_stop.set()
        for w in workers:
            w.join(60)
        if st:
            st.join(5)
    statuses = {"big": {}, "under": {}}
    for i, o in enumerate(outs):
        kind = "big" if i < big else "under"
        for k, v in dict(o).items():
            statuses[kind][k] = statuses[kind].get(k, 0) + v
    return {"baseline": baseline, "flood": during, "statuses": statuses, "cap": cap, "big_bytes": big_bytes,
            "clients": {"big": big, "under": under}, "seconds": seconds}


def target_met(result: dict, bound_ms: float = 100.0) -> bool:
    f = result["flood"]
    return all(f[k].get("p99_ms", 1e9) < bound_ms and not f[k]["errors"] for k in ("modelinfo", "models"))


def _fmt(p: dict) -> str:
    return f"{p['p50_ms']:.1f}/{p['p99_ms']:.1f} ms" if p.get("samples") else "no samples"


async def scenario_http_flood(chaos, row) -> None:
    """bench/chaos.py's `http-flood`: the flood against the cluster's router (its HTTP API on)."""
    import asyncio

    url = getattr(chaos, "http_url", "")
    if not url:
        raise RuntimeError("the router serves no HTTP API (http_port unset)")
    with urllib_open(url + "/v1/models") as r:
        max_model_len = json.loads(r.read())["data"][0]["max_model_len"]
    from router.frontend import FrontendLimits
    from router.http_server import HttpLimits

    cap = HttpLimits.derived_body_bytes(FrontendLimits().request_bytes(max_model_len))
    s = chaos.s
    res = await asyncio.to_thread(flood, chaos.address, url, cap, big=s.flood_clients, under=s.flood_clients,
                                  seconds=s.flood_s, baseline_s=s.baseline_s, processes=True)
    big, under = res["statuses"]["big"], res["statuses"]["under"]
    row.tried = sum(big.values()) + sum(under.values())
    row.clean_errors = big.get(413, 0) + under.get(400, 0)
    row.wrong_codes = row.tried - row.clean_errors
    row.codes = {f"big {k}": v for k, v in big.items()} | {f"under {k}": v for k, v in under.items()}
    row.extra["http_flood"] = res
    row.extra["target_p99_under_100ms"] = target_met(res)
    b, f = res["baseline"], res["flood"]
    row.notes.append(f"ModelInfo p50/p99 {_fmt(b['modelinfo'])} without the flood, {_fmt(f['modelinfo'])} during it; "
                     f"GET /v1/models {_fmt(b['models'])} without, {_fmt(f['models'])} during "
                     f"({s.flood_clients} clients of 50 MB bodies, {s.flood_clients} of {cap} bytes, the cap)")


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)
