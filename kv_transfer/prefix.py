"""The workers' half of a prefix fetch (engine/prefix_fetch.py): the engine's plan and answer as
the boundary types the router carries (engine.outputs `PrefixFetch`, `PrefixExport`), with the
descriptors as bytes. Every worker role calls these, so they live below the workers."""
from __future__ import annotations

from collections.abc import Sequence

from engine.core import EngineCore
from engine.outputs import PrefixExport, PrefixFetch
from engine.prefix_fetch import FetchPlan
from kv_transfer.descriptor import DestinationDescriptor


def fetch_of(request_id: str, plan: FetchPlan | None) -> PrefixFetch | None:
    """What the router hands the holder for a request the engine queued with `add_fetching`."""
    if plan is None:
        return None
    dests = plan.destination if isinstance(plan.destination, list) else [plan.destination]
    return PrefixFetch(request_id, plan.start_token, plan.num_tokens, [d.to_bytes() for d in dests])


def export(core: EngineCore, fetch: PrefixFetch, prompt_token_ids: Sequence[int]) -> PrefixExport:
    """Send `fetch`'s tokens from `core`'s prefix cache; answers at once (the send goes on)."""
    if not isinstance(fetch, PrefixFetch):
        raise ValueError(f"fetch must be a PrefixFetch, got {type(fetch).__name__}")
    dests = [DestinationDescriptor.from_bytes(d) if isinstance(d, bytes) else d for d in fetch.descriptors]
    sent, error = core.export_prefix(fetch.request_id, list(prompt_token_ids), fetch.start_token, fetch.num_tokens,
                                     dests)
    return PrefixExport(fetch.request_id, sent, fetch.num_tokens, error)
