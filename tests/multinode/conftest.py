"""Fixtures of the multi-node suite: three namespaced hosts on one bridge (scripts/netns_cluster.py),
a Ray cluster across them, and `pdcluster serve --address` run on the head's host.

test_tp_across_nodes.py runs the prefill pool at tensor_parallel_size 2 (both ranks on the
prefill host, whose Ray node it restarts with room for two rank bundles, then gives back its
first shape) against a TP=1 decode pool. test_scale_across_nodes.py scales the decode pool onto a
fourth host that joins the running cluster (netns_cluster add_host) and back, then lets it leave.

Everything here is marked `multinode` and runs only when asked for (`pytest -m multinode
tests/multinode`, `make test-multinode`): it needs root (network namespaces) and takes minutes.
Addresses are only those of the namespaces made here (10.77.0.0/24) and 127.0.0.1; the session
removes every namespace (with its veths and bridge) and every process in them, also after a
failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from netns_cluster import VENV_BIN, NetnsCluster  # noqa: E402

from tests.helpers import wait_until  # noqa: E402

PREFIX = "pdmntest"
SUBNET = "10.77.0"
CLIENT = Path(__file__).with_name("_client.py")
ENGINE = dict(num_pages=256, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=32, page_size=16)
# UCX, for every worker (pdcluster serve hands UCX_* of its environment to the workers it starts):
# TCP only, never shared memory or CMA, and its protocol choices in the worker's log
UCX_ENV = {"UCX_TLS": "tcp", "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}


def _wanted(config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return "multinode" in expr and "not multinode" not in expr


def pytest_configure(config):
    config.addinivalue_line("markers", "multinode: multi-node Ray cluster in network namespaces (root; "
                                       "`make test-multinode`), excluded from `make test`")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = None
    if not _wanted(config):
        skip = pytest.mark.skip(reason="multi-node suite: run with `-m multinode` (make test-multinode)")
    elif os.geteuid() != 0 or shutil.which("ip") is None:
        skip = pytest.mark.skip(reason="multi-node suite needs root and iproute2 (network namespaces)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.multinode)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def netns(tiny_model, tmp_path_factory):
    """The three-host Ray cluster (head, prefill, decode), torn down at the end of the session."""
    tiny_model("llama")  # the built-in model, written once into PDCLUSTER_CACHE (shared by all hosts)
    # a short path: Ray's unix sockets live under it (at most 107 characters)
    c = NetnsCluster(prefix=PREFIX, subnet=SUBNET, workdir=Path(tempfile.mkdtemp(prefix="pdmn-")))
    c.down()  # a previous run that was killed hard may have left its namespaces
    try:
        c.up()
        yield c
    finally:
        c.down()
        left = c.existing_namespaces()
        assert not left, f"namespaces left behind: {left}"
        strays = _processes_mentioning(str(c.workdir))
        assert not strays, f"processes left behind: {strays}"


def _processes_mentioning(text: str) -> list[str]:
    """Processes whose command line names `text` (this cluster's Ray temp dirs)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{d.name}: {cmd[:120]}")
    return found


class Served:
    """`pdcluster serve --address HEAD:6379 --config YAML` running in the head's namespace."""

    def __init__(self, netns: NetnsCluster, transport: str, workdir: Path, migration_wait_s: float = 60.0,
                 prefill_tp: int = 1):
        self.netns = netns
        self.transport = transport
        head = netns.host("head").ip
        self.address = f"{head}:50051"
        self.config = workdir / f"cluster-{transport}.yaml"
        pools = []
        for role, node, tp in (("prefill", "node_prefill", prefill_tp), ("decode", "node_decode", 1)):
            pools.append(dict(name=role, role=role, replicas=1, max_restarts=100,
                              resources=dict(num_cpus=1, custom={node: 1}),
                              engine=dict(ENGINE, tensor_parallel_size=tp) if tp > 1 else ENGINE))
        # JSON is YAML: the prefill pool pinned to the prefill host, the decode pool to the decode
        # host (their custom resources: per rank, so a prefill pool of TP N needs N CPUs and N units
        # of node_prefill there, its ranks packed on that host by the default STRICT_PACK);
        # the router needs the head's only CPU, so it runs there
        self.config.write_text(json.dumps(dict(
            model="tiny", transport=dict(kind=transport),
            router=dict(host=head, port=50051, num_cpus=1, migration_wait_s=migration_wait_s), pools=pools)))
        self.log = workdir / f"serve-{transport}.log"
        self._out = open(self.log, "w")
        self.proc = netns.popen("head", [str(VENV_BIN / "pdcluster"), "serve", "--address", netns.head_address,
                                         "--config", str(self.config), "--insecure", "--http-port", "-1",
                                         "--metrics-port", "-1"], env=UCX_ENV, stdout=self._out,
                                stderr=subprocess.STDOUT)

    def wait_serving(self, timeout_s: float = 300) -> None:
        def ready():
            text = self.log.read_text()
            if self.proc.poll() is not None:
                raise AssertionError(f"pdcluster serve exited ({self.proc.returncode}):\n{text[-4000:]}")
            return "serving pdcluster.v1.Inference on" in text
        wait_until(ready, timeout_s, 0.2, "pdcluster serve reports serving")

    def client(self, *args: str, timeout: float = 300) -> object:
        r = self.netns.run("head", [str(VENV_BIN / "python"), str(CLIENT), self.address, *args], timeout=timeout,
                           check=False)
        assert r.returncode == 0, f"client {args[:1]} failed:\n{r.stdout}\n{r.stderr}"
        return json.loads(r.stdout.strip().splitlines()[-1])

    def status(self) -> list[dict]:
        return self.client("status")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self.client("generate", json.dumps(prompts), str(max_tokens))

    def stop(self, timeout_s: float = 90) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # drains, stops the workers and the router
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._out.close()


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def served(request, netns, tmp_path_factory):
    s = Served(netns, request.param, tmp_path_factory.mktemp(f"serve-{request.param}"))
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def ray_worker_port(netns: NetnsCluster, host: str, pid: int) -> int | None:
    """The port of the Ray core worker's own gRPC server in process `pid` (Ray binds it on every
    interface of the host; it is Ray's, not pdcluster's), from the worker's Ray log."""
    for log in netns.temp_dir(host).glob(f"session_*/logs/python-core-worker-*_{pid}.log"):
        m = re.search(r"worker server started, listening on port (\d+)", log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
    return None


def worker_logs(netns: NetnsCluster, host: str, pid: int) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in netns.temp_dir(host).glob(f"session_*/logs/worker-*-{pid}.*"))


def listeners(netns: NetnsCluster, host: str, pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener of process `pid`, seen inside the host's namespace."""
    out = netns.run(host, ["ss", "-Hltnp"]).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        addr, port = local.rsplit(":", 1)
        found.append((addr.strip("[]").removeprefix("::ffff:"), int(port)))
    return found


def tcp_bytes(netns: NetnsCluster, host: str, pid: int, peer_ip: str) -> tuple[int, int, int]:
    """(connections, bytes sent and acknowledged, bytes received) of process `pid`'s open TCP
    connections with `peer_ip`, summed, seen inside the host's namespace (`ss -tinp`, kernel counters)."""
    out = netns.run(host, ["ss", "-Htinp"]).stdout
    conns = sent = received = 0
    mine = False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket: state, queues, local, peer, users
            parts = line.split()
            mine = f"pid={pid}," in line and len(parts) > 4 and \
                parts[4].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") == peer_ip
            conns += mine
        elif mine:  # its TCP info
            sent += int(m.group(1)) if (m := re.search(r"\bbytes_acked:(\d+)", line)) else 0
            received += int(m.group(1)) if (m := re.search(r"\bbytes_received:(\d+)", line)) else 0
    return conns, sent, received
