"""Multi-turn load: conversations whose every turn resends the whole history, and the two
clients that play them.

- A synthetic chat (`synthetic_chats`) is closed-loop: turn 1 sends an opening prompt; each
  later turn sends the previous prompt, the answer the model gave to it (its real token ids,
  greedy, `ignore_eos`, so every answer has the asked length) and some new user tokens, as
  soon as that answer has finished. Every prefix a turn repeats was computed before.
- A Mooncake conversation replay (`mooncake_conversations`) is open-loop: requests at the
  trace's (compressed) times, prompts whose blocks follow the trace's `hash_ids`, so equal ids
  are equal tokens and the trace's shared prefixes are real ones. The trace has no
  conversation ids: a request continues the earlier request with which it shares the longest
  run of leading blocks (at least MIN_SHARED_BLOCKS; block 0 is common to every request; the
  first such request, see `trace_parents`), and its turn is that one's turn + 1.

Both give one `TurnRecord` per request: the client's `RequestRecord` (TTFT, the router's
`usage.cached_prompt_tokens`, placement) with its conversation, turn and the part of the
prompt that an earlier request already computed (`reusable_tokens`: what a perfect cache holds).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.client import send_request
from loadgen.metrics import RequestRecord
from loadgen.workloads import (DEFAULT_RESERVED_IDS, MOONCAKE_BLOCK_TOKENS, Workload, WorkloadRequest, load_mooncake,
                               materialize_prompts)
from proto.client import ClientAuth
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

MIN_SHARED_BLOCKS = 2


@dataclass(slots=True)
class TurnRecord:
    conversation: int
    turn: int                 # 1-based
    reusable_tokens: int      # leading prompt tokens an earlier request of the run already had
    record: RequestRecord


@dataclass(slots=True)
class Chat:
    """One synthetic conversation: the new tokens of each turn (turn 1: the opening prompt)."""
    conversation: int
    new_tokens: list[list[int]]
    answer_tokens: int


def synthetic_chats(conversations: int, turns: int, prompt_tokens: int, answer_tokens: int, user_tokens: int,
                    vocab_size: int, seed: int, reserved_ids: int = DEFAULT_RESERVED_IDS) -> list[Chat]:
    """`conversations` chats of `turns` turns; random ids from [reserved_ids, vocab_size), distinct
    per conversation and seed, so no two chats (or runs with other seeds) share a prefix."""
    for name, v, lo in (("conversations", conversations, 1), ("turns", turns, 1), ("prompt_tokens", prompt_tokens, 1),
                        ("answer_tokens", answer_tokens, 1), ("user_tokens", user_tokens, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if vocab_size <= reserved_ids:
        raise ValueError(f"vocab_size must be > reserved_ids ({reserved_ids}), got {vocab_size}")
    chats = []
    for c in range(conversations):
        rng = random.Random(f"{seed}:chat:{c}")
        new = [[rng.randrange(reserved_ids, vocab_size) for _ in range(prompt_tokens if t == 0 else user_tokens)]
               for t in range(turns)]
        chats.append(Chat(c, new, answer_tokens))
    return chats


def chat_tokens(chat: Chat) -> int:
    """Positions the chat's last turn needs: every turn's new tokens and every answer."""
    return sum(len(n) for n in chat.new_tokens) + chat.answer_tokens * len(chat.new_tokens)


@dataclass
class TraceReplay:
    """Requests of a Mooncake trace, scaled; `turns[i]`, `conversations[i]` and `reusable[i]`
    belong to `workload.requests[i]`."""
    workload: Workload
    turns: list[int]
    conversations: list[int]
    reusable: list[int]
    meta: dict = field(default_factory=dict)


def trace_parents(blocks: list[tuple[int, ...]], min_shared: int = MIN_SHARED_BLOCKS) -> list[tuple[int | None, int]]:
    """For each request (in arrival order): (the first earlier request that had the longest run of
    leading block ids this one shares, at least `min_shared` long, else None; that run's length, 0
    if None). The first, not the latest: a request that branches off after block k continues the
    request that introduced blocks 0..k, not a sibling that went on from there."""
    owner: dict[tuple[int, ...], int] = {}
    out = []
    for i, h in enumerate(blocks):
        found: tuple[int | None, int] = (None, 0)
        for j in range(len(h), min_shared - 1, -1):
            if j and h[:j] in owner:
                found = (owner[h[:j]], j)
                break
        out.append(found)
        for j in range(1, len(h) + 1):
            owner.setdefault(h[:j], i)
    return out


def mooncake_conversations(path: str | Path, *, vocab_size: int, max_model_len: int, conversations: int = 8,
                           window_s: float = 900.0, block_tokens: int = 16, max_prompt_tokens: int = 1024,
                           max_output_tokens: int = 64, time_scale: float = 0.05, min_turns: int = 2,
                           seed: int = 0) -> TraceReplay:
    """The first `conversations` conversations of the trace's first `window_s` seconds that reach
    `min_turns` turns inside the window, every request of theirs in it, scaled to a small model:
    one 512-token block -> `block_tokens` tokens (prompt and output lengths x the same factor),
    prompts capped at `max_prompt_tokens` (and `max_model_len` - output), outputs at
    `max_output_tokens`, arrival times x `time_scale` from the first selected request."""
    if conversations < 1 or block_tokens < 1 or not time_scale > 0 or not window_s > 0 or min_turns < 1:
        raise ValueError("conversations, block_tokens, min_turns must be >= 1 and time_scale, window_s > 0; got "
                         f"{conversations}, {block_tokens}, {min_turns}, {time_scale}, {window_s}")
    trace = load_mooncake(path)
    reqs = [r for r in trace.requests if r.arrival_s - trace.requests[0].arrival_s < window_s]
    parents = trace_parents([r.prefix_blocks for r in reqs])
    turn, root = [], []
    for i, (p, _) in enumerate(parents):
        turn.append(1 if p is None else turn[p] + 1)
        root.append(i if p is None else root[p])
    depth: dict[int, int] = {}
    for i, rt in enumerate(root):
        depth[rt] = max(depth.get(rt, 0), turn[i])
    chosen = [rt for rt in sorted(depth) if depth[rt] >= min_turns][:conversations]
    if not chosen:
        raise ValueError(f"{path}: no conversation of {min_turns}+ turns in its first {window_s:g} s")
    conv_of = {rt: k for k, rt in enumerate(chosen)}
    keep = [i for i in range(len(reqs)) if root[i] in conv_of]
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    t0 = reqs[keep[0]].arrival_s
    out = []
    for n, i in enumerate(keep):
        r = reqs[i]
        o = min(max(1, round(r.output_len * scale)), max_output_tokens, max_model_len - 1)
        p = min(max(1, round(r.prompt_len * scale)), max_prompt_tokens, max_model_len - o)
        out.append(WorkloadRequest(n, (r.arrival_s - t0) * time_scale, p, o, r.prefix_blocks[: p // block_tokens]))
    wl = Workload(out, block_tokens, Path(path).stem,
                  {"length_scale": scale, "time_scale": time_scale, "window_s": window_s})
    materialize_prompts(wl, vocab_size, seed)
    # what a perfect cache holds: the leading blocks an earlier selected request had (after scaling)
    shared = trace_parents([r.prefix_blocks for r in out], min_shared=1)
    reusable = [min(k * block_tokens, r.prompt_len) for (_, k), r in zip(shared, out)]
    meta = {"trace": str(path), "trace_requests_in_window": len(reqs), "block_tokens": block_tokens,
            "trace_block_tokens": MOONCAKE_BLOCK_TOKENS, "length_scale": scale, "time_scale": time_scale,
            "window_s": window_s, "conversations": len(chosen), "requests": len(out),
            "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens, "min_turns": min_turns}
    return TraceReplay(wl, [turn[i] for i in keep], [conv_of[root[i]] for i in keep], reusable, meta)


async def run_chats(address: str, chats: list[Chat], *, timeout_s: float = 600.0, run_tag: str = "chat",
                    auth: ClientAuth | None = None, think_s: float = 0.0) -> list[TurnRecord]:
    """Every chat at once, each closed-loop: a turn is sent `think_s` after the previous answer
    has finished (a user reading it; 0: at once). A failed turn ends its chat (its record carries
    the error)."""
    out: list[TurnRecord] = []

    async def one(stub: pb_grpc.InferenceStub, chat: Chat) -> None:
        history: list[int] = []
        for t, new in enumerate(chat.new_tokens, 1):
            if t > 1 and think_s > 0:
                await asyncio.sleep(think_s)
            prompt = history + new
            req = WorkloadRequest(t, time.perf_counter() - t0, len(prompt), chat.answer_tokens, prompt_token_ids=prompt)
            answer: list[int] = []
            rec = await send_request(stub, req, t0, timeout_s, f"{run_tag}-c{chat.conversation}-t{t}", answer)
            out.append(TurnRecord(chat.conversation, t, len(history), rec))
            if not rec.ok:
                return
            history = prompt + answer

    async with (auth or ClientAuth()).aio_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub, c) for c in chats))
    return sorted(out, key=lambda r: (r.conversation, r.turn))


async def run_trace(address: str, replay: TraceReplay, *, timeout_s: float = 600.0, run_tag: str = "trace",
                    auth: ClientAuth | None = None) -> list[TurnRecord]:
    """Open loop: each request at its arrival time, whether or not earlier turns have finished."""
    async def one(stub: pb_grpc.InferenceStub, i: int, req: WorkloadRequest) -> TurnRecord:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
        rec = await send_request(stub, req, t0, timeout_s, f"{run_tag}-{i}")
        return TurnRecord(replay.conversations[i], replay.turns[i], replay.reusable[i], rec)

    async with (auth or ClientAuth()).aio_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(one(stub, i, r) for i, r in enumerate(replay.workload.requests))))
