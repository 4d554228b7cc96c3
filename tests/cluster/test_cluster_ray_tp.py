"""One Ray worker is one tensor-parallel group (cluster/tp_group.py), on a real local Ray
(loopback): a colocated pool of tensor_parallel_size 2 serves greedy streams equal to a TP=1
engine's; ClusterStatus shows the worker's TP size, its ranks' pids and nodes, and its threads.
A follower rank killed mid-stream (kill -9) loses the whole worker: its streams migrate (they
finish with the same tokens), Ray restarts the worker with a new group (new pids in every rank)
and no follower process is left over; the leader killed the same way takes its follower with it.
Disaggregated (slow suite): prefill TP 2 -> decode TP 2 over nixl and grpc, the decode group's
follower killed mid-stream, streams finish with the same tokens and every page comes back."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from cluster import status
from cluster.ray_start import children_matching
from cluster.config import ClusterConfig
from engine.sampling_params import SamplingParams
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import collect, our_ray_processes, wait_until

S = pb.SamplingParams
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, page_size=16,
              tensor_parallel_size=2)


def follower_processes() -> list[int]:
    """This test's Ray processes hosting a tensor-parallel follower actor (ps: ray::FollowerActor)."""
    return sorted(children_matching(("FollowerActor",)))


def listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (ss -ltnp)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_tp_cluster():
    from cluster.runtime import Cluster

    cfg = ClusterConfig.model_validate(dict(
        model="tiny", router=dict(port=0, policy="round-robin"),
        pools=[dict(name="tp", role="colocated", replicas=1, engine=ENGINE, resources=dict(num_cpus=1))]))
    cluster = Cluster(cfg)
    cluster.start()
    return cluster, pb_grpc.InferenceStub(grpc.insecure_channel(cluster.router_address))


def tp1_greedy(model_dir, make_llm, prompt, max_tokens):
    return make_llm(model_dir, page_size=16, num_pages=512).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def replaced(s, old: set[int], restarts: int):
    """The one worker serving again from a new group: no rank's process is one of `old`."""
    def check():
        (x,) = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers
        return x if (x.state == "serving" and x.healthy and x.restarts == restarts and len(x.rank_pids) == 2
                     and not old & set(x.rank_pids)) else None
    return check


def test_a_tp2_worker_serves_and_a_killed_follower_replaces_the_whole_group(tiny_model, make_llm, capsys):
    """The default run's test of TP workers on Ray (about a minute on 2 cores)."""
    prompt = list(range(1, 40))
    want = tp1_greedy(tiny_model("llama"), make_llm, prompt, 300)
    cluster, s = start_tp_cluster()
    try:
        (w,) = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers
        assert (w.tp_size, w.num_threads, len(w.rank_pids), list(w.rank_nodes)) == (2, 1, 2, ["127.0.0.1"] * 2), w
        leader, follower = w.rank_pids
        assert leader == w.pid and follower != leader and follower_processes() == [follower]
        # the group's store (pre-bound by engine/tp_worker.connect_store: torch's TCPStore alone would
        # listen on every interface), gloo and Ray's own sockets: loopback only
        def wild(pid):
            return [a for a in listening({pid}) if not a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:"))]
        assert listening({follower}) and wild(follower) == [], listening({follower})
        assert listening({leader}) and wild(leader) == [], listening({leader})
        status_cli = argparse.ArgumentParser()
        status.add_arguments(status_cli)
        assert status.run(status_cli.parse_args(["--address", cluster.router_address])) == 0
        out = capsys.readouterr().out
        assert f"tp-0: rank 0 pid {leader} on 127.0.0.1, rank 1 pid {follower} on 127.0.0.1" in out, out

        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=300, temperature=0, ignore_eos=True))
        calls = [s.Generate(req, timeout=180) for _ in range(2)]
        heads = [list(next(c).token_ids) + list(next(c).token_ids) for c in calls]  # the streams are open
        os.kill(follower, signal.SIGKILL)  # kill -9 the follower rank mid-stream
        killed = time.monotonic()
        for call, head in zip(calls, heads):  # the calls' timeout is the hang guard
            msgs = list(call)
            assert head + [t for m in msgs for t in m.token_ids] == want, "TP=2 tokens differ from TP=1's"
            assert msgs[-1].placement.migrations == 1, msgs[-1].placement

        w = wait_until(replaced(s, {leader, follower}, 1), 120, 0.2, "the TP worker replaced as a whole")
        print(f"\nfollower killed -> group serving again in {time.monotonic() - killed:.1f} s: {list(w.rank_pids)}")
        assert not alive(leader) and not alive(follower)
        assert follower_processes() == [w.rank_pids[1]], "a follower process of the old group is left over"
        got, _, last = collect(s, req)
        assert got == want and last.placement.migrations == 0
    finally:
        cluster.stop()
    assert not our_ray_processes() and not follower_processes()


@pytest.mark.slow
def test_a_killed_leader_takes_its_followers_with_it_and_an_idle_loss_is_found_too(tiny_model, make_llm):
    prompt = list(range(3, 30))
    want = tp1_greedy(tiny_model("llama"), make_llm, prompt, 200)
    cluster, s = start_tp_cluster()
    try:
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=200, temperature=0, ignore_eos=True))
        (w,) = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers
        leader, follower = w.rank_pids
        call = s.Generate(req, timeout=180)
        head = list(next(call).token_ids) + list(next(call).token_ids)
        os.kill(leader, signal.SIGKILL)
        msgs = list(call)
        assert head + [t for m in msgs for t in m.token_ids] == want and msgs[-1].placement.migrations == 1
        w = wait_until(replaced(s, {leader, follower}, 1), 120, 0.2, "the TP worker replaced after its leader's loss")
        wait_until(lambda: not alive(follower), 30, 0.1, "the lost leader's follower gone")
        assert follower_processes() == [w.rank_pids[1]], "a follower process of the old group is left over"
        got, _, _ = collect(s, req)
        assert got == want

        # a follower lost while the worker is idle: its watcher ends the group, no request needed
        leader, follower = w.rank_pids
        os.kill(follower, signal.SIGKILL)
        wait_until(lambda: not alive(leader), 30, 0.1, "the idle leader ending itself after its follower's loss")
        w = wait_until(replaced(s, {leader, follower}, 2), 120, 0.2, "the TP worker replaced after an idle loss")
        assert follower_processes() == [w.rank_pids[1]]
        got, _, _ = collect(s, req)
        assert got == want
    finally:
        cluster.stop()
    assert not our_ray_processes() and not follower_processes()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_prefill_tp2_decode_tp2_serve_and_a_killed_decode_follower_loses_nothing(transport, tiny_model, make_llm):
    """A disaggregated cluster of TP groups on Ray: prefill TP 2 -> decode TP 2 (each decode rank
    takes its KV head from the prefill rank holding it). Greedy streams equal a TP=1 engine's;
    kill -9 of the decode group's follower mid-stream: the streams migrate (re-prefilled onto the
    replaced group) and finish with the same tokens, and every page comes back."""
    from cluster.runtime import Cluster

    prompt = list(range(5, 50))
    want = tp1_greedy(tiny_model("llama"), make_llm, prompt, 300)
    cfg = ClusterConfig.model_validate(dict(
        model="tiny", router=dict(port=0, policy="round-robin"), transport=dict(kind=transport),
        pools=[dict(name="prefill", role="prefill", replicas=1, engine=ENGINE, resources=dict(num_cpus=0.5)),
               dict(name="decode", role="decode", replicas=1, engine=ENGINE, resources=dict(num_cpus=0.5))]))
    cluster = Cluster(cfg)
    cluster.start()
    s = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.router_address))
    try:
        workers = {w.role: w for w in s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers}
        assert workers["prefill"].tp_size == workers["decode"].tp_size == 2
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=300, temperature=0, ignore_eos=True))
        got, _, last = collect(s, req)
        assert got == want and last.placement.prefill_worker  # prefilled by the prefill group
        leader, follower = workers["decode"].rank_pids
        calls = [s.Generate(req, timeout=180) for _ in range(2)]
        heads = [list(next(c).token_ids) + list(next(c).token_ids) for c in calls]  # the streams are open
        os.kill(follower, signal.SIGKILL)
        for call, head in zip(calls, heads):
            msgs = list(call)
            assert head + [t for m in msgs for t in m.token_ids] == want, "tokens differ after the decode rank's loss"
            assert msgs[-1].placement.migrations == 1, msgs[-1].placement

        def decode_back():
            ws = {w.role: w for w in s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers}
            d = ws["decode"]
            return d if (d.state == "serving" and d.healthy and len(d.rank_pids) == 2
                         and not {leader, follower} & set(d.rank_pids)) else None
        wait_until(decode_back, 120, 0.2, "the decode group replaced as a whole")
        got, _, _ = collect(s, req)
        assert got == want
        wait_until(lambda: all(w.free_pages == w.total_pages
                               for w in s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers),
                   30, 0.1, "every page back")
    finally:
        cluster.stop()
    assert not our_ray_processes() and not follower_processes()
