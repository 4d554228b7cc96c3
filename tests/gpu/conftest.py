"""GPU suites: each module skips itself without CUDA (and flashinfer where it needs it)."""
from __future__ import annotations

import pytest

from tests.helpers import random_paged_batch


@pytest.fixture
def make_paged_batch():
    """tests.helpers.random_paged_batch: one step's BatchLayout over a random paged KV cache."""
    return random_paged_batch
