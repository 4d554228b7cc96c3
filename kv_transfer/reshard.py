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

Every route moves the sender rank's whole overlap with the receiver rank (that is what the
transports move: the receiver keeps the heads it holds of what a sender sends), so the plan
is, per receiver rank, an exact cover of its heads by sender overlaps; for TP groups (the
layouts `group_layouts` gives) that cover is the minimal number of routes.

The plan depends only on the two sides' layouts, so a worker computes it once per pair of
layouts (`plan_transfer` caches it: the same layouts give the same plan object) and reuses it
for every request between them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kv_transfer.layout import KVLayout, tp_head_range


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
    return "[" + "; ".join(f"rank {i}: {lay.describe()}" for i, lay in enumerate(layouts)) + "]"


def _sides(senders: tuple[KVLayout, ...], receivers: tuple[KVLayout, ...]) -> str:
    return f"senders {_describe(senders)} / receivers {_describe(receivers)}"


def plan_transfer(senders: list[KVLayout] | tuple[KVLayout, ...],
                  receivers: list[KVLayout] | tuple[KVLayout, ...]) -> ReshardPlan:
    """The routes from sender ranks (`senders[i]`: rank i's layout) to receiver ranks
    (`receivers[j]`, e.g. the layouts of a decode group's descriptors, in rank order).
    Cached: the same layouts give the same ReshardPlan object. Raises ReshardError for an
    impossible pairing, naming both sides."""
    return _plan(tuple(senders), tuple(receivers))


def _check_group(side: str, group: tuple[KVLayout, ...]) -> None:
    first = group[0]
    for i, lay in enumerate(group):
        if (lay.num_layers, lay.head_dim) != (first.num_layers, first.head_dim):
            raise ReshardError(f"{side} ranks disagree on num_layers/head_dim: rank 0 {first.describe()}, "
                               f"rank {i} {lay.describe()}")
    if any(lay.tp_size != 1 for lay in group):  # layouts that declare their topology must agree with the group's
        for i, lay in enumerate(group):
            if (lay.tp_size, lay.tp_rank) != (len(group), i):
                raise ReshardError(f"{side} rank {i} of a group of {len(group)} declares tp {lay.tp_size} rank "
                                   f"{lay.tp_rank} ({lay.describe()}): tensor_parallel_size and rank must be the "
                                   f"group's size and the layout's position in it")


def _cover(j: int, rcv: KVLayout, senders: tuple[KVLayout, ...]) -> list[tuple[int, int, int]] | None:
    """An exact cover of receiver rank j's heads by sender overlaps, as (sender, lo, hi), or None.
    At each head, the senders whose overlap starts there are tried from the (j mod R)-th on, so
    receivers spread over the R replicas of a replicated head."""
    starts: dict[int, list[tuple[int, int]]] = {}
    for i, snd in enumerate(senders):
        lo, hi = _overlap(snd, rcv)
        if lo < hi:
            starts.setdefault(lo, []).append((i, hi))
    dead: set[int] = set()  # heads from which no cover of the rest exists

    def search(pos: int) -> list[tuple[int, int, int]] | None:
        if pos == rcv.head_end:
            return []
        if pos in dead:
            return None
        options = starts.get(pos, [])
        for k in range(len(options)):
            i, hi = options[(j + k) % len(options)]
            rest = search(hi)
            if rest is not None:
                return [(i, pos, hi), *rest]
        dead.add(pos)
        return None

    return search(rcv.head_start)


@functools.lru_cache(maxsize=256)
def _plan(senders: tuple[KVLayout, ...], receivers: tuple[KVLayout, ...]) -> ReshardPlan:
    if not senders or not receivers:
        raise ReshardError(f"a transfer needs at least one sender rank and one receiver rank, got "
                           f"{len(senders)} sender(s) and {len(receivers)} receiver(s)")
    _check_group("sender", senders)
    _check_group("receiver", receivers)
    for name in ("num_layers", "head_dim"):
        if getattr(senders[0], name) != getattr(receivers[0], name):
            raise ReshardError(f"impossible pairing: sender and receiver disagree on {name} "
                               f"({getattr(senders[0], name)} vs {getattr(receivers[0], name)}): "
                               f"{_sides(senders, receivers)}")
    routes: list[Route] = []
    for j, rcv in enumerate(receivers):
        for h in range(rcv.head_start, rcv.head_end):
            if not any(s.head_start <= h < s.head_end for s in senders):
                raise ReshardError(f"impossible pairing: receiver rank {j} holds KV head {h}, which no sender "
                                   f"rank holds: {_sides(senders, receivers)}")
        cover = _cover(j, rcv, senders)
        if cover is None:
            # every head is held, but no set of whole sender overlaps covers each head once
            raise ReshardError(f"impossible pairing: receiver rank {j}'s heads cannot each come from exactly one "
                               f"sender rank (senders' ranges overlap unevenly): {_sides(senders, receivers)}")
        routes.extend(Route(i, j, lo, hi - lo) for i, lo, hi in cover)
    routes.sort(key=lambda r: (r.sender, r.receiver))
    return ReshardPlan(len(senders), len(receivers), tuple(routes))


def group_layouts(num_kv_heads: int, tp_size: int, *, num_layers: int, page_size: int, head_dim: int,
                  dtype: str) -> list[KVLayout]:
    """The layouts of every rank of a group of `tp_size` ranks (the sharding of engine/parallel.py),
    each carrying its topology (tp_size, tp_rank). ReshardError when no such sharding exists."""
    try:
        ranges = [tp_head_range(num_kv_heads, tp_size, r) for r in range(tp_size)] if tp_size >= 1 else None
    except ValueError as exc:
        raise ReshardError(str(exc)) from None
    if ranges is None:
        raise ReshardError(f"tensor_parallel_size={tp_size} must be >= 1")
    return [KVLayout(num_layers=num_layers, page_size=page_size, head_start=start, num_heads=n, head_dim=head_dim,
                     dtype=dtype, tp_size=tp_size, tp_rank=r) for r, (start, n) in enumerate(ranges)]
