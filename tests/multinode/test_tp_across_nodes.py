"""A tensor-parallel prefill worker across hosts: the prefill pool at TP=2 (its two ranks, leader
and follower, packed on the prefill host), the decode pool at TP=1 on the decode host; each
prefill rank sends its own KV heads across the bridge (NIXL over UCX TCP, or gRPC) and the decode
worker joins them (kv_transfer/reshard.py).

The session's prefill host offers one CPU and one unit of `node_prefill`; a TP=2 worker needs one
of each per rank (its placement group's two bundles), so this module restarts that host's Ray
node with two of each (netns_cluster.restart_ray) and gives it its first shape back at the end."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import hf_greedy, random_prompts

from .conftest import Served, listeners, ray_worker_port, tcp_bytes, worker_logs

pytestmark = pytest.mark.multinode

PREFILL_TP = 2
LENGTHS = (3, 16, 17, 45, 100)   # within a page, exactly one, one past, several pages
MAX_TOKENS = 12
UCX_SHM = ("sysv", "posix", "cma", "xpmem", "knem")


@pytest.fixture(scope="module")
def tp_room(netns):
    """The prefill host's Ray node with room for PREFILL_TP rank bundles, for this module."""
    before = netns.host("prefill")
    cpus, units = before.num_cpus, before.resources["node_prefill"]
    netns.restart_ray("prefill", num_cpus=PREFILL_TP, units=PREFILL_TP)
    try:
        yield netns
    finally:
        netns.restart_ray("prefill", num_cpus=cpus, units=units)


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def served_tp(request, tp_room, tmp_path_factory):
    s = Served(tp_room, request.param, tmp_path_factory.mktemp(f"serve-tp-{request.param}"), prefill_tp=PREFILL_TP)
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def _model(tiny_model):
    path = Path(tiny_model("llama"))
    return path, json.loads((path / "config.json").read_text())


def _workers(served) -> dict[str, dict]:
    st = served.status()
    by_role = {w["role"]: w for w in st}
    assert sorted(by_role) == ["decode", "prefill"] and len(st) == 2, st
    return by_role


def _ranks(w: dict) -> list[tuple[str, int]]:
    """(host, pid) of each rank of a worker (its host by role: the pools are pinned)."""
    return [(w["role"], pid) for pid in w["rank_pids"]]


def test_prefill_ranks_on_the_prefill_host(served_tp):
    netns = served_tp.netns
    w = _workers(served_tp)
    pre, dec = w["prefill"], w["decode"]
    ip = netns.host("prefill").ip
    assert pre["healthy"] and pre["state"] == "serving", pre
    assert pre["tp_size"] == PREFILL_TP, pre
    assert pre["node"] == ip and pre["rank_nodes"] == [ip] * PREFILL_TP, pre
    assert len(pre["rank_pids"]) == PREFILL_TP and pre["rank_pids"][0] == pre["pid"], pre
    assert len(set(pre["rank_pids"])) == PREFILL_TP, f"ranks share a process: {pre}"
    ns_pids = set(netns.pids("prefill"))
    assert set(pre["rank_pids"]) <= ns_pids, f"prefill ranks {pre['rank_pids']} not all in the prefill namespace"
    assert pre["num_threads"] == 1, pre   # each rank's own bundle: one CPU
    # the decode worker: TP 1 on the decode host
    assert dec["healthy"] and dec["tp_size"] == 1, dec
    assert dec["node"] == netns.host("decode").ip and dec["rank_nodes"] == [dec["node"]], dec
    assert dec["rank_pids"] == [dec["pid"]] and dec["pid"] in netns.pids("decode"), dec


def test_greedy_parity_and_kv_across_the_bridge(served_tp, tiny_model):
    """Greedy tokens equal transformers'; every prefill rank's own KV heads crossed the bridge
    from its own process (the kernel's byte counters of its TCP connections with the decode
    host), and the decode worker received them all from the prefill host."""
    netns = served_tp.netns
    path, cfg = _model(tiny_model)
    prompts = random_prompts(LENGTHS, cfg["vocab_size"], seed=7)
    w = _workers(served_tp)
    pre, dec = w["prefill"], w["decode"]
    pre_ip, dec_ip = netns.host("prefill").ip, netns.host("decode").ip
    assert pre["node"] != dec["node"]

    def counters():
        return ([tcp_bytes(netns, "prefill", pid, dec_ip) for pid in pre["rank_pids"]],
                tcp_bytes(netns, "decode", dec["pid"], pre_ip))

    before = counters()
    got = served_tp.generate(prompts, MAX_TOKENS)
    after = counters()
    assert got == hf_greedy(path, prompts, MAX_TOKENS)

    # the KV of one rank: its share of the KV heads, K and V, every layer, float32
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * (cfg["num_key_value_heads"] // PREFILL_TP) * head_dim * 2 * 4
    rank_kv = per_token * sum(LENGTHS)
    sent = [a[1] - b[1] for a, b in zip(after[0], before[0])]
    received = after[1][2] - before[1][2]
    print(f"\nTP={PREFILL_TP} -> 1 over {served_tp.transport}: KV of one rank {rank_kv} B; per prefill rank "
          f"(connections, bytes sent to {dec_ip}) {[(a[0], s) for a, s in zip(after[0], sent)]}; decode received "
          f"{received} B from {pre_ip} over {after[1][0]} connections")
    for rank, (conns, s) in enumerate(zip([a[0] for a in after[0]], sent)):
        assert conns >= 1, f"prefill rank {rank} has no TCP connection with the decode host"
        assert s >= rank_kv, f"prefill rank {rank} sent {s} B to the decode host, less than its KV ({rank_kv} B)"
    assert received >= PREFILL_TP * rank_kv, f"the decode worker received {received} B from the prefill host"


def test_listeners_only_on_namespace_addresses(served_tp):
    """Every rank's own listeners (the group's store and gloo, each rank's NIXL or gRPC KV
    endpoint) are on its host's namespace address; Ray's core-worker port (Ray's, on every
    interface) is left out, as in test_multinode."""
    netns = served_tp.netns
    for w in served_tp.status():
        ip = netns.host(w["role"]).ip
        for rank, (host, pid) in enumerate(_ranks(w)):
            ray_port = ray_worker_port(netns, host, pid)
            assert ray_port is not None, f"no Ray core-worker port found for {w['worker_id']} rank {rank}"
            own = [(a, p) for a, p in listeners(netns, host, pid) if p != ray_port]
            print(f"{w['worker_id']} ({w['role']}, tp {w['tp_size']}) rank {rank} pid {pid}: listeners {own}, "
                  f"Ray core worker *:{ray_port}")
            assert all(a == ip for a, _ in own), f"{w['worker_id']} rank {rank} listens beyond {ip}: {own}"
            # at least: every prefill rank gloo, the leader the group's store too, over NIXL each
            # rank its own NIXL listener (a grpc prefill rank only sends); the decode worker its
            # transfer service
            least = 1 + (rank == 0) + (served_tp.transport == "nixl") if w["role"] == "prefill" else 1
            assert len(own) >= least, f"{w['worker_id']} rank {rank}: {own}, expected at least {least} listeners"
    head = netns.host("head").ip
    out = netns.run("head", ["ss", "-Hltn", "sport", "= :50051"]).stdout
    addrs = {line.split()[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for line in out.splitlines()}
    assert addrs == {head}, out


def test_every_rank_ucx_tcp_eth0_only(served_tp, tiny_model):
    """Over NIXL every rank (the follower included) configured UCX for TCP on eth0 only and
    used no shared memory; the decode worker opened inter-node endpoints. Over gRPC no rank
    opened a UCX endpoint between nodes."""
    netns = served_tp.netns
    _, cfg = _model(tiny_model)
    served_tp.generate(random_prompts(LENGTHS[:2], cfg["vocab_size"], seed=3), 4)  # a transfer, whatever ran before
    for w in served_tp.status():
        for rank, (host, pid) in enumerate(_ranks(w)):
            logs = worker_logs(netns, host, pid)
            who = f"{w['worker_id']} rank {rank}"
            if served_tp.transport != "nixl":
                assert not re.search(r"inter-node cfg#\d+", logs), f"{who} opened a UCX endpoint"
                continue
            env_line = re.findall(r"UCX_\* env variables: (.*)", logs)
            assert env_line, f"no UCX log of {who} (UCX_LOG_LEVEL=info did not reach it)"
            assert "UCX_TLS=tcp" in env_line[-1] and "UCX_NET_DEVICES=eth0" in env_line[-1], (who, env_line[-1])
            assert "UCX_NET_DEVICES=lo" not in logs, who
            lanes = re.findall(r"\w+\(([\w/.-]+)\)", "\n".join(re.findall(r"ucp_worker\.c.*cfg#\d+ (.*)", logs)))
            assert lanes and set(lanes) == {"tcp/eth0"}, f"{who} UCX lanes: {sorted(set(lanes))}"
            assert not re.search(r"\b(%s)/" % "|".join(UCX_SHM), logs), f"{who} UCX used shared memory"
            maps = open(f"/proc/{pid}/maps").read()
            assert "/dev/shm/ucx" not in maps, f"{who} has a UCX shared-memory segment mapped"
    if served_tp.transport == "nixl":
        dec = _workers(served_tp)["decode"]
        assert re.search(r"inter-node cfg#\d+ .*tcp/eth0", worker_logs(netns, "decode", dec["pid"]))
