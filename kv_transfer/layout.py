"""What a worker's KV pool looks like: the model-level shape (ModelSpec), one side's
page layout (KVLayout: page size, head range held by its TP rank, dtype, and that rank's
tensor-parallel topology: group size and rank) and the pool
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


def tp_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The kv heads `[start, start + n)` rank `tp_rank` of a group of `tp_size` holds, as
    engine/parallel.py TPShard shards them: K/N heads each when N divides K, else one head
    replicated on N/K ranks. Raises ValueError naming the field when no such shard exists."""
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if tp_size < 1 or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={tp_size} must divide or be a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        return tp_rank * n, n
    return tp_rank * num_kv_heads // tp_size, 1


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
    """One side's paged layout: page size, the kv heads it holds, element dtype, and the
    tensor-parallel topology of the rank holding them (`tp_size` ranks in its group, this one
    `tp_rank`; 1 and 0 for an unsharded worker)."""

    num_layers: int
    page_size: int
    head_start: int
    num_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "num_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_start < 0:
            raise ValueError(f"KVLayout.head_start must be >= 0, got {self.head_start}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        torch_dtype(self.dtype)

    def describe(self) -> str:
        """One line for error messages: `tp 2 rank 1 heads [2, 4) page 16 float32 (6 layers x head_dim 32)`."""
        return (f"tp {self.tp_size} rank {self.tp_rank} heads [{self.head_start}, {self.head_end}) "
                f"page {self.page_size} {self.dtype} ({self.num_layers} layers x head_dim {self.head_dim})")

    def __str__(self) -> str:
        return self.describe()

    def topology_error(self, num_kv_heads: int) -> str | None:
        """Why this layout is not the one its TP rank holds of a model with `num_kv_heads` kv
        heads (the head range TPShard gives rank tp_rank of tp_size), or None when it is."""
        try:
            start, n = tp_head_range(num_kv_heads, self.tp_size, self.tp_rank)
        except ValueError as exc:
            return str(exc)
        if (self.head_start, self.num_heads) != (start, n):
            return (f"heads [{self.head_start}, {self.head_end}) are not those of tp rank {self.tp_rank} of "
                    f"{self.tp_size} over {num_kv_heads} kv heads, which holds [{start}, {start + n})")
        return None

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
                           num_heads=self.num_heads, head_dim=self.head_dim, dtype=self.dtype,
                           tp_size=self.tp_size, tp_rank=self.tp_rank)

    @classmethod
    def from_proto(cls, msg: pb.KVLayout) -> KVLayout:
        # tp_size 0 is a peer that predates the topology fields: an unsharded worker
        return cls(num_layers=msg.num_layers, page_size=msg.page_size, head_start=msg.head_start,
                   num_heads=msg.num_heads, head_dim=msg.head_dim, dtype=msg.dtype,
                   tp_size=msg.tp_size or 1, tp_rank=msg.tp_rank)


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
        if lay.tp_size > 1:  # a declared TP rank must hold its TPShard heads (tp_size 1: any range, as before)
            why = lay.topology_error(self.spec.num_kv_heads)
            if why is not None:
                raise ValueError(f"KVPool.layout ({lay.describe()}): {why}")
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
                     num_kv_heads: int | None = None, tp_size: int = 1, tp_rank: int = 0) -> KVPool:
        """Wrap a worker's existing per-layer KV tensors (registered once, never copied); the
        layout is read off their shape. `num_kv_heads` is the model's total when a TP rank
        holds only heads [head_start, head_start + held); `tp_size`/`tp_rank` are that rank's
        group size and rank (engine/parallel.py TPShard: head_start=shard.kv_head_start,
        tp_size=shard.world, tp_rank=shard.rank), checked against the heads when tp_size > 1."""
        _, _, page_size, held, head_dim = layers[0].shape
        layout = KVLayout(num_layers=len(layers), page_size=page_size, head_start=head_start, num_heads=held,
                          head_dim=head_dim, dtype=dtype_name(layers[0].dtype), tp_size=tp_size, tp_rank=tp_rank)
        spec = ModelSpec(model_id=model_id, num_layers=len(layers), num_kv_heads=num_kv_heads or held,
                         head_dim=head_dim)
        return cls(layers=layers, layout=layout, spec=spec)

    @classmethod
    def allocate(cls, spec: ModelSpec, layout: KVLayout, num_pages: int, device: str = "cpu") -> KVPool:
        shape = (num_pages, 2, layout.page_size, layout.num_heads, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)], layout, spec)
