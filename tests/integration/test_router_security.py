"""Locks on the router's doors: with API keys set, every gRPC RPC and every HTTP route (the
OpenAI API and /metrics) refuses a call without a valid key (UNAUTHENTICATED, 401) and does
nothing else; with TLS, clients connect over TLS (and with mutual TLS only with a certificate
the client CA signed). Real in-process workers behind the real router; certificates made by
the openssl CLI for 127.0.0.1."""
from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.client import ClientAuth
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from router.app import build_router
from router.security import Access, Tls
from tests.helpers import Loop, close, local_pair

KEYS = ("key-one-0123456789", "key-two-0123456789")
S = pb.SamplingParams
GREEDY = pb.GenerateRequest(prompt="The sea", sampling=S(max_tokens=6, temperature=0, ignore_eos=True))


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("certs")
    p = {n: str(d / n) for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem", "client.key",
                                 "client.csr", "client.pem", "san.cnf")}
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p["ca.key"], "-out", p["ca.pem"], "-days",
            "2", "-subj", "/CN=pdcluster-test-ca")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p[f"{who}.key"], "-out", p[f"{who}.csr"],
                "-subj", f"/CN=pdcluster-test-{who}")
        openssl("x509", "-req", "-in", p[f"{who}.csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
                "-CAcreateserial", "-out", p[f"{who}.pem"], "-days", "2", "-extfile", p["san.cnf"])
    return p


def start(tiny_model, **kw):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256, http_port=0, **kw)
    server.metrics_port = 0
    loop.run(server.start())

    def stop():
        loop.run(server.stop(1.0))
        close(ph, dh)
        loop.close()

    return server, stop


@pytest.fixture(scope="module")
def locked(tiny_model, certs):
    server, stop = start(tiny_model, access=Access(KEYS), tls=Tls(certs["server.pem"], certs["server.key"]))
    yield server
    stop()


def every_rpc():
    """(method path, request streaming, response streaming) of every RPC the router serves."""
    from grpc_reflection.v1alpha import reflection_pb2

    out = []
    for desc in (pb.DESCRIPTOR.services_by_name["Inference"], health_pb2.DESCRIPTOR.services_by_name["Health"],
                 reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]):
        for m in desc.methods:
            out.append((f"/{desc.full_name}/{m.name}", m.client_streaming, m.server_streaming))
    out.append(("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", True, True))
    return out


def call_raw(channel: grpc.Channel, path: str, req_stream: bool, resp_stream: bool, metadata=()):
    """Call `path` with an empty request; returns the status code."""
    try:
        if req_stream and resp_stream:
            list(channel.stream_stream(path)(iter([b""]), metadata=metadata, timeout=10))
        elif req_stream:
            channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=10)
        elif resp_stream:
            call = channel.unary_stream(path)(b"", metadata=metadata, timeout=10)
            next(iter(call), None)
            call.cancel()
        else:
            channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def http(method, url, certs, key=None, body=None, client_cert=False):
    """(status, body text) of one HTTPS request; urllib, so the test sees the raw answer."""
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    if client_cert:
        ctx.load_cert_chain(certs["client.pem"], certs["client.key"])
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def tls_client(certs, key):
    return openai.OpenAI(base_url="https://unset/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=certs["ca.pem"]),
                                                               timeout=60))


def tls_channel(server, certs, **client):
    return ClientAuth(tls_ca=certs["ca.pem"], **client).channel(server.address)


def test_every_rpc_without_a_valid_key_is_refused_and_changes_nothing(locked, certs):
    rpcs = every_rpc()
    assert {p.rsplit("/", 1)[1] for p, _, _ in rpcs} >= {"Generate", "ModelInfo", "ClusterStatus", "Tokenize", "Drain",
                                                          "Check", "Watch", "ServerReflectionInfo"}
    ch = tls_channel(locked, certs)
    for path, rs, ss in rpcs:
        for md in ((), (("authorization", "Bearer wrong-key"),), (("authorization", KEYS[0]),)):  # no "Bearer"
            assert call_raw(ch, path, rs, ss, md) == grpc.StatusCode.UNAUTHENTICATED, (path, md)
    assert not locked.service.draining and locked.service.served == 0  # Drain and Generate did nothing
    keyed = pb_grpc.InferenceStub(ClientAuth(api_key=KEYS[1], tls_ca=certs["ca.pem"]).channel(locked.address))
    ids = [t for m in keyed.Generate(GREEDY, timeout=60) for t in m.token_ids]
    assert len(ids) == 6
    health = health_pb2_grpc.HealthStub(ClientAuth(api_key=KEYS[0], tls_ca=certs["ca.pem"]).channel(locked.address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_is_refused_by_a_tls_router(locked):
    stub = pb_grpc.InferenceStub(ClientAuth(api_key=KEYS[0]).channel(locked.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_route_without_a_valid_key_is_refused(locked, certs):
    base = locked.http_url
    assert base.startswith("https://") and locked.metrics_url.startswith("https://")
    routes = [("GET", base + "/v1/models"), ("GET", base + "/v1/models/x"), ("POST", base + "/v1/completions"),
              ("POST", base + "/v1/chat/completions"), ("GET", base + "/v1/nothing"), ("GET", locked.metrics_url)]
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for method, url in routes:
        for key in (None, "wrong-key"):
            code, text = http(method, url, certs, key, body if method == "POST" else None)
            assert code == 401 and json.loads(text)["error"]["type"] == "authentication_error", (url, key, code)
    code, text = http("GET", locked.metrics_url, certs, KEYS[0])
    assert code == 200 and "pdcluster_" in text


def test_the_openai_client_over_tls_with_a_key_equals_grpc(locked, certs):
    keyed = pb_grpc.InferenceStub(ClientAuth(api_key=KEYS[0], tls_ca=certs["ca.pem"]).channel(locked.address))
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    want = "".join(m.text for m in keyed.Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages], sampling=S(max_tokens=12, temperature=0, ignore_eos=True)),
        timeout=60))
    client = tls_client(certs, KEYS[0]).with_options(base_url=locked.http_url + "/v1")
    got = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=locked.service.model_id, messages=messages, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert got == want
    wrong = tls_client(certs, "wrong-key").with_options(base_url=locked.http_url + "/v1")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_open_health_leaves_only_health_open(tiny_model):
    server, stop = start(tiny_model, access=Access(KEYS, open_health=True))
    try:
        ch = grpc.insecure_channel(server.address)
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status \
            == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(urllib.error.HTTPError) as herr:
            urllib.request.urlopen(server.metrics_url, timeout=10)
        assert herr.value.code == 401
    finally:
        stop()


def test_mutual_tls_needs_a_client_certificate(tiny_model, certs):
    server, stop = start(tiny_model, tls=Tls(certs["server.pem"], certs["server.key"], certs["ca.pem"]))
    try:
        bare = pb_grpc.InferenceStub(tls_channel(server, certs))
        with pytest.raises(grpc.RpcError) as err:
            bare.ModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = pb_grpc.InferenceStub(tls_channel(server, certs, tls_cert=certs["client.pem"],
                                                      tls_key=certs["client.key"]))
        assert with_cert.ModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size > 0
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            http("GET", server.http_url + "/v1/models", certs)
        assert http("GET", server.http_url + "/v1/models", certs, client_cert=True)[0] == 200
    finally:
        stop()
