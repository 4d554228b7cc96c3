"""pdcluster across three namespaced hosts: Ray head + router on one, the prefill pool on the
second, the decode pool on the third; KV crosses the bridge over NIXL (UCX over TCP) and gRPC."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import hf_greedy, random_prompts

from .conftest import PREFIX, listeners, ray_worker_port, worker_logs

pytestmark = pytest.mark.multinode

LENGTHS = (3, 16, 17, 45, 100)   # within a page, exactly one, one past, several pages
MAX_TOKENS = 12
NODE_OF = {"prefill": "prefill", "decode": "decode"}
UCX_SHM = ("sysv", "posix", "cma", "xpmem", "knem")


def _prompts(tiny_model):
    path = Path(tiny_model("llama"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return random_prompts(LENGTHS, vocab, seed=7), path


def test_pools_on_their_nodes(served):
    st = served.status()
    by_role = {w["role"]: w for w in st}
    assert set(by_role) == {"prefill", "decode"}
    for role, w in by_role.items():
        assert w["healthy"], w
        assert w["node"] == served.netns.host(NODE_OF[role]).ip, f"{role} worker on {w['node']}"
        # the worker's process is in its host's namespace
        assert w["pid"] in served.netns.pids(NODE_OF[role]), f"{role} worker pid {w['pid']} not in its namespace"


def test_greedy_parity_across_nodes(served, tiny_model):
    prompts, path = _prompts(tiny_model)
    got = served.generate(prompts, MAX_TOKENS)
    assert got == hf_greedy(path, prompts, MAX_TOKENS)
    # KV crossed the bridge: the decode worker sits on another host than the prefill worker
    nodes = {w["role"]: w["node"] for w in served.status()}
    assert nodes["prefill"] != nodes["decode"]


def test_listeners_only_on_namespace_addresses(served):
    netns = served.netns
    for w in served.status():
        host = NODE_OF[w["role"]]
        ip = netns.host(host).ip
        ray_port = ray_worker_port(netns, host, w["pid"])
        assert ray_port is not None, f"no Ray core-worker port found for {w['worker_id']}"
        own = [(a, p) for a, p in listeners(netns, host, w["pid"]) if p != ray_port]
        print(f"{w['worker_id']} ({w['role']}, {w['node']}): listeners {own}, Ray core worker *:{ray_port}")
        # a decode worker receives KV (its transfer service); a grpc prefill worker only sends
        if w["role"] == "decode" or served.transport == "nixl":
            assert own, f"{w['worker_id']} has no listener of its own"
        assert all(a == ip for a, _ in own), f"{w['worker_id']} listens beyond {ip}: {own}"
    # the router: its gRPC port on the head's address only
    head = netns.host("head").ip
    out = netns.run("head", ["ss", "-Hltn", "sport", "= :50051"]).stdout
    addrs = {line.split()[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for line in out.splitlines()}
    assert addrs == {head}, out


def test_every_host_runs_a_kv_store_that_a_conversation_reaches(served, tiny_model):
    """One KV store per host (kv_store.size auto), its process in the host's namespace, listening
    on its address only; a finished turn's pages go into the decode host's store, and the next
    turn's tokens equal Hugging Face's (its prefix fetched across hosts or computed: the router's
    estimate decides; the figures are printed)."""
    from tests.helpers import wait_until

    netns = served.netns
    prompts, path = _prompts(tiny_model)
    first = prompts[-1]
    (answer,) = served.generate([first], 40)
    stores = wait_until(lambda: (s := served.client("stores"))["offloaded"] > 0 and s,
                        60, 0.2, "a turn offloaded into a store")
    hosts = {h.ip: h.name for h in netns.hosts}
    assert sorted(k["node"] for k in stores["stores"]) == sorted(hosts), stores
    for k in stores["stores"]:
        host = hosts[k["node"]]
        assert k["healthy"] and k["pid"] in netns.pids(host), k
        ray_port = ray_worker_port(netns, host, k["pid"])
        own = [(a, p) for a, p in listeners(netns, host, k["pid"]) if p != ray_port]
        assert own and all(a == k["node"] for a, _ in own), f"{k['store_id']} listens beyond {k['node']}: {own}"
    decode_ip = netns.host("decode").ip
    held = next(k for k in stores["stores"] if k["node"] == decode_ip)
    wait_until(lambda: next(k for k in served.client("stores")["stores"] if k["node"] == decode_ip)
               ["kv_index_blocks"] >= (len(first) + 39) // 16, 30, 0.2, "the decode host's store indexed")
    second = first + answer + prompts[2]
    assert served.generate([second], MAX_TOKENS) == hf_greedy(path, [second], MAX_TOKENS)
    after = served.client("stores")
    print(f"KV stores over {served.transport}: {[(k['store_id'], k['node']) for k in after['stores']]}; "
          f"turn 1 offloaded into {held['store_id']} ({after['offloaded']} tokens in all); turn 2: "
          f"{after['fetched']} prompt tokens fetched instead of computed")


def test_nixl_used_ucx_tcp_not_shared_memory(served, tiny_model):
    prompts, _ = _prompts(tiny_model)
    served.generate(prompts[:2], 4)  # a transfer, whatever ran before
    netns = served.netns
    if served.transport != "nixl":  # the grpc transport moves KV over gRPC: UCX opens no endpoint between nodes
        for w in served.status():
            logs = worker_logs(netns, NODE_OF[w["role"]], w["pid"])
            assert not re.search(r"inter-node cfg#\d+", logs), f"{w['worker_id']} opened a UCX endpoint"
        return
    for w in served.status():
        host = NODE_OF[w["role"]]
        logs = worker_logs(netns, host, w["pid"])
        env_line = re.findall(r"UCX_\* env variables: (.*)", logs)
        assert env_line, f"no UCX log of {w['worker_id']} (UCX_LOG_LEVEL=info did not reach it)"
        assert "UCX_TLS=tcp" in env_line[-1] and "UCX_NET_DEVICES=eth0" in env_line[-1], env_line[-1]
        assert "UCX_NET_DEVICES=lo" not in logs
        # the transports UCX chose per endpoint configuration, e.g. "am(tcp/eth0) ka(tcp/eth0)"
        lanes = re.findall(r"\w+\(([\w/.-]+)\)", "\n".join(re.findall(r"ucp_worker\.c.*cfg#\d+ (.*)", logs)))
        assert lanes and set(lanes) == {"tcp/eth0"}, f"{w['worker_id']} UCX lanes: {sorted(set(lanes))}"
        # the protocol tables UCX printed name no shared-memory transport either
        assert not re.search(r"\b(%s)/" % "|".join(UCX_SHM), logs), f"{w['worker_id']} UCX used shared memory"
        maps = open(f"/proc/{w['pid']}/maps").read()
        assert "/dev/shm/ucx" not in maps, f"{w['worker_id']} has a UCX shared-memory segment mapped"
    # the decode worker, which drives the READs, opened an inter-node endpoint to the prefill host
    dec = next(w for w in served.status() if w["role"] == "decode")
    assert re.search(r"inter-node cfg#\d+ .*tcp/eth0", worker_logs(netns, "decode", dec["pid"]))


def test_no_strays_outside_namespaces(netns):
    """Every Ray process of this cluster runs inside one of its namespaces."""
    ours = set()
    for h in netns.hosts:
        ours |= set(netns.pids(h.name))
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if str(netns.workdir) in args:   # a process using this cluster's Ray temp dirs
            assert int(pid) in ours, f"process of the cluster outside its namespaces: {line}"
    assert all(n.startswith(PREFIX) for n in netns.existing_namespaces())
