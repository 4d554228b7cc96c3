"""Which sender rank sends which KV heads to which receiver rank, when the two sides of a
transfer are tensor-parallel groups of different sizes.

Each rank of a group holds a head range of the model's KV heads (engine/parallel.py): with N
ranks and K KV heads, rank r holds K/N heads when N divides K, or one head replicated on N/K
ranks when N is a multiple of K. A transfer from a sender group to a receiver group is a set of
routes, one per (sender rank, receiver rank) pair that moves something; every route moves the
overlap of the two ranks' heads, for every layer and token of the request. The plan sends
every head a receiver rank holds exactly once (the receiver rejects a head written twice):
- a receiver rank holding heads that several sender ranks share (the sender replicates them)
  takes each head from one of them, receivers spread over the replicas (receiver j takes from
  the (j mod R)-th of the R replicas) so the rank pairs move in parallel;
- a head the receiver group replicates is sent to each of its replicas (each holds a copy);
- a receiver head no sender rank holds makes the pairing impossible: `ReshardError`.

The plan depends only on the two sides' layouts, so a worker computes it once per pair of
layouts (`plan_for` caches it) and reuses it for every request between them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kv_transfer.layout import KVLayout


class ReshardError(ValueError):
    """The sender ranks cannot cover the receiver ranks' heads (an impossible pairing)."""


@dataclass(slots=True, frozen=True)
class Route:
    """Sender rank `sender` moves KV heads [head_start, head_start + num_heads) to receiver rank `receiver`."""

    sender: int
    receiver: int
    head_start: int
    num_heads: int

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads


@dataclass(slots=True, frozen=True)
class ReshardPlan:
    num_senders: int
    num_receivers: int
    routes: tuple[Route, ...]

    def receivers_of(self, sender: int) -> list[int]:
        """The receiver ranks sender rank `sender` sends to (in receiver order; may be empty)."""
        return [r.receiver for r in self.routes if r.sender == sender]

    def senders_of(self, receiver: int) -> list[int]:
        return [r.sender for r in self.routes if r.receiver == receiver]

    def heads_moved(self) -> int:
        """Head-transfers in all (a head sent to two receiver replicas counts twice)."""
        return sum(r.num_heads for r in self.routes)


def _overlap(a: KVLayout, b: KVLayout) -> tuple[int, int]:
    return max(a.head_start, b.head_start), min(a.head_end, b.head_end)


def _describe(layouts: tuple[KVLayout, ...]) -> str:
    return ", ".join(f"rank {i}: heads [{lay.head_start}, {lay.head_end})" for i, lay in enumerate(layouts))


def plan_transfer(senders: list[KVLayout] | tuple[KVLayout, ...],
                  receivers: list[KVLayout] | tuple[KVLayout, ...]) -> ReshardPlan:
    """The routes from sender ranks (`senders[i]`: rank i's layout) to receiver ranks
    (`receivers[j]`, e.g. the layouts of a decode group's descriptors, in rank order)."""
    return _plan(tuple(senders), tuple(receivers))


@functools.lru_cache(maxsize=256)
def _plan(senders: tuple[KVLayout, ...], receivers: tuple[KVLayout, ...]) -> ReshardPlan:
    if not senders or not receivers:
        raise ReshardError("a transfer needs at least one sender rank and one receiver rank")
    for side, group in (("sender", senders), ("receiver", receivers)):
        first = group[0]
        for i, lay in enumerate(group):
            if (lay.num_layers, lay.head_dim) != (first.num_layers, first.head_dim):
                raise ReshardError(f"{side} ranks disagree on num_layers/head_dim (rank 0 and rank {i})")
    if (senders[0].num_layers, senders[0].head_dim) != (receivers[0].num_layers, receivers[0].head_dim):
        raise ReshardError(f"sender and receiver disagree on num_layers/head_dim: sender {senders[0].num_layers} "
                           f"layers x {senders[0].head_dim}, receiver {receivers[0].num_layers} x "
                           f"{receivers[0].head_dim}")
    routes: list[Route] = []
    for j, rcv in enumerate(receivers):
        chosen: dict[int, list[int]] = {}  # sender rank -> heads it sends to receiver j
        for h in range(rcv.head_start, rcv.head_end):
            holders = [i for i, s in enumerate(senders) if s.head_start <= h < s.head_end]
            if not holders:
                raise ReshardError(
                    f"impossible pairing: receiver rank {j} holds KV head {h}, which no sender rank holds "
                    f"(senders {_describe(senders)}; receivers {_describe(receivers)})")
            chosen.setdefault(holders[j % len(holders)], []).append(h)
        for i, heads in sorted(chosen.items()):
            lo, hi = _overlap(senders[i], rcv)
            if heads != list(range(lo, hi)):
                # the sender moves its whole overlap with the receiver: a head chosen from another replica
                # would then arrive twice
                raise ReshardError(
                    f"impossible pairing: sender rank {i} (heads [{senders[i].head_start}, {senders[i].head_end})) "
                    f"would send receiver rank {j} heads another sender rank also sends "
                    f"(senders {_describe(senders)}; receivers {_describe(receivers)})")
            routes.append(Route(i, j, lo, hi - lo))
    routes.sort(key=lambda r: (r.sender, r.receiver))
    return ReshardPlan(len(senders), len(receivers), tuple(routes))


def group_layouts(num_kv_heads: int, tp_size: int, *, num_layers: int, page_size: int, head_dim: int,
                  dtype: str) -> list[KVLayout]:
    """The layouts of every rank of a group of `tp_size` ranks (the sharding of engine/parallel.py)."""
    if tp_size < 1 or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ReshardError(f"tensor_parallel_size={tp_size} must divide or be a multiple of "
                           f"num_key_value_heads={num_kv_heads}")
    out = []
    for r in range(tp_size):
        if num_kv_heads >= tp_size:
            n, start = num_kv_heads // tp_size, r * (num_kv_heads // tp_size)
        else:
            n, start = 1, r * num_kv_heads // tp_size
        out.append(KVLayout(num_layers=num_layers, page_size=page_size, head_start=start, num_heads=n,
                            head_dim=head_dim, dtype=dtype))
    return out
