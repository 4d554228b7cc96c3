"""How a client reaches a router: plaintext or TLS (optionally with a client certificate), and
the API key sent as `authorization: Bearer KEY` on every call. Used by `pdcluster generate`,
`status`, `drain` and `bench serve`; any program may use it.

    auth = ClientAuth(api_key="...", tls_ca="ca.pem")
    stub = InferenceStub(auth.channel("host:50051"))
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

API_KEY_ENV = "PDCLUSTER_API_KEY"


@dataclass(frozen=True)
class ClientAuth:
    api_key: str | None = field(default=None, repr=False)
    tls_ca: str | None = None    # PEM CA that signed the router's certificate: connect over TLS
    tls_cert: str | None = None  # client certificate and key, for a router that requires them (mTLS)
    tls_key: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        read = (lambda p: Path(p).read_bytes() if p else None)
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    def channel(self, address: str, options=None) -> grpc.Channel:
        creds = self._credentials()
        ch = (grpc.secure_channel(address, creds, options=options) if creds is not None
              else grpc.insecure_channel(address, options=options))
        return with_metadata(ch, self.metadata)

    def aio_channel(self, address: str, options=None) -> grpc.aio.Channel:
        creds = self._credentials()
        interceptors = _aio_interceptors(self.metadata) if self.metadata else None
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def with_metadata(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.Channel:
    """`channel`, sending `metadata` with every call."""
    return grpc.intercept_channel(channel, _Metadata(metadata)) if metadata else channel


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connecting to a locked router")
    g.add_argument("--api-key", help=f"API key (default: ${API_KEY_ENV})")
    g.add_argument("--tls-ca", help="PEM CA of the router's certificate: connect over TLS")
    g.add_argument("--tls-cert", help="PEM client certificate, for a router that requires one (mutual TLS)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")


def client_auth(args: argparse.Namespace) -> ClientAuth:
    return ClientAuth(getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None,
                      getattr(args, "tls_ca", None), getattr(args, "tls_cert", None), getattr(args, "tls_key", None))


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata) -> None:
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = getattr(d, "credentials", None)
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata) -> None:
        self.md = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, list(details.metadata or ()) + list(self.md)), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_Details(details, list(details.metadata or ()) + list(self.md)), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def _aio_interceptors(metadata):
    class Details(grpc.aio.ClientCallDetails):
        pass

    def add(d):
        md = grpc.aio.Metadata(*(tuple(d.metadata or ()) + tuple(metadata)))
        return Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready)

    class UU(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(add(details), request)

    class US(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(add(details), request)

    return [UU(), US()]
