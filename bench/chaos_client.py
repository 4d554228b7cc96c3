"""The chaos suite's client-side scenarios (bench/chaos.py): `http-fuzz` and `disconnect`.

http-fuzz   Random requests to the cluster's OpenAI-compatible HTTP API (seeded random.Random, no
            hypothesis): /v1/completions and /v1/chat/completions, streamed and not, with random
            JSON values in known and unknown fields, deep nesting, huge numbers, lone surrogates
            (sent as JSON escapes), NUL, long strings, bodies that are not JSON, wrong content
            types, other methods and paths. Each answer is judged as in
            tests/integration/test_http_fuzz.py: a 4xx in OpenAI's error shape whose `param` names
            the field (for a field error), or a valid 200 (its event stream ending with [DONE]);
            never a 5xx, never an error that is not JSON, never a hang.
disconnect  Clients that leave at every stage, through gRPC, HTTP streamed and HTTP not streamed:
            queued (the router's max_inflight filled with long streams), prefilling (long prompts,
            the client leaves as soon as the router counts the request), transferring (after the
            first token) and decoding (after k tokens). After each leave the router's
            inflight + queued counts (ClusterStatus) must drop within SLOT_BOUND_S and every
            worker's free_pages == total_pages within PAGES_BOUND_S; the measured times go into
            the row's extra fields.

The suite's helpers come from the caller (`tools`: bench.chaos's module); this module does not
import bench.chaos (lint-imports forbids the cycle).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import time
from typing import Any

KNOWN = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
         "presence_penalty", "frequency_penalty", "seed", "logprobs", "top_logprobs", "logit_bias", "stream",
         "stream_options", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "best_of", "echo",
         "suffix", "response_format", "tools", "tool_choice", "user", "metadata", "modalities"]
FIELD_CODES = {"invalid_value", "invalid_type", "unknown_parameter", "unsupported_parameter", "unsupported_value",
               "model_not_found"}
STRINGS = ["\ud800", "a\udfffb", "\x00", "\x00\x00x", "Hello", "user", "assistant", "system", "text", "x" * 20_000,
           "\U0001f600" * 50, "", "\\", "\"", "<|endoftext|>", "\u202e", "\ufeff"]
NUMBERS = [10**400, -(10**400), 2**31, 2**63, 2**64, -(2**63) - 1, -0.0, 0.0, 1e308, 5e-324, 0.5, 1.0,
           float("nan"), float("inf"), float("-inf"), -1, 0, 1, 2, 3, 255, 256, 257]
HTTP_TIMEOUT_S = 60.0
SLOT_BOUND_S = 1.0    # the promise: the slot is free within this after the client left
PAGES_BOUND_S = 2.0   # and every page back within this
DOORS = ("grpc", "http-stream", "http")


# ---- http-fuzz: the generator -------------------------------------------------------------------
class HttpFuzzer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def string(self) -> str:
        r = self.rng
        if r.random() < 0.5:
            return r.choice(STRINGS)
        return "".join(chr(r.choice((r.randint(0, 0x7f), r.randint(0, 0xd7ff), r.randint(0xe000, 0x10ffff),
                                     r.randint(0xd800, 0xdfff)))) for _ in range(r.randint(0, 20)))

    def number(self):
        r = self.rng
        return r.choice((lambda: r.choice(NUMBERS), lambda: r.randint(-3, 300), lambda: r.getrandbits(80) - 2**79,
                         lambda: r.uniform(-10, 10), lambda: r.random() * 10 ** r.randint(-320, 308)))()

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        k = r.random()
        if depth < 3 and k < 0.15:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        if depth < 3 and k < 0.3:
            keys = ["role", "content", "type", "text", "include_usage"]
            return {(r.choice(keys) if r.random() < 0.7 else self.string()): self.value(depth + 1)
                    for _ in range(r.randint(0, 3))}
        return r.choice((None, True, False, self.number(), self.number(), self.string(), self.string()))

    def case(self) -> dict:
        """{method, path, data, ctype, body (the fields sent, for the oracle; None: unknown), chat}."""
        r = self.rng
        chat = r.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        ctype = r.choice(["application/json"] * 4 + ["text/plain", "", "application/x-www-form-urlencoded",
                                                     "application/json; charset=latin-1", "multipart/form-data"])
        kind = r.choice(["fields"] * 6 + ["raw", "nested", "method", "path", "valid"])
        c = {"method": "POST", "path": path, "ctype": ctype, "chat": chat, "kind": kind}
        if kind == "raw":
            raw = r.choice((lambda: r.randbytes(r.randint(0, 200)), lambda: b"{", lambda: b"",
                            lambda: b"[1, 2, 3]", lambda: b"null", lambda: b"\"prompt\"", lambda: b"{\"a\": }",
                            lambda: b"{\"prompt\": \"\xff\xfe\"}", lambda: b"\x00" * 50,
                            lambda: b"{\"prompt\": \"x\", \"prompt\": 1}"))()
            return c | {"data": raw, "body": None}
        if kind == "nested":
            depth = r.choice((r.randint(1, 100), r.randint(100, 10_000), r.randint(10_000, 200_000)))
            open_, close = r.choice(((b"[", b"]"), (b"{\"a\": ", b"}")))
            return c | {"data": b"{\"prompt\": " + open_ * depth + (b"1" if open_ == b"[" else b"1") +
                        close * depth + b"}", "body": {"prompt": None}}
        body: dict = {"messages": [{"role": "user", "content": "Hello"}]} if chat else {"prompt": "Hello"}
        body.update(max_tokens=2, stream=r.random() < 0.5)
        if kind == "method":
            c["method"] = r.choice(("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"))
        elif kind == "path":
            c["path"] = r.choice(("/", "/v1", "/v1/", "/v2/completions", "/v1/completions/x", "/v1/engines",
                                  "/v1/chat", "/v1/%00", "/v1/" + "a" * 3000, "/v1/completions?x=%7f%00",
                                  "/../etc/passwd", "/v1/embeddings"))
        elif kind == "fields":
            for _ in range(r.randint(1, 3)):
                name = r.choice(KNOWN) if r.random() < 0.7 else self.string()
                body[name] = self.value()
            for name in ("max_tokens", "max_completion_tokens"):  # no runaway generations
                v = body.get(name)
                if isinstance(v, int) and not isinstance(v, bool) and 8 < v < 2**31:
                    body[name] = 8
        # ensure_ascii: lone surrogates go out as \ud800 escapes (the bytes themselves are not UTF-8)
        data = json.dumps(body, ensure_ascii=r.random() < 0.8 or _has_surrogate(body)).encode()
        # the oracle sees the fields as the server parses them: a surrogate pair sent as two escapes
        # is one character there
        return c | {"data": data, "body": json.loads(data)}


def _has_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        return any(0xd800 <= ord(ch) <= 0xdfff for ch in v)
    if isinstance(v, dict):
        return any(_has_surrogate(k) or _has_surrogate(x) for k, x in v.items())
    if isinstance(v, list):
        return any(_has_surrogate(x) for x in v)
    return False


# ---- http-fuzz: sending and judging -------------------------------------------------------------
def send(host: str, port: int, method: str, path: str, data: bytes, ctype: str,
         timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes, str, str]:
    """(status, body, content type, "" or the client's error); status 0: no answer (timeout/closed)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        headers = {"Content-Type": ctype} if ctype else {}
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        r = conn.getresponse()
        return r.status, r.read(), r.headers.get("content-type", ""), ""
    except (socket.timeout, TimeoutError):
        return 0, b"", "", "timeout"
    except (OSError, http.client.HTTPException) as exc:
        return 0, b"", "", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def check_error(status: int, raw: bytes, body: dict | None) -> tuple[str, str]:
    """("clean" | "wrong" | "bad", why) for an answer that is not a 200."""
    if status >= 500 or status < 400:
        return "wrong", f"status {status}"
    try:
        doc = json.loads(raw)
        err = doc["error"]
    except (ValueError, KeyError, TypeError):
        return "bad", f"a {status} whose body is not OpenAI's error JSON: {raw[:120]!r}"
    if set(doc) != {"error"} or not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return "bad", f"error shape {sorted(err) if isinstance(err, dict) else type(err).__name__}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["code"], str)):
        return "bad", "error message or code not a non-empty string"
    if err["code"] in FIELD_CODES:
        if err["param"] is None:
            return "wrong", f"a field error ({err['code']}) without its field"
        head = err["param"].split("[", 1)[0].split(".", 1)[0]
        if body is not None and not (err["param"] in body or head in body or head in ("messages", "prompt")):
            return "wrong", f"param {err['param']!r} names no field that was sent"
    return "clean", ""


def check_answer(raw: bytes, ctype: str, chat: bool) -> str:
    """"" for a valid 200, else why not."""
    obj = "chat.completion" if chat else "text_completion"
    try:
        if ctype.startswith("text/event-stream"):
            events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
            if not events or events[-1] != "[DONE]":
                return f"the event stream does not end with [DONE]: {events[-2:]}"
            chunks = [json.loads(e) for e in events[:-1]]
            if not all("error" in c or str(c.get("object", "")).startswith(obj) for c in chunks):
                return "an event of another object"
            if not (any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
                    or (chunks and "error" in chunks[-1])):
                return "no event with a finish_reason"
            return ""
        out = json.loads(raw)
        if out.get("object") != obj or out["choices"][0]["finish_reason"] not in ("stop", "length"):
            return f"object {out.get('object')!r}, finish_reason {out['choices'][0].get('finish_reason')!r}"
        if out["usage"]["completion_tokens"] < 1:
            return "no completion tokens"
        return ""
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:
        return f"not a valid answer ({type(exc).__name__}: {exc}): {raw[:120]!r}"


def _count(row, kind: str, status: int, case: dict, why: str, tools) -> None:
    row.tried += 1
    key = str(status) if status else "no answer"
    row.codes[key] = row.codes.get(key, 0) + 1
    attr = {"ok": "ok", "clean": "clean_errors", "wrong": "wrong_codes", "bad": "bad_responses",
            "hang": "hangs"}[kind]
    setattr(row, attr, getattr(row, attr) + 1)
    if kind in ("ok", "clean"):
        return
    if len(row.problems) >= 50:
        row.extra["problems_left_out"] = row.extra.get("problems_left_out", 0) + 1
        return
    body = case["body"]
    desc = {"method": case["method"], "path": case["path"][:80], "content_type": case["ctype"],
            "kind": case["kind"], "bytes": len(case["data"])}
    if body is not None:
        desc["body"] = {str(k)[:40]: tools._short(v) for k, v in body.items()}
    else:
        desc["data"] = case["data"][:80].decode("latin-1")
    row.problems.append({"kind": kind, "why": why, "code": key, "details": why[:400],
                         "expected": {"4xx in OpenAI's error shape": [], "200": []}, "oracle": "http-fuzz",
                         "chunks": 0, "elapsed_s": 0.0, "request": desc})


async def scenario_http_fuzz(chaos, row, tools) -> None:
    url = getattr(chaos, "http_url", "")
    if not url:
        raise RuntimeError("the router serves no HTTP API (http_port unset)")
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    s = chaos.s
    fz = HttpFuzzer(random.Random(f"{s.seed}-{s.transport}-http-fuzz"))
    n = getattr(s, "http_fuzz_requests", 300)
    cases = [fz.case() for _ in range(n)]
    sem = asyncio.Semaphore(min(8, s.concurrency))
    kinds: dict = {}

    async def one(case: dict) -> None:
        kinds[case["kind"]] = kinds.get(case["kind"], 0) + 1
        async with sem:
            status, raw, rtype, err = await asyncio.to_thread(send, host, port, case["method"], case["path"],
                                                              case["data"], case["ctype"])
        if status == 0:
            kind, why = ("hang" if err == "timeout" else "bad"), f"no answer: {err}"
        elif status == 200:
            route = case["path"].split("?", 1)[0]  # a query string leaves the route as it is
            if case["method"] != "POST" or route not in ("/v1/completions", "/v1/chat/completions"):
                kind, why = "wrong", f"200 for {case['method']} {case['path'][:60]}"
            else:
                why = check_answer(raw, rtype, route == "/v1/chat/completions")
                kind = "bad" if why else "ok"
        else:
            kind, why = check_error(status, raw, case["body"])
        _count(row, kind, status, case, why, tools)

    await asyncio.gather(*(one(c) for c in cases))
    row.extra["kinds"] = dict(sorted(kinds.items()))
    # the server still serves, and answers a normal request
    body = json.dumps({"prompt": "Hello", "max_tokens": 3}).encode()
    status, raw, rtype, err = await asyncio.to_thread(send, host, port, "POST", "/v1/completions", body,
                                                      "application/json")
    after = {"method": "POST", "path": "/v1/completions", "ctype": "application/json", "kind": "after the fuzz",
             "data": body, "body": {"prompt": "Hello", "max_tokens": 3}, "chat": False}
    why = check_answer(raw, rtype, False) if status == 200 else f"status {status} {err} {raw[:200]!r}"
    _count(row, "ok" if status == 200 and not why else "wrong", status, after, why, tools)
    row.extra["served_after"] = status == 200 and not why


# ---- disconnect ---------------------------------------------------------------------------------
class GrpcLeaver:
    def __init__(self, chaos, payload: bytes, i: int, tools) -> None:
        from proto.pdcluster.v1 import inference_pb2 as pb

        self.call = chaos.chan(i).unary_stream(tools.GENERATE, request_serializer=None,
                                               response_deserializer=pb.GenerateResponse.FromString)(
            payload, timeout=120)
        self.tokens = 0
        self.finished = False
        self.task = asyncio.ensure_future(self._read())
        self.progress = asyncio.Event()

    async def _read(self) -> None:
        try:
            async for chunk in self.call:
                self.tokens += len(chunk.token_ids)
                self.progress.set()
                if chunk.finish_reason:
                    self.finished = True
        except Exception:
            pass
        self.progress.set()

    async def wait_tokens(self, n: int, bound_s: float = 60) -> bool:
        deadline = time.monotonic() + bound_s
        while self.tokens < n and not self.task.done() and time.monotonic() < deadline:
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        return self.tokens >= n

    async def leave(self) -> None:
        self.call.cancel()
        await asyncio.wait([self.task], timeout=5)


class HttpLeaver:
    """A raw HTTP/1.1 client: sends the request, may read some events, then closes the socket."""

    def __init__(self, host: str, port: int, ids: list[int], max_tokens: int, stream: bool) -> None:
        self.body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                "stream": stream}).encode()
        self.host, self.port, self.stream = host, port, stream
        self.tokens = 0
        self.finished = False
        self.buf = b""

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body)
        await self.writer.drain()

    async def wait_tokens(self, n: int, bound_s: float = 60) -> bool:
        deadline = time.monotonic() + bound_s
        while self.buf.count(b"data: {") < n and time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), 1.0)
            except asyncio.TimeoutError:
                continue
            if not data:
                break
            self.buf += data
            if b"[DONE]" in self.buf or (not self.stream and b"finish_reason" in self.buf):
                self.finished = True
        self.tokens = self.buf.count(b"data: {")
        return self.tokens >= n

    async def leave(self) -> None:
        if not self.stream:
            try:  # an answer already here means it finished before the leave
                data = await asyncio.wait_for(self.reader.read(65536), 0.001)
                self.finished = self.finished or b"finish_reason" in data
            except (asyncio.TimeoutError, OSError):
                pass
        self.writer.close()


async def scenario_disconnect(chaos, row, tools) -> None:
    from proto.pdcluster.v1 import inference_pb2 as pb

    url = getattr(chaos, "http_url", "")
    if not url:
        raise RuntimeError("the router serves no HTTP API (http_port unset)")
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    s, f = chaos.s, chaos.fuzzer
    rng = random.Random(f"{s.seed}-{s.transport}-disconnect")
    mml = f.mml
    reps = max(1, getattr(s, "disconnect_reps", 2))
    times: dict = {"slot": {}, "pages": {}}
    counter = [0]

    def payload(ids: list[int], mt: int) -> bytes:
        return pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
            max_tokens=mt, temperature=0, ignore_eos=True)).SerializeToString()

    async def open_client(door: str, ids: list[int], mt: int):
        counter[0] += 1
        if door == "grpc":
            return GrpcLeaver(chaos, payload(ids, mt), counter[0], tools)
        c = HttpLeaver(host, port, ids, mt, door == "http-stream")
        await c.start()
        return c

    async def counts() -> tuple[int, int]:
        st = await chaos.status()
        return st.inflight_requests, st.queued_requests

    async def idle() -> bool:
        st = await chaos.status()
        return not tools._busy(st) and all(w.free_pages == w.total_pages for w in st.workers)

    async def time_until(pred, bound_s: float) -> float | None:
        t0 = time.monotonic()
        ok = await tools._until_async(pred, bound_s, 0.005)
        return time.monotonic() - t0 if ok else None

    def record(stage: str, door: str, slot_s: float | None, pages_s: float | None, finished: bool,
               what: str) -> None:
        row.tried += 1
        key = f"{stage}/{door}"
        times["slot"].setdefault(key, []).append(None if slot_s is None else round(slot_s, 3))
        times["pages"].setdefault(key, []).append(None if pages_s is None else round(pages_s, 3))
        if finished:
            row.notes.append(f"{key}: the request finished before its client left ({what})")
        late = slot_s is None or slot_s > SLOT_BOUND_S or pages_s is None or pages_s > PAGES_BOUND_S
        row.codes[key] = row.codes.get(key, 0) + 1
        if late:
            row.hangs += 1
            row.problems.append({"kind": "hang", "why": f"after the client left ({what}): slot freed in "
                                 f"{slot_s} s (bound {SLOT_BOUND_S}), pages in {pages_s} s (bound {PAGES_BOUND_S})",
                                 "code": key, "details": "", "expected": {"freed": []}, "oracle": "disconnect",
                                 "chunks": 0, "elapsed_s": 0.0, "request": {"stage": stage, "door": door}})
        else:
            row.ok += 1

    # (a) queued: max_inflight long streams hold every slot, one more is queued and leaves
    hold_len = 8
    holders = [GrpcLeaver(chaos, payload(f.ids(hold_len), mml - hold_len), 1000 + i, tools)
               for i in range(s.max_inflight)]
    try:
        full = await tools._until_async(lambda: _eq(counts, (s.max_inflight, 0)), 30)
        if not full:
            row.notes.append(f"queued: the {s.max_inflight} holders never filled max_inflight: {await counts()}")
        for door in DOORS:
            for _ in range(reps):
                if any(h.task.done() for h in holders):
                    row.notes.append("queued: a holder ended before the queued clients were done (too short)")
                    break
                c = await open_client(door, f.ids(16), 16)
                queued = await tools._until_async(lambda: _queued(counts), 10, 0.005)
                if not queued:
                    row.notes.append(f"queued/{door}: the request was never queued: {await counts()}")
                await c.leave()
                slot = await time_until(lambda: _queued0(counts), 15)
                still = not any(h.task.done() for h in holders)
                # a queued request holds no page: its "pages freed" time is its slot's
                record("queued", door, slot, slot, c.finished,
                       "queued" + ("" if still else "; a holder had ended meanwhile"))
    finally:
        for h in holders:
            await h.leave()
    t_left = time.monotonic()
    slot = await time_until(lambda: _eq(counts, (0, 0)), 15)
    pages = await tools._until_async(idle, 15, 0.005)
    pages_s = time.monotonic() - t_left if pages else None
    record("running", f"grpc x{s.max_inflight}", slot, pages_s, any(h.finished for h in holders),
           f"{s.max_inflight} long streams left at once")

    # (b) prefilling, (c) transferring (the first token), (d) decoding (k tokens)
    for stage in ("prefilling", "transferring", "decoding"):
        for door in DOORS:
            for _ in range(reps):
                plen = mml - 40 if stage != "decoding" else rng.randint(8, 64)
                mt = mml - plen
                c = await open_client(door, f.ids(plen), mt)
                what = stage
                if stage == "prefilling":
                    await tools._until_async(lambda: _inflight(counts), 10, 0.002)
                elif door == "http":  # nothing to read before the end: leave a moment in
                    await asyncio.sleep(0.05 if stage == "transferring" else 0.3)
                    what += " (not streamed: left 50 ms / 300 ms in)"
                else:
                    k = 1 if stage == "transferring" else rng.randint(3, 12)
                    await c.wait_tokens(k)
                    what += f" (after {c.tokens} tokens)"
                await c.leave()
                t0 = time.monotonic()
                slot = await time_until(lambda: _eq(counts, (0, 0)), 15)
                ok = await tools._until_async(idle, 15, 0.005)
                record(stage, door, slot, time.monotonic() - t0 if ok else None, c.finished, what)

    row.extra["slot_freed_s"] = times["slot"]
    row.extra["pages_freed_s"] = times["pages"]
    flat = lambda d: [x for v in d.values() for x in v if x is not None]  # noqa: E731
    row.extra["slot_freed_max_s"] = max(flat(times["slot"]), default=None)
    row.extra["pages_freed_max_s"] = max(flat(times["pages"]), default=None)
    row.notes.append(f"slots freed within {row.extra['slot_freed_max_s']} s (max) of a leave, every page within "
                     f"{row.extra['pages_freed_max_s']} s (max); bounds {SLOT_BOUND_S} / {PAGES_BOUND_S} s")
    per_stage = {}
    for key in times["slot"]:
        stage = key.split("/", 1)[0]
        sl = [x for x in times["slot"][key] if x is not None]
        pg = [x for x in times["pages"][key] if x is not None]
        old_sl, old_pg = per_stage.get(stage, (0.0, 0.0))
        per_stage[stage] = (max([old_sl, *sl]), max([old_pg, *pg]))
    row.notes.append("max slot / pages freed per stage (s): " + ", ".join(
        f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in per_stage.items()))
    # then a normal request works
    status, raw, rtype, err = await asyncio.to_thread(send, host, port, "POST", "/v1/completions", json.dumps(
        {"prompt": "Hello", "max_tokens": 3}).encode(), "application/json")
    row.tried += 1
    if status == 200 and not check_answer(raw, rtype, False):
        row.ok += 1
    else:
        row.wrong_codes += 1
        row.notes.append(f"a normal request after the leaves: {status} {err} {raw[:200]!r}")


async def _eq(counts, want: tuple[int, int]) -> bool:
    return await counts() == want


async def _queued(counts) -> bool:
    return (await counts())[1] >= 1


async def _queued0(counts) -> bool:
    return (await counts())[1] == 0


async def _inflight(counts) -> bool:
    inflight, queued = await counts()
    return inflight + queued >= 1
