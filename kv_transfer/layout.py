"""What a worker's KV pool looks like: the model-level shape (ModelSpec), one side's
page layout (KVLayout: page size, head range held by its TP rank, dtype) and the pool
itself (KVPool: one FlashInfer NHD tensor per layer, `[num_pages, 2, page_size,
num_heads, head_dim]`, `[:, 0]` = K, `[:, 1]` = V). Token p of a request sits in page
`pages[p // page_size]` at offset `p % page_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from proto.pdcluster.v1 import kv_transfer_pb2 as pb

PAGE_LAYOUT = "flashinfer-nhd"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Model-level facts both sides must agree on (they go into the compatibility hash)."""

    model_id: str
    num_layers: int
    num_kv_heads: int  # total kv heads of the model, across all TP ranks
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True, frozen=True)
class KVLayout:
    """One side's paged layout: page size, the kv heads it holds, element dtype."""

    num_layers: int
    page_size: int
    head_start: int
    num_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_start < 0:
            raise ValueError(f"KVLayout.head_start must be >= 0, got {self.head_start}")
        torch_dtype(self.dtype)

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K or V in one layer."""
        return self.num_heads * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (K and V) in one layer."""
        return 2 * self.page_size * self.token_bytes

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def to_proto(self) -> pb.KVLayout:
        return pb.KVLayout(num_layers=self.num_layers, page_size=self.page_size, head_start=self.head_start,
                           num_heads=self.num_heads, head_dim=self.head_dim, dtype=self.dtype)

    @classmethod
    def from_proto(cls, msg: pb.KVLayout) -> KVLayout:
        return cls(num_layers=msg.num_layers, page_size=msg.page_size, head_start=msg.head_start,
                   num_heads=msg.num_heads, head_dim=msg.head_dim, dtype=msg.dtype)


@dataclass(slots=True)
class KVPool:
    """A worker's KV pages: one contiguous tensor per layer, registered once at start-up."""

    layers: list[torch.Tensor]
    layout: KVLayout
    spec: ModelSpec

    def __post_init__(self) -> None:
        lay = self.layout
        if len(self.layers) != lay.num_layers:
            raise ValueError(f"KVPool.layers: expected {lay.num_layers} layer tensors, got {len(self.layers)}")
        if lay.num_layers != self.spec.num_layers or lay.head_dim != self.spec.head_dim:
            raise ValueError("KVPool.layout disagrees with ModelSpec on num_layers or head_dim")
        if lay.head_end > self.spec.num_kv_heads:
            raise ValueError(f"KVPool.layout heads [{lay.head_start}, {lay.head_end}) exceed the model's "
                             f"{self.spec.num_kv_heads} kv heads")
        want_dtype = torch_dtype(lay.dtype)
        num_pages = self.layers[0].shape[0]
        for i, t in enumerate(self.layers):
            shape = (num_pages, 2, lay.page_size, lay.num_heads, lay.head_dim)
            if tuple(t.shape) != shape:
                raise ValueError(f"KVPool.layers[{i}]: shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != want_dtype or not t.is_contiguous():
                raise ValueError(f"KVPool.layers[{i}]: must be a contiguous {lay.dtype} tensor")

    @property
    def num_pages(self) -> int:
        return self.layers[0].shape[0]

    @classmethod
    def from_tensors(cls, layers: list[torch.Tensor], model_id: str, head_start: int = 0,
                     num_kv_heads: int | None = None) -> KVPool:
        """Wrap a worker's existing per-layer KV tensors (registered once, never copied); the
        layout is read off their shape. `num_kv_heads` is the model's total when a TP rank
        holds only heads [head_start, head_start + held)."""
        _, _, page_size, held, head_dim = layers[0].shape
        layout = KVLayout(num_layers=len(layers), page_size=page_size, head_start=head_start, num_heads=held,
                          head_dim=head_dim, dtype=dtype_name(layers[0].dtype))
        spec = ModelSpec(model_id=model_id, num_layers=len(layers), num_kv_heads=num_kv_heads or held,
                         head_dim=head_dim)
        return cls(layers=layers, layout=layout, spec=spec)

    @classmethod
    def allocate(cls, spec: ModelSpec, layout: KVLayout, num_pages: int, device: str = "cpu") -> KVPool:
        shape = (num_pages, 2, layout.page_size, layout.num_heads, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)], layout, spec)
