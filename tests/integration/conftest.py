"""Fixtures of the in-process integration suites."""
from __future__ import annotations

import pytest

from router.app import build_router
from tests.helpers import Loop, close, local_pair


@pytest.fixture(scope="module")
def metrics_cluster(tiny_model):
    """(router server with /metrics, prefill worker, decode worker) over the local transport,
    shared by a module's tests (the metrics and bench-serve suites)."""
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256)
    server.metrics_port = 0
    loop.run(server.start())
    yield server, prefill, decode
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


@pytest.fixture(scope="module")
def metrics_router(metrics_cluster):
    return metrics_cluster[0]
