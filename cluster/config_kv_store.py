"""The `kv_store:` section of the cluster config (cluster/config.py): the KV store tier below
the workers' prefix caches (kv_store/), one per node."""
from __future__ import annotations

import os
import re

from pydantic import Field, field_validator

from cluster.config_base import Strict

AUTO_FRACTION = 16           # "auto": 1/16 of the node's memory ...
AUTO_MAX = 4 << 30           # ... and at most 4 GiB
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORMS = "'auto', 0 (off), or bytes with an optional unit: 512MiB, 2GiB, 1.5GB, 1048576"


def parse_size(text: str | int, field: str = "kv_store.size") -> int | None:
    """Bytes of a size string; None for 'auto'. ValueError naming `field` and the forms."""
    if isinstance(text, bool):
        raise ValueError(f"{field} must be {SIZE_FORMS}, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{field} must be >= 0 bytes, got {text}")
        return text
    s = str(text).strip()
    if s.lower() == "auto":
        return None
    m = _SIZE.match(s)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{field} must be {SIZE_FORMS}, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def node_memory_bytes() -> int:
    """This machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def auto_size(memory_bytes: int | None = None) -> int:
    """What 'auto' means on a node with this much memory."""
    mem = node_memory_bytes() if memory_bytes is None else memory_bytes
    return min(mem // AUTO_FRACTION, AUTO_MAX)


class KVStoreSettings(Strict):
    size: str = Field("auto", description=f"memory of each node's KV store: {SIZE_FORMS}; auto is 1/16 of the "
                                          "node's memory, at most 4 GiB; 0 turns the store off (the workers' "
                                          "caches are then the only tier)")
    num_cpus: float = Field(0.0, ge=0, le=64, description="Ray CPUs reserved for each node's store actor (it "
                                                           "computes nothing: memory copies only)")

    @field_validator("size", mode="before")
    @classmethod
    def _size_parses(cls, v):
        v = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
        parse_size(v)
        return v

    def size_bytes(self, memory_bytes: int | None = None) -> int:
        """The store's bytes on a node with `memory_bytes` of memory (default: this machine)."""
        b = parse_size(self.size)
        return auto_size(memory_bytes) if b is None else b

    @property
    def enabled(self) -> bool:
        return parse_size(self.size) != 0
