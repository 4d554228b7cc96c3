"""KV transfer for a tensor-parallel engine: every rank moves its own KV heads over its own
transport endpoint, the leader's connector speaks for them all to the engine.

Parts (vLLM's split: one scheduler-side connector, one worker-side transport per rank):
- `TPConnector` (rank 0, the engine's connector): owns rank 0's `TransferConnector` over rank
  0's KV heads and drives one `TransferConnector` per follower rank through commands;
- `FollowerKV` (ranks 1..N-1, in the follower's process, engine/tp_worker.py): that rank's
  `TransferConnector` (same transport, TransferConfig with the follower's host, model id and
  role), run by the leader's commands; its events go back to the leader.

Leader -> follower: commands (JSON) ride the follower's step queue (TPGroup.send_command), so a
follower handles them in order with the steps:
  start_save(tid, rid, dests, pages, num_tokens)  before the step whose forward writes the KV;
                          during that forward the follower's on_layer sends each layer
  finish_save(tid, rid, token)   after the leader sampled the first token
  expect(tid, rid, pages, num_tokens)  publish a receive; the follower replies "expected" with
                          its descriptor (or an error) and the leader waits for every reply
                          before it returns the descriptors, so no sender writes to a rank
                          that does not expect the request yet
  finished(tid, rid) / cancel(tid, rid)  the request left the engine / the transfer must end
  report                  the follower replies with what its sender and receiver track (tests)
  close                   fail every transfer (pages come back), reply "closed"
Follower -> leader: events, JSON on one queue in the group's TCPStore (`_EVENTS`), pushed by
the follower's pump thread (woken by its transport threads) on its own store connection, popped
by the leader's listener thread on its own:
  received(token) | failed(error) | released | ended   the rank is done with the request (ended:
                          it held nothing in flight when the leader ended it)
  start_failed(error)     the rank's send could not start (its terminal event follows)
  expected(desc|error), report(...), closed
Every command and event carries the transfer's `tid` (unique per transfer on this leader), so a
late event never touches a later request with the same id.

Aggregation, per request, on the engine thread (`take_events`): a rank is *pending* until its
terminal event. RECEIVED once every rank received and their first tokens agree (else FAILED).
On the first failure of any rank (failed, start_failed, the group broken), the transfer is
cancelled on every other rank, and FAILED is emitted only once every rank is terminal: no rank
can write into the pages any more. RELEASED (send side) once every rank that started released.

Failure: losing a rank loses the engine (engine/parallel.py). A watchdog thread checks the
group's liveness; once it is broken every transfer fails: the dead ranks count as terminal
(their memory is gone), rank 0's part is cancelled (its peers hear an abort), and the pages
come back with the FAILED/RELEASED event. `close` closes rank 0's connector and every
follower's, and waits (bounded) for their events.
"""
from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_connector import KVConnector, KVEvent, KVEventKind
from engine.request import Request
from kv_transfer.config import TransferConfig
from kv_transfer.connector import TransferConnector
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.reshard import ReshardError, group_layouts, plan_transfer

log = logging.getLogger(__name__)

_EVENTS = "tp/kv/events"
_SECRET_KEY = "tp/kv/secret"
_LIVENESS_S = 0.25  # the watchdog checks the group this often
_CLOSE_TIMEOUT_S = 10.0
_STORE_WAIT_S = 24 * 3600.0  # the listener's blocking pop: woken by events or the stop message


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def config_to_json(config: TransferConfig) -> dict:
    """A TransferConfig as JSON-able fields, without the secret (it goes through the store)."""
    out = dataclasses.asdict(config)
    out.pop("secret")
    out["allowed_dtype_conversions"] = sorted(list(p) for p in config.allowed_dtype_conversions)
    return out


def config_from_json(fields: dict, secret: str = "") -> TransferConfig:
    fields = dict(fields, secret=secret)
    fields["allowed_dtype_conversions"] = frozenset(tuple(p) for p in fields["allowed_dtype_conversions"])
    return TransferConfig(**fields)


# ---- the leader --------------------------------------------------------------------------------
@dataclass(eq=False)
class _Transfer:
    """One request's transfer over the ranks (the aggregation of the module docstring)."""

    tid: int
    req: Request
    receiving: bool
    pending: set[int]  # ranks not terminal yet
    started: tuple[int, ...] = ()  # ranks it runs on
    tokens: dict[int, int] = field(default_factory=dict)  # rank -> first token received
    error: str | None = None  # the first failure
    silent: bool = False  # the engine no longer waits for its event (it freed or never had the pages)


def make_connector(transport: str, config: TransferConfig | None = None, *, model_id: str, send: bool = False,
                   receive: bool = False, transport_kwargs: dict | None = None,
                   tensor_parallel_size: int = 1) -> KVConnector:
    """A worker's connector: a TransferConnector, wrapped in a TPConnector for a tensor-parallel
    engine (nothing added at tensor_parallel_size 1)."""
    conn = TransferConnector(transport, config, model_id=model_id, send=send, receive=receive,
                             transport_kwargs=transport_kwargs)
    return TPConnector(conn, tensor_parallel_size) if tensor_parallel_size > 1 else conn


class TPConnector(KVConnector):
    """The connector of a tensor-parallel leader (module docstring), over rank 0's
    `TransferConnector`; the engine calls `follower_config(store)` for the followers'
    ShardSpec, then `join_group(group, shard, num_kv_heads)` and `register_kv_caches` once the
    group is up."""

    tensor_parallel = True

    def __init__(self, rank0: TransferConnector, tensor_parallel_size: int) -> None:
        if rank0.transport == "local" or rank0.transport_kwargs:
            raise ValueError(f"tensor_parallel_size > 1 needs a transport every rank's process can build from its "
                             f"settings (nixl or grpc); {rank0.transport!r} with transport_kwargs cannot reach "
                             f"follower processes")
        self.rank0 = rank0
        self.group = None
        self.world = tensor_parallel_size  # join_group checks the group's size against it
        self.layouts: tuple = ()
        self._tids = itertools.count(1)
        self._transfers: dict[str, _Transfer] = {}  # by request id (rank 0's events carry the Request)
        self._by_tid: dict[int, _Transfer] = {}
        self._out: list[KVEvent] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # follower events, from the listener thread
        self._replies: dict[tuple[int, int], dict] = {}  # (tid or 0, rank) -> an expected/report/closed event
        self._replied = threading.Condition()
        self._wakeup: Callable[[], None] = lambda: None
        self._broken: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        rank0.set_wakeup(lambda: self._wakeup())

    @property
    def endpoint(self) -> str:
        """Where senders reach rank 0's receiver."""
        return self.rank0.endpoint

    # ---- set-up -----------------------------------------------------------------------------
    def follower_config(self, store) -> dict:
        """What a follower needs to build its rank's connector (JSON-able, for its ShardSpec); the
        transfer secret, if any, goes through the group's store, not the command line."""
        c = self.rank0
        if c.config.secret:
            store.set(_SECRET_KEY, c.config.secret)
        send, receive = c.roles
        return {"factory": f"{__name__}:FollowerKV",
                "settings": {"transport": c.transport, "model_id": c.model_id, "send": send, "receive": receive,
                             "tp_size": self.world,
                             "config": config_to_json(c.config), "has_secret": bool(c.config.secret)}}

    def join_group(self, group, shard, num_kv_heads: int) -> None:
        """The leader's TPGroup (connected) and rank 0's shard; starts the listener and watchdog."""
        if group.world != self.world:
            raise ValueError(f"this connector was made for tensor_parallel_size={self.world}, the engine's group has "
                             f"{group.world} ranks")
        self.group, self.shard, self.num_kv_heads = group, shard, num_kv_heads
        from engine.tp_worker import connect_store

        listener_store = connect_store(f"tcp://{group.host}:{group.store.port}", is_master=False,
                                       timeout_s=_STORE_WAIT_S)
        for name, target, args in (("tp-kv-listener", self._listen, (listener_store,)),
                                   ("tp-kv-watchdog", self._watch, ())):
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def register_kv_caches(self, kv_caches: list) -> None:
        self.rank0.register_kv_caches(kv_caches, head_start=self.shard.kv_head_start, num_kv_heads=self.num_kv_heads,
                                      tp_size=self.world, tp_rank=0)
        lay = self.rank0.pool.layout
        self.layouts = tuple(group_layouts(self.num_kv_heads, self.world, num_layers=lay.num_layers,
                                           page_size=lay.page_size, head_dim=lay.head_dim, dtype=lay.dtype))

    # ---- scheduler side ---------------------------------------------------------------------
    def check(self, req: Request) -> None:
        self.rank0.check(req)
        plan_transfer(self.layouts, [d.layout for d in req.kv_destinations])  # ReshardError is a ValueError

    def start_save(self, req: Request) -> str | None:
        dests = list(req.kv_destinations)
        try:
            plan = plan_transfer(self.layouts, [d.layout for d in dests])
        except ReshardError as exc:
            return str(exc)
        share = {r: [dests[j] for j in plan.receivers_of(r)] for r in range(self.world)}
        started = tuple(r for r in range(self.world) if share[r])
        if 0 in started:
            error = self.rank0.start_save(req, share[0])
            if error is not None:
                return error
        t = self._track(req, receiving=False, ranks=started)
        for r in started:
            if r:
                self._command(r, "start_save", t, dests=[_b64(d.to_bytes()) for d in share[r]],
                              pages=list(req.pages), num_tokens=req.num_prompt_tokens)
        return None

    def prepare_receive(self, req: Request) -> list[DestinationDescriptor]:
        """Every rank's descriptor, in rank order, once every rank expects the request."""
        t = self._track(req, receiving=True, ranks=range(self.world))
        try:
            first = self.rank0.prepare_receive(req)
        except BaseException:
            self._forget(t)
            raise
        try:
            for r in range(1, self.world):
                self._command(r, "expect", t, pages=list(req.pages), num_tokens=req.num_tokens)
            replies = [self._await_reply(t.tid, r, "expect") for r in range(1, self.world)]
            errors = [f"rank {r}: {e['error']}" for r, e in enumerate(replies, start=1) if e.get("error")]
            t.pending -= {r for r, e in enumerate(replies, start=1) if e.get("error")}  # they track nothing
            if errors:
                raise ValueError(f"a tensor-parallel rank could not expect the KV: {'; '.join(errors)}")
        except BaseException:
            t.silent = True  # the engine frees the pages; no sender has the descriptors
            self._fail(t, "the receive could not be prepared")
            self._settle(t)
            raise
        return [first] + [DestinationDescriptor.from_bytes(base64.b64decode(e["desc"])) for e in replies]

    def request_finished(self, req: Request) -> bool:
        self._out = [e for e in self._out if e.request is not req]
        rank0_busy = self.rank0.request_finished(req)
        t = self._transfers.get(req.request_id)
        if t is None or t.req is not req:
            return rank0_busy
        if not rank0_busy:
            t.pending.discard(0)
        for r in sorted(t.pending - {0}):
            self._command(r, "finished", t)
        if t.pending:
            return True
        t.silent = True
        self._settle(t)
        return False

    def cancel(self, req: Request) -> None:
        t = self._transfers.get(req.request_id)
        if t is not None and t.req is req:
            self._fail(t, "cancelled by the sender's caller")
        else:
            self.rank0.cancel(req)

    # ---- worker side ------------------------------------------------------------------------
    def save_layer(self, layer: int) -> None:
        self.rank0.save_layer(layer)  # the followers send theirs during their own forward

    def finish_save(self, req: Request, first_token: int) -> str | None:
        t = self._transfers.get(req.request_id)
        if t is None or t.req is not req:
            return "KV transfer failed"
        for r in t.started:
            if r:
                self._command(r, "finish_save", t, token=int(first_token))
        return self.rank0.finish_save(req, first_token) if 0 in t.started else None

    def take_events(self) -> list[KVEvent]:
        for ev in self.rank0.take_events():
            t = self._transfers.get(ev.request.request_id)
            if t is not None and t.req is ev.request:
                self._rank_event(t, 0, ev.kind.value, ev.first_token, ev.error)
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            t = self._by_tid.get(msg.get("tid"))
            if t is not None:
                self._rank_event(t, msg["rank"], msg["kind"], msg.get("token"), msg.get("error"))
        broken = self._group_broken()
        if broken is not None:
            for t in list(self._transfers.values()):
                t.pending -= set(range(1, self.world))  # gone, or out of step: they write nothing we read
                self._fail(t, broken)
                self._settle(t)
        out, self._out = self._out, []
        return out

    @property
    def has_events(self) -> bool:
        return bool(self._out or self.rank0.has_events or not self._inbox.empty()
                    or (self._group_broken() is not None
                        and any(t.pending - {0} for t in self._transfers.values())))

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        self._wakeup = fn

    @property
    def num_sending(self) -> int:
        """Sends whose source pages some rank still reads."""
        return sum(1 for t in self._transfers.values() if not t.receiving)

    def follower_reports(self, timeout_s: float = 10.0) -> list[dict]:
        """What each follower's connector tracks now (tests: nothing once every request ended):
        {"rank", "sender_pages", "receiver_pages", "requests"}."""
        for r in range(1, self.world):
            self._send(r, {"cmd": "report"})
        return [self._await_reply(0, r, "report", timeout_s) for r in range(1, self.world)]

    def close(self) -> None:
        """Fail every transfer on every rank; the pages come back with the events that follow.
        A second call does nothing."""
        if self._stop.is_set():
            return
        self.rank0.close()
        if self.group is not None and self._group_broken() is None:
            try:
                for r in range(1, self.world):
                    self._send(r, {"cmd": "close"})
                for r in range(1, self.world):
                    self._await_reply(0, r, "closed", _CLOSE_TIMEOUT_S)
            except Exception as exc:  # a lost follower: its pages went with it
                log.warning("closing the followers' KV connectors: %s", exc)
        self._stop.set()
        if self.group is not None and self.group.store is not None:
            try:
                self.group.store.queue_push(_EVENTS, json.dumps({"kind": "stop"}).encode())
            except RuntimeError:
                pass
        for th in self._threads:
            th.join(timeout=5)
        self._threads = []
        events = self.take_events()
        for t in list(self._transfers.values()):  # followers closed: nothing of theirs in flight
            t.pending -= set(range(1, self.world))
            self._settle(t)
        self._out = events + self._out

    # ---- the aggregation --------------------------------------------------------------------
    def _track(self, req: Request, receiving: bool, ranks) -> _Transfer:
        t = _Transfer(next(self._tids), req, receiving, set(ranks), tuple(ranks))
        self._transfers[req.request_id] = t
        self._by_tid[t.tid] = t
        return t

    def _forget(self, t: _Transfer) -> None:
        if self._transfers.get(t.req.request_id) is t:
            del self._transfers[t.req.request_id]
        self._by_tid.pop(t.tid, None)

    def _rank_event(self, t: _Transfer, rank: int, kind: str, token, error) -> None:
        if rank not in t.pending:
            return
        if kind == "start_failed":
            self._fail(t, f"rank {rank}'s send could not start: {error}")
            return
        t.pending.discard(rank)
        if kind == "received":
            t.tokens[rank] = token
        elif kind == "failed":
            self._fail(t, f"rank {rank}: {error or 'transfer failed'}")
        self._settle(t)

    def _fail(self, t: _Transfer, error: str) -> None:
        """The first failure of a transfer ends it on every rank still in it."""
        if t.error is not None:
            return
        t.error = error
        if 0 in t.pending:
            if not t.receiving:
                self.rank0.cancel(t.req)  # RELEASED follows
            elif not self.rank0.request_finished(t.req):  # nothing in flight on rank 0 any more
                t.pending.discard(0)
        for r in sorted(t.pending - {0}):
            self._command(r, "cancel", t)

    def _settle(self, t: _Transfer) -> None:
        """Emit the request's event once every rank is terminal."""
        if t.pending or self._by_tid.get(t.tid) is not t:
            return
        self._forget(t)
        if t.silent:
            return
        if not t.receiving:
            self._out.append(KVEvent(KVEventKind.RELEASED, t.req))
            return
        tokens = set(t.tokens.values())
        if t.error is None and len(t.tokens) == self.world and len(tokens) == 1:
            self._out.append(KVEvent(KVEventKind.RECEIVED, t.req, first_token=tokens.pop()))
            return
        error = t.error or f"the ranks disagree on the first token: {dict(sorted(t.tokens.items()))}"
        self._out.append(KVEvent(KVEventKind.FAILED, t.req, error=error))

    def _group_broken(self) -> str | None:
        if self._broken is None and self.group is not None and self.group.broken is not None:
            self._broken = self.group.broken
        return None if self._broken is None else f"tensor-parallel group broken: {self._broken}"

    # ---- talking to the followers -----------------------------------------------------------
    def _command(self, rank: int, cmd: str, t: _Transfer, **fields) -> None:
        self._send(rank, {"cmd": cmd, "tid": t.tid, "rid": t.req.request_id, **fields})

    def _send(self, rank: int, msg: dict) -> None:
        """A command to follower `rank`; a broken group drops it (take_events then fails everything)."""
        from engine.parallel import TPGroupError

        if self._group_broken() is not None:
            return
        try:
            self.group.send_command(rank, json.dumps(msg).encode())
        except TPGroupError as exc:
            self._broken = self._broken or str(exc)
            self._wakeup()

    def _await_reply(self, tid: int, rank: int, what: str, timeout_s: float | None = None) -> dict:
        """Wait for follower `rank`'s reply; TPGroupError once the group is broken or after the
        group's timeout."""
        from engine.parallel import TPGroupError

        deadline = time.monotonic() + (timeout_s or self.group.timeout_s)
        with self._replied:
            while (tid, rank) not in self._replies:
                broken = self._group_broken()
                if broken is not None:
                    raise TPGroupError(f"no {what} reply from rank {rank}: {broken}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TPGroupError(f"tensor-parallel rank {rank} sent no {what} reply within "
                                       f"{timeout_s or self.group.timeout_s:g} s")
                self._replied.wait(min(left, _LIVENESS_S))
            return self._replies.pop((tid, rank))

    def _listen(self, store) -> None:
        """Listener thread: follower events into the inbox (replies to their waiters)."""
        while not self._stop.is_set():
            try:
                msg = json.loads(store.queue_pop(_EVENTS))
            except Exception as exc:  # a wait that timed out, or the store closed with the engine
                if self._stop.is_set():
                    return
                if "timeout" in str(exc).lower():
                    continue
                log.warning("tensor-parallel KV listener stops: %s", exc)
                return
            kind = msg["kind"]
            if kind == "stop":
                return
            if kind in ("expected", "report", "closed"):
                with self._replied:
                    self._replies[(msg.get("tid", 0), msg["rank"])] = msg
                    self._replied.notify_all()
                continue
            self._inbox.put(msg)
            self._wakeup()

    def _watch(self) -> None:
        """Watchdog thread: once the group is lost, wake the engine (its transfers fail)."""
        while not self._stop.wait(_LIVENESS_S):
            try:
                self.group.check()
            except Exception as exc:
                self._broken = self._broken or str(exc)
            if self._broken is not None:
                with self._replied:
                    self._replied.notify_all()
                self._wakeup()
                return


# ---- a follower --------------------------------------------------------------------------------
@dataclass(eq=False)
class _RankRequest:
    """A follower's stand-in for the leader's Request: what TransferConnector reads of one."""

    request_id: str
    tid: int
    pages: list[int]
    num_tokens: int  # the prompt's (a send), or every token the receive expects
    kv_destinations: tuple = ()
    receiving: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens


class FollowerKV:
    """Follower rank `rank`'s KV connector, run by the leader's commands (module docstring).
    `lock` is held by the step loop around each command and each forward, and by the pump
    around each batch of events it forwards."""

    def __init__(self, settings: dict, *, rank: int, host: str, kv_caches: list, head_start: int, num_kv_heads: int,
                 store, event_store) -> None:
        """`settings`: TPConnector.follower_config's; `host`: this rank's address (its transport
        binds there); `store`: the group's store; `event_store`: a connection of its own to it."""
        secret = store.get(_SECRET_KEY).decode() if settings.get("has_secret") else ""
        config = dataclasses.replace(config_from_json(settings["config"], secret), host=host, port=0)
        self.rank = rank
        self.conn = TransferConnector(settings["transport"], config, model_id=settings["model_id"],
                                      send=settings["send"], receive=settings["receive"])
        self.conn.register_kv_caches(kv_caches, head_start=head_start, num_kv_heads=num_kv_heads,
                                     tp_size=settings["tp_size"], tp_rank=rank)
        self.lock = threading.Lock()
        self._store = event_store  # this rank's own connection for its events
        self._push_lock = threading.Lock()
        self._reqs: dict[str, _RankRequest] = {}
        self._wake = threading.Event()
        self._stop = False
        self.conn.set_wakeup(self._wake.set)
        self._pump = threading.Thread(target=self._pump_loop, name=f"tp-kv-pump-{rank}", daemon=True)
        self._pump.start()

    def on_layer(self):
        """The forward's per-layer callback when a send started this step, else None."""
        return self.conn.save_layer if self.conn.saving_this_step else None

    def handle(self, raw: bytes) -> None:
        msg = json.loads(raw)
        with self.lock:
            getattr(self, f"_on_{msg['cmd']}")(msg)

    # ---- commands (under the lock) ----------------------------------------------------------
    def _on_start_save(self, m: dict) -> None:
        dests = tuple(DestinationDescriptor.from_bytes(base64.b64decode(d)) for d in m["dests"])
        h = self._reqs[m["rid"]] = _RankRequest(m["rid"], m["tid"], m["pages"], m["num_tokens"], dests)
        error = self.conn.start_save(h)
        if error is not None:
            self._event(h, "start_failed", error=error)
            if not self.conn.is_sending(h.request_id):
                self._end(h)

    def _on_finish_save(self, m: dict) -> None:
        h = self._find(m)
        if h is not None:
            self.conn.finish_save(h, m["token"])  # a failure shows as the sender's release

    def _on_expect(self, m: dict) -> None:
        h = _RankRequest(m["rid"], m["tid"], m["pages"], m["num_tokens"], receiving=True)
        try:
            desc = self.conn.prepare_receive(h)
        except Exception as exc:
            self._push({"kind": "expected", "tid": h.tid, "error": f"{type(exc).__name__}: {exc}"})
            return
        self._reqs[h.request_id] = h
        self._push({"kind": "expected", "tid": h.tid, "desc": _b64(desc.to_bytes())})

    def _on_finished(self, m: dict) -> None:
        h = self._find(m)
        if h is not None and not self.conn.request_finished(h):
            self._end(h)

    def _on_cancel(self, m: dict) -> None:
        h = self._find(m)
        if h is None:
            return
        if not h.receiving:
            self.conn.cancel(h)  # its release follows, if it still sends
        if not self.conn.request_finished(h):
            self._end(h)

    def _on_report(self, m: dict) -> None:
        c = self.conn
        self._push({"kind": "report", "sender_pages": c.sender.tracked_pages() if c.sender else [],
                    "receiver_pages": c.receiver.tracked_pages() if c.receiver else [],
                    "requests": sorted(self._reqs)})

    def _on_close(self, m: dict) -> None:
        self.conn.close()
        self._forward_events()
        self._push({"kind": "closed"})

    def _find(self, m: dict) -> _RankRequest | None:
        h = self._reqs.get(m["rid"])
        return h if h is not None and h.tid == m["tid"] else None

    def _end(self, h: _RankRequest) -> None:
        if self._reqs.get(h.request_id) is h:
            del self._reqs[h.request_id]
        self._event(h, "ended")

    # ---- events -----------------------------------------------------------------------------
    def _pump_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            with self.lock:
                self._forward_events()

    def _forward_events(self) -> None:
        for ev in self.conn.take_events():
            h = ev.request
            if self._reqs.get(h.request_id) is h:
                del self._reqs[h.request_id]
            self._event(h, ev.kind.value, token=ev.first_token, error=ev.error)

    def _event(self, h: _RankRequest, kind: str, **fields) -> None:
        self._push({"kind": kind, "tid": h.tid, **fields})

    def _push(self, msg: dict) -> None:
        msg["rank"] = self.rank
        with self._push_lock:
            try:
                self._store.queue_push(_EVENTS, json.dumps(msg).encode())
            except RuntimeError as exc:  # the leader is gone: the step loop finds out too
                log.warning("rank %d could not report a KV event: %s", self.rank, exc)

    def close(self) -> None:
        """The follower leaves: fail what is in flight (best effort to tell the leader)."""
        with self.lock:
            self.conn.close()
            self._forward_events()
        self._stop = True
        self._wake.set()
        self._pump.join(timeout=5)
