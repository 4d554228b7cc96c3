"""Shared fixtures: built-in tiny checkpoints, transformers reference outputs, and the leak check
every engine test gets for free (after each test, free KV pages equal total pages)."""
from __future__ import annotations

import os
import time

import pytest
import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Every LLM a test builds through `make_llm` (or registers) is checked after each test.
_LIVE_ENGINES: list = []


@pytest.fixture(scope="session", autouse=True)
def _builtin_cache(tmp_path_factory):
    # Built-in checkpoints go into a per-session folder, so a run never depends on ~/.cache.
    os.environ.setdefault("PDCLUSTER_CACHE", str(tmp_path_factory.mktemp("pdcluster-cache")))
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
    # threads contending with other processes made steps ~10x slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model():
    """Path of the built-in tiny checkpoint for an arch: tiny_model('qwen3')."""
    from engine.builtin import ensure_builtin

    return lambda arch="llama": ensure_builtin(arch=arch, preset="tiny")


LEAK_GRACE_S = 5.0


def register_engine(llm):
    _LIVE_ENGINES.append(llm)
    return llm


@pytest.fixture
def make_llm():
    from engine import LLM

    def factory(model, **kwargs):
        return register_engine(LLM(model, **kwargs))

    return factory


@pytest.fixture(autouse=True)
def _no_page_leaks():
    """Every engine a test made has all its pages free and no request open after the test. A
    transfer's pages come back on its transport's thread, possibly just after the test's last
    check, so this waits (up to LEAK_GRACE_S) for that; a page still held then is a leak."""
    yield

    def leaks() -> list[str]:
        return [
            f"{llm.model_dir.name}: {llm.num_free_pages}/{llm.num_pages} pages free, "
            f"unfinished={llm.has_unfinished_requests()}"
            for llm in _LIVE_ENGINES
            if llm.num_free_pages != llm.num_pages or llm.has_unfinished_requests()
        ]

    deadline = time.monotonic() + LEAK_GRACE_S
    while (found := leaks()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not found, "KV pages leaked: " + "; ".join(found)
