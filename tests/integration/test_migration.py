"""A stream whose decode worker is lost continues on another decode worker: no token lost or
repeated, greedy and seeded output identical to an uninterrupted run, the text too. Real
in-process prefill and decode workers (tiny llama with its tokenizer, local KV transfer) behind
the real gRPC router; the fault is a decode worker's engine loop dying mid-stream (what a
worker process's death looks like to the router: its output stream fails). The Ray suite
kills real worker processes (tests/cluster/test_cluster_ray_worker_loss.py, the chaos suite)."""
from __future__ import annotations

import time

import grpc
import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, LoopKiller, close, collect, local_trio, stub, wait_until

S = pb.SamplingParams
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


class Faults:
    """Decode workers whose steps take at least `step_s` (a slow decode, so a stream is
    mid-way when the test acts) and whose loop dies at its next step once `kill(worker)`."""

    def __init__(self, workers, step_s: float = 0.01) -> None:
        self.doomed: set[int] = set()
        for w in workers:
            step = w.step

            def slow_step(w=w, step=step):
                if id(w) in self.doomed:
                    raise LoopKiller(f"injected into {w}")
                time.sleep(step_s)
                return step()

            w.step = slow_step

    def kill(self, worker) -> None:
        self.doomed.add(id(worker))


@pytest.fixture
def cluster(tiny_model, request):
    """1 prefill + 2 decode workers; request.param: router keyword arguments."""
    model = tiny_model("llama")
    (prefill, decode0, decode1), (ph, dh0, dh1) = local_trio(model)
    loop = Loop()
    server = build_router(model, [ph], [dh0, dh1], max_model_len=256, **getattr(request, "param", {}))
    loop.run(server.start())
    yield server, prefill, {"decode-0": decode0, "decode-1": decode1}
    loop.run(server.stop(1.0))
    close(ph, dh0, dh1)
    loop.close()


def stream_killing_after(server, workers, faults, req, after_tokens):
    """Run `req`, killing the decode worker that holds it once `after_tokens` tokens arrived;
    returns (ids, text, final message, the killed worker's id)."""
    ids, text, final, killed = [], "", None, None
    for msg in stub(server).Generate(req, timeout=60):
        ids += msg.token_ids
        text += msg.text
        if msg.finish_reason:
            final = msg
        if killed is None and len(ids) >= after_tokens:
            killed = next(w for w, d in workers.items() if any(r.startswith(req.request_id) for r in d._stages))
            faults.kill(workers[killed])
    return ids, text, final, killed


@pytest.mark.parametrize("sampling", [
    dict(temperature=0),
    dict(temperature=0.9, top_p=0.95, seed=7),
    dict(temperature=1.0),  # unseeded: the router fixes a seed, so the continuation draws the same tokens
], ids=["greedy", "seeded", "unseeded"])
def test_a_stream_survives_its_decode_worker(cluster, sampling):
    server, prefill, workers = cluster
    params = S(max_tokens=60, ignore_eos=True, **sampling)
    # the uninterrupted run, from both decode workers (they must agree: it is what migration resumes)
    faults = Faults(workers.values())
    ref = [collect(stub(server), pb.GenerateRequest(prompt=PROMPT, sampling=params, decode_worker=w)) for w in workers]
    if "seed" in sampling or sampling["temperature"] == 0:
        assert ref[0][0] == ref[1][0]
        assert ref[0][1] == ref[1][1]
    ids, text, final, killed = stream_killing_after(
        server, workers, faults, pb.GenerateRequest(request_id="mig", prompt=PROMPT, sampling=params), 12)
    assert final.placement.migrations == 1
    assert final.placement.decode_worker != killed
    assert len(ids) == 60 and final.usage.completion_tokens == 60
    if "seed" in sampling or sampling["temperature"] == 0:
        assert ids == ref[0][0]  # no token lost, repeated or different
        assert text == ref[0][1]
    survivor = workers[final.placement.decode_worker]
    wait_until(lambda: survivor.core.num_free_pages == survivor.core.num_pages, 10, 0.01, "survivor's pages back")
    wait_until(lambda: prefill.core.num_free_pages == prefill.core.num_pages, 10, 0.01, "prefill's pages back")


def test_a_stop_string_spanning_the_migration_still_stops(cluster):
    """The resumed worker replays the tokens the client has through its detokenizer, so a stop
    string whose first characters came from the lost worker still ends the stream there."""
    server, _, workers = cluster
    faults = Faults(workers.values())
    params = S(max_tokens=60, temperature=0, ignore_eos=True)
    ref_ids, ref_text, _ = collect(stub(server), pb.GenerateRequest(prompt=PROMPT, sampling=params))
    # a stop string from the middle of the reference text: it starts before the kill, ends after
    cut = len(ref_text) // 2
    stop = ref_text[cut:cut + 6]
    assert stop.strip() and ref_text.find(stop) == cut
    params.stop.append(stop)
    ids, text, final, _ = stream_killing_after(
        server, workers, faults, pb.GenerateRequest(request_id="stop", prompt=PROMPT, sampling=params), 3)
    assert final.placement.migrations == 1
    assert text == ref_text[:cut] and final.finish_reason == "stop"


@pytest.mark.parametrize("cluster", [dict(migration_limit=0)], indirect=True)
def test_past_the_migration_limit_the_request_ends_naming_the_lost_worker(cluster):
    server, _, workers = cluster
    faults = Faults(workers.values())
    with pytest.raises(grpc.RpcError) as err:
        stream_killing_after(server, workers, faults, pb.GenerateRequest(
            request_id="lim", prompt=PROMPT, sampling=S(max_tokens=60, temperature=0, ignore_eos=True)), 5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "migration_limit=0" in err.value.details() and "decode-" in err.value.details()
