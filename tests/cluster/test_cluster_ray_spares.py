"""Hot spares on a real local Ray: a decode pool of 1 replica + 1 spare. The spare is loaded and
warmed up but not placed on (`spare`); kill -9 of the serving decode worker mid-stream promotes
the spare at once (within 2 s + slack of the kill, not the 15+ s a restart takes), the open
streams continue on it with exactly the tokens of an uninterrupted run, and the killed worker,
restarted by Ray and warmed up, becomes the pool's spare. Every page comes back.

Before the change the pool started 1 worker (spare_replicas was ignored) and the streams waited
for Ray to restart it."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from tests.helpers import collect, our_ray_processes, stub, wait_free, wait_until

S = pb.SamplingParams
TAKEOVER_S = 2.0
SLACK_S = 2.0  # a shared 2-core machine
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, page_size=16)


def worker(st, wid):
    return next(w for w in st.workers if w.worker_id == wid)


@pytest.mark.slow  # a cluster of its own (about 65 s): `make test-slow`
def test_a_spare_takes_over_a_killed_decode_worker(tiny_model):
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    tiny_model("llama")
    cfg = ClusterConfig.embedded(model="tiny", port=0, engine=ENGINE, prefill=1, decode=1)
    next(p for p in cfg.pools if p.role == "decode").spare_replicas = 1
    c = Cluster(cfg)
    c.start()
    try:
        s = stub(c)

        def status():
            return s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)

        st = status()
        assert (worker(st, "decode-0").state, worker(st, "decode-1").state) == ("serving", "spare"), st
        assert not worker(st, "decode-1").healthy
        reqs = [pb.GenerateRequest(prompt_token_ids=list(range(1 + i, 40 + i)),
                                   sampling=S(max_tokens=900, temperature=0, ignore_eos=True)) for i in range(3)]
        refs = [collect(s, r)[0] for r in reqs]
        assert worker(status(), "decode-1").requests_placed == 0  # a spare takes nothing
        calls = [s.Generate(r, timeout=120) for r in reqs]
        heads = [list(next(call).token_ids) + list(next(call).token_ids) for call in calls]
        pid = worker(status(), "decode-0").pid
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def finish(i):
            msgs = list(calls[i])
            return heads[i] + [t for m in msgs for t in m.token_ids], msgs[-1]

        with ThreadPoolExecutor(len(calls)) as pool:
            took_over = wait_until(lambda: worker(status(), "decode-1").state == "serving" and time.monotonic(),
                                   30, 0.02, "the spare serving")
            results = list(pool.map(finish, range(len(calls))))
        takeover_s = took_over - killed
        print(f"\nkill -9 decode-0 -> spare decode-1 serving in {takeover_s:.2f} s")
        assert takeover_s <= TAKEOVER_S + SLACK_S
        for (ids, last), ref in zip(results, refs):
            assert ids == ref, "a migrated stream lost, repeated or changed tokens"
            assert last.placement.migrations == 1 and last.placement.decode_worker == "decode-1"

        def restarted_as_spare():
            w = worker(status(), "decode-0")
            return w.state == "spare" and w.restarts == 1 and w.pid not in (0, pid)

        wait_until(restarted_as_spare, 90, 0.1, "decode-0 restarted, warmed up, a spare")
        st = wait_free(s)
        assert all(w.free_pages == w.total_pages for w in st.workers), st
        ids, _, last = collect(s, reqs[0])
        assert ids == refs[0] and last.placement.decode_worker == "decode-1"
    finally:
        c.stop()
    assert not our_ray_processes()
