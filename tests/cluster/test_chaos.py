"""The chaos suite's short version (bench/chaos.py; `pdcluster bench chaos` runs the full one, see
docs/reliability.md). A real local Ray cluster of the tiny model, one prefill and two decode
workers over NIXL, and:

- 150 Generate requests with random valid, boundary, invalid and extreme values over every field
  (strings that are not UTF-8, huge prompts, duplicate request ids), each judged by docs/api.md;
- a cancel storm: streams cancelled before their first token or mid-stream, deadlines expiring;
- more concurrent requests than admission takes: RESOURCE_EXHAUSTED for the surplus;
- client processes flooding the router with oversized requests while ModelInfo is timed (the
  latency is reported, not asserted);
- kill -9 of a decode worker mid-stream, with short requests arriving meanwhile.

Asserted: no wrong status code (never UNKNOWN or INTERNAL, never OK for an invalid request, the
message names the field), no malformed stream, no hang, no stream lost without a status, nothing
left in flight, every page free on every worker after each scenario, the killed worker replaced,
and every greedy stream on it completed with the same tokens as an uninterrupted run (stream
migration).

The fuzz's judge (its oracle, docs/api.md's rules written down independently of the router) is
first held to the router's own validation, in process: if the two disagreed, the cluster test
would report the oracle's mistakes as the router's."""
from __future__ import annotations

import random

from bench.chaos import ChaosSettings, Fuzzer, format_notes, format_table, run_transport
from proto.pdcluster.v1 import inference_pb2 as pb
from tests.helpers import our_ray_processes

SCENARIOS = ("fuzz", "cancel", "overflow", "flood", "kill-decode-stream")


def test_chaos_short(tiny_model):
    tiny_model("llama")  # built once in this process; the actors find it in PDCLUSTER_CACHE
    s = ChaosSettings(model="tiny", transport="nixl", prefill=1, decode=2, scenarios=SCENARIOS, fuzz_requests=150,
                      cancel_streams=24, overflow_factor=2, flood_clients=2, flood_s=2.0, baseline_s=1.0,
                      stream_tokens=400, seed=0)
    rows = run_transport(s)
    report = format_table(rows) + "\n" + format_notes(rows)
    print("\n" + report)
    assert [r.scenario for r in rows] == list(SCENARIOS), report
    for r in rows:
        assert not r.crashed, report
        assert (r.wrong_codes, r.bad_responses, r.hangs, r.lost) == (0, 0, 0, 0), report
        assert (r.stuck_requests, r.leaked_pages) == (0, 0), report
    fuzz, cancel, overflow, flood, kill = rows
    assert fuzz.tried == 150 and fuzz.ok and fuzz.clean_errors, report
    assert cancel.codes.get("CANCELLED") and cancel.codes.get("DEADLINE_EXCEEDED"), report
    assert overflow.extra["refused"] and overflow.extra["completed"], report
    assert flood.tried and flood.codes.get("RESOURCE_EXHAUSTED"), report
    assert kill.killed == 1 and kill.replaced == 1 and kill.greedy_total >= 1, report
    assert kill.extra["after_recovery_identical"], report
    # stream migration (router/dispatch.py): every greedy stream on the killed worker completed
    # elsewhere (or on its replacement) with the tokens of an uninterrupted run
    assert kill.greedy_identical == kill.greedy_total, report
    assert not our_ray_processes(), "Ray processes left after stop"


def test_the_fuzz_oracle_agrees_with_the_router_validation(tiny_model):
    from router.frontend import Frontend, RequestError
    from router.wire import BadRequest, safe_deserializer

    fe = Frontend.from_model(tiny_model("llama"), hash_page_size=16, max_model_len=256)
    info = pb.ModelInfoResponse(vocab_size=fe.vocab_size, max_model_len=fe.max_model_len, eos_token_ids=[0],
                                has_chat_template=fe.has_chat_template)
    decodes = ["decode-0", "decode-1"]
    fuzzer = Fuzzer(random.Random(7), info, fe.tokenizer, decodes, ["prefill-0"], fe.limits)
    parse = safe_deserializer(pb.GenerateRequest)
    seen = set()
    for _ in range(600):
        case = fuzzer.case()
        exp = case.expect
        if len(case.payload) > fuzzer.max_bytes:  # gRPC refuses it before the router sees it
            assert set(exp.codes) == {"RESOURCE_EXHAUSTED"}, case.desc
            seen.add("RESOURCE_EXHAUSTED")
            continue
        req, prepared = parse(case.payload), None
        if isinstance(req, BadRequest):
            code, message = "INVALID_ARGUMENT", req.reason
        else:
            try:
                prepared = fe.prepare(req)
                code, message = "OK", ""
            except RequestError as exc:
                code, message = exc.code.name, str(exc)
            if code == "OK" and req.decode_worker and req.decode_worker not in decodes:  # the dispatcher's check
                code, message = "INVALID_ARGUMENT", f"decode_worker must be empty or one of {decodes}"
        seen.add(code)
        assert code in exp.codes, (code, message, exp, case.desc)
        words = exp.codes[code]
        assert not words or any(w in message for w in words), (message, exp, case.desc)
        if prepared is not None and code == "OK":
            assert (exp.prompt_len, exp.max_tokens) == (len(prepared.prompt_token_ids), prepared.params.max_tokens)
    assert {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"} <= seen, seen
