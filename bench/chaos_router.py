"""The chaos suite's `kill-router` scenario (bench/chaos.py runs it): kill -9 of the router's
process while greedy streams run through it.

What a client may see: each open stream ends with UNAVAILABLE, after a prefix of the tokens an
uninterrupted run gives (never a wrong token; a stream that finished before the kill is judged
like any other). Ray restarts the router actor and the cluster's supervisor starts it again on
the same port: the time to recover runs from the kill to grpc.health SERVING on that address
again. The new router cancels what its predecessor had running on the workers (counted), so the
suite's idle check after the scenario finds every page free; the same greedy request through
the new router gives the reference tokens.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

ROUTER_ACTOR = "pdcluster-router-0"


async def kill_router(chaos: Any, row: Any, suite: Any) -> None:
    """`chaos`: the suite's `Chaos` (its cluster's router 0 at chaos.address); `row`: this
    scenario's `Row`; `suite`: the bench.chaos module (its helpers)."""
    _cmdline, _problem, _until = suite._cmdline, suite._problem, suite._until
    describe, generate_call = suite.describe, suite.generate_call

    f, s = chaos.fuzzer, chaos.s
    reqs = []
    for _ in range(4):
        plen = chaos.rng.randint(16, 48)
        reqs.append(chaos.greedy(f.ids(plen), min(s.stream_tokens, f.mml - plen)))
    refs = await chaos.references(row, reqs)
    outs = [suite.Outcome() for _ in reqs]
    tasks = [asyncio.ensure_future(generate_call(chaos.chan(i), r.SerializeToString(), s.call_timeout_s, out=o))
             for i, (r, o) in enumerate(zip(reqs, outs))]
    await _until(lambda: all(len(o.chunks) >= 2 or o.done for o in outs), 120)
    if any(o.done for o in outs):
        row.notes.append(f"{sum(o.done for o in outs)} streams ended before the kill (too few --stream-tokens?)")
    st = await chaos.status()
    row.extra["running_on_workers_at_kill"] = sum(w.running_requests for w in st.workers)

    actor, pid = await _router_pid()
    cmd = _cmdline(pid)
    if "ray" not in cmd and "RouterActor" not in cmd:
        raise RuntimeError(f"pid {pid} of the router is not a Ray worker process: {cmd[:80]!r}")
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    row.killed += 1
    chaos.log(f"chaos [{s.transport}]: killed the router (pid {pid})")
    await asyncio.gather(*tasks)

    back = await _serving_again(chaos.address, t_kill, s.recover_bound_s)
    if back is None:
        row.notes.append(f"the router was not SERVING on {chaos.address} within {s.recover_bound_s:g} s of its kill")
    else:
        row.replaced += 1
        row.recover_s_max = round(back, 2)
        row.extra["recover_s"] = [round(back, 2)]
        info = await actor.info.remote()
        row.extra["predecessor_requests_cancelled"] = info["retired"]
        if info["pid"] == pid:
            row.notes.append("the router answered with the killed pid")

    verdicts: dict[str, int] = {}
    for req, out, ref in zip(reqs, outs, refs):
        exp = f.oracle(req, req.ByteSize())
        exp.why = "a greedy stream through the router while its process was killed"
        exp.codes["UNAVAILABLE"] = ()
        kind = chaos.judge(row, exp, out, describe(req) | {"note": "stream through the killed router"})
        if ref is not None and kind in ("ok", "clean") and out.token_ids != ref[:len(out.token_ids)]:
            row.bad_responses += 1
            row.ok -= kind == "ok"
            row.clean_errors -= kind == "clean"
            _problem(row, "bad", out, exp, describe(req), "a token differs from the uninterrupted run's")
            kind = "wrong token"
        verdict = "completed" if kind == "ok" else f"ended {out.code}" if kind == "clean" else kind
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    row.extra["streams"] = verdicts
    row.extra["tokens_before_kill"] = [len(o.token_ids) for o in outs]

    await _reconnect(chaos)  # the suite's channels saw the router go: fresh ones, not their reconnect backoff
    if back is not None and refs[0] is not None:
        [again] = await chaos.run_all([reqs[0].SerializeToString()])
        exp = f.oracle(reqs[0], reqs[0].ByteSize())
        exp.why = "the same greedy request through the router that came back"
        kind = chaos.judge(row, exp, again, describe(reqs[0]) | {"note": "after the router's return"})
        same = kind == "ok" and again.token_ids == refs[0]
        row.extra["after_recovery_identical"] = same
        if kind == "ok" and not same:
            row.bad_responses += 1
            row.ok -= 1
            _problem(row, "bad", again, exp, describe(reqs[0]), "after recovery: tokens differ from the reference")


async def _router_pid() -> tuple[Any, int]:
    """Router 0's actor handle and its process id (asked of the actor through Ray)."""
    import ray

    actor = ray.get_actor(ROUTER_ACTOR)
    return actor, await actor.pid.remote()


async def _serving_again(address: str, t_kill: float, bound_s: float) -> float | None:
    """Seconds from the kill to grpc.health SERVING on `address` (a fresh channel per try), or None."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    while time.monotonic() - t_kill < bound_s:
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t_kill
            except grpc.aio.AioRpcError:
                pass
        await asyncio.sleep(0.05)
    return None


async def _reconnect(chaos: Any) -> None:
    import grpc

    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    old = chaos.channels
    chaos.channels = [grpc.aio.insecure_channel(chaos.address) for _ in range(len(old))]
    chaos.channel = chaos.channels[0]
    chaos.stub = pb_grpc.InferenceStub(chaos.channel)
    for ch in old:
        await ch.close()
